"""Token streams for training: the default corpus, text files, token files.

A `TokenDataset` holds a train and a validation array of token ids (numpy,
possibly memory-mapped). Batches are random windows drawn from a generator
seeded by (seed, step), so the order is deterministic and a resumed run picks
up exactly where it stopped: the data position is the step.
"""

import dataclasses
import glob
import hashlib
import os
import sysconfig

import numpy as np

from coat_jax.training.config import DataConfig

BYTE_VOCAB = 256


@dataclasses.dataclass(frozen=True)
class TokenDataset:
  """Train and validation token ids (1-D integer arrays) and their vocab."""

  train: np.ndarray
  val: np.ndarray
  vocab_size: int

  def batch(self, split: str, seed: int, index: int, batch_size: int,
            seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Window `index` of `split`: (inputs, targets), int32 (batch, seq)."""
    tokens = self.train if split == 'train' else self.val
    rng = np.random.default_rng([seed, index, split == 'val'])
    starts = rng.integers(0, len(tokens) - seq_len, size=batch_size)
    windows = np.stack([tokens[s:s + seq_len + 1] for s in starts])
    windows = windows.astype(np.int32)
    return windows[:, :-1], windows[:, 1:]


def stdlib_files() -> list[str]:
  """The running interpreter's standard library .py files, sorted."""
  root = sysconfig.get_paths()['stdlib']
  files = sorted(glob.glob(os.path.join(root, '**', '*.py'), recursive=True))
  return [f for f in files if 'site-packages' not in f]


def _is_val(path: str, root: str, fraction: float) -> bool:
  """Deterministic split by file: a hash of the relative path."""
  rel = os.path.relpath(path, root).encode()
  return int(hashlib.sha256(rel).hexdigest()[:8], 16) / 16**8 < fraction


def _expand(paths: tuple[str, ...]) -> list[str]:
  files = []
  for pattern in paths:
    matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
    if not matches:
      raise FileNotFoundError(f'data.paths: no file matches {pattern!r}.')
    files += [m for m in matches if os.path.isfile(m)]
  return files


def _split_files(files: list[str], fraction: float, root: str):
  val = [f for f in files if _is_val(f, root, fraction)]
  train = [f for f in files if f not in set(val)]
  return train, val


def _read_bytes(files: list[str]) -> np.ndarray:
  chunks = []
  for f in files:
    with open(f, 'rb') as fh:
      chunks.append(np.frombuffer(fh.read(), np.uint8))
  return np.concatenate(chunks) if chunks else np.zeros(0, np.uint8)


def _encode_text(files: list[str], tokenizer_path: str) -> np.ndarray:
  try:
    import tokenizers  # noqa: PLC0415 (optional dependency)
  except ImportError:
    raise ImportError('data.tokenizer needs the `tokenizers` package:'
                      ' pip install tokenizers') from None
  if not os.path.isfile(tokenizer_path):
    raise FileNotFoundError(f'data.tokenizer: no file {tokenizer_path}.')
  tok = tokenizers.Tokenizer.from_file(tokenizer_path)
  ids = []
  for f in files:
    with open(f, encoding='utf-8', errors='replace') as fh:
      ids.extend(tok.encode(fh.read()).ids)
  return np.asarray(ids, np.uint32)


def _load_token_file(path: str, dtype: str) -> np.ndarray:
  if path.endswith('.npy'):
    arr = np.load(path, mmap_mode='r')
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
      raise ValueError(f'{path}: expected a 1-D integer array of token ids,'
                       f' got {arr.dtype}{list(arr.shape)}.')
    return arr
  if os.path.getsize(path) % np.dtype(dtype).itemsize:
    raise ValueError(f'{path}: its size is not a multiple of'
                     f' data.token_dtype={dtype}; is the dtype right?')
  return np.memmap(path, dtype=dtype, mode='r')


def _split_tail(tokens: np.ndarray, fraction: float):
  cut = int(len(tokens) * (1 - fraction))
  return tokens[:cut], tokens[cut:]


def load_dataset(config: DataConfig, vocab_size: int) -> TokenDataset:
  """Loads the corpus that `config` names and checks it against the model.

  Args:
    config: the data section of the config.
    vocab_size: the model's vocabulary; every token id must be below it.

  Raises:
    FileNotFoundError: a path or glob matches nothing.
    ValueError: empty files, a corpus too short for one window, or token ids
      the model cannot embed.
  """
  fraction = config.val_fraction
  if config.source == 'stdlib':
    files = stdlib_files()
    if not files:
      raise FileNotFoundError('no .py files in this interpreter\'s standard'
                              ' library; use data.source=text.')
    root = sysconfig.get_paths()['stdlib']
    train_files, val_files = _split_files(files, fraction, root)
    train, val = _read_bytes(train_files), _read_bytes(val_files)
    data_vocab = BYTE_VOCAB
  else:
    files = _expand(config.paths)
    for f in files:
      if os.path.getsize(f) == 0:
        raise ValueError(f'data.paths: {f} is empty.')
    if config.source == 'text':
      load = ((lambda fs: _encode_text(fs, config.tokenizer))
              if config.tokenizer else _read_bytes)
      data_vocab = None if config.tokenizer else BYTE_VOCAB
    else:
      load = lambda fs: np.concatenate(
          [_load_token_file(f, config.token_dtype) for f in fs])
      data_vocab = None
    if len(files) > 1:
      train_files, val_files = _split_files(files, fraction, '/')
      if not val_files or not train_files:
        train_files, val_files = files[:-1], files[-1:]
      train, val = load(train_files), load(val_files)
    else:
      train, val = _split_tail(load(files), fraction)
  for name, tokens in (('training', train), ('validation', val)):
    if len(tokens) <= config.seq_len:
      raise ValueError(
          f'the {name} split has {len(tokens)} tokens, too few for one window'
          f' of data.seq_len={config.seq_len} + 1: add data or lower'
          ' data.seq_len / data.val_fraction.')
  if data_vocab is not None and data_vocab > vocab_size:
    raise ValueError(f'the data is byte-level (256 ids) but the model has'
                     f' vocab_size={vocab_size}: set model.vocab_size=256 or'
                     ' more.')
  for name, tokens in (('training', train), ('validation', val)):
    top = _max_token(tokens)
    if top >= vocab_size:
      raise ValueError(
          f'the {name} data holds token id {top}, but the model has'
          f' vocab_size={vocab_size}: raise model.vocab_size or check'
          ' data.token_dtype / the tokenizer.')
  return TokenDataset(train, val, vocab_size)


def _max_token(tokens: np.ndarray, chunk: int = 1 << 24) -> int:
  """Max id, in chunks so a memory-mapped file is never loaded whole."""
  return int(max(np.max(tokens[i:i + chunk]) for i in range(0, len(tokens),
                                                            chunk)))
