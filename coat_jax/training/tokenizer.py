"""Text <-> token ids for a run's data: byte-level, or a tokenizer.json.

The training data (`coat_jax.training.data`) is byte-level for
`data.source=stdlib` and for `text` without `data.tokenizer`; with a
tokenizer it is that Hugging Face tokenizer's ids; `tokens` files come
without one, so their ids cannot be turned back into text here.
"""

import os

from coat_jax.training.config import DataConfig
from coat_jax.training.data import BYTE_VOCAB


class ByteTokenizer:
  """UTF-8 bytes as ids 0..255; decoding replaces broken sequences."""

  vocab_size = BYTE_VOCAB

  def encode(self, text: str) -> list[int]:
    return list(text.encode('utf-8'))

  def decode(self, ids: list[int]) -> str:
    return bytes(ids).decode('utf-8', errors='replace')


class FileTokenizer:
  """A Hugging Face `tokenizers` tokenizer.json (needs `tokenizers`)."""

  def __init__(self, path: str):
    try:
      import tokenizers  # noqa: PLC0415 (optional dependency)
    except ImportError:
      raise ImportError('data.tokenizer needs the `tokenizers` package:'
                        ' pip install tokenizers') from None
    if not os.path.isfile(path):
      raise FileNotFoundError(f'data.tokenizer: no file {path}.')
    self._tok = tokenizers.Tokenizer.from_file(path)
    self.vocab_size = self._tok.get_vocab_size()

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text).ids

  def decode(self, ids: list[int]) -> str:
    return self._tok.decode(ids)


def for_data(config: DataConfig) -> ByteTokenizer | FileTokenizer | None:
  """The tokenizer of the data `config` describes; None for token files."""
  if config.source == 'tokens':
    return None
  if config.source == 'text' and config.tokenizer:
    return FileTokenizer(config.tokenizer)
  return ByteTokenizer()
