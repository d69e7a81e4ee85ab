"""Token streams for training: the default corpus, text files, token files.

A `TokenDataset` holds a train and a validation array of token ids (numpy,
possibly memory-mapped). Batches are random windows drawn from a generator
seeded by (seed, step), so the order is deterministic and a resumed run picks
up exactly where it stopped: the data position is the step.
"""

import collections
from collections.abc import Callable
import concurrent.futures
import dataclasses
import glob
import hashlib
import os
import sysconfig
from typing import Any

import numpy as np

from coat_jax.training.config import DataConfig

BYTE_VOCAB = 256
# uint16 token files hold ids below this.
_UINT16_IDS = 1 << 16
# A glob of each data.source's files, for errors.
_EXAMPLE_GLOB = {'text': '*.txt', 'tokens': '*.bin'}


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


def _expand(paths: tuple[str, ...], source: str) -> list[str]:
  """The files `paths` (files or globs) name, sorted per pattern."""
  files = []
  for pattern in paths:
    matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
    if not matches:
      raise FileNotFoundError(f'data.paths: no file matches {pattern!r}.')
    found = [m for m in matches if os.path.isfile(m)]
    if not found:
      example = os.path.join(pattern, '**', _EXAMPLE_GLOB[source])
      raise ValueError(
          f'data.paths: {pattern!r} names only directories, and data.paths'
          f' takes files: name the files with a glob, e.g. {example!r}.')
    files += found
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


def _encode_text(files: list[str], tokenizer_path: str,
                 vocab_size: int) -> np.ndarray:
  try:
    import tokenizers  # noqa: PLC0415 (optional dependency)
  except ImportError:
    raise ImportError('data.tokenizer needs the `tokenizers` package:'
                      ' pip install tokenizers') from None
  if not os.path.isfile(tokenizer_path):
    raise FileNotFoundError(f'data.tokenizer: no file {tokenizer_path}.')
  tok = tokenizers.Tokenizer.from_file(tokenizer_path)
  chunks = []
  for f in files:
    with open(f, encoding='utf-8', errors='replace') as fh:
      ids = np.asarray(tok.encode(fh.read()).ids, np.uint32)
    if len(ids):
      _check_ids(0, int(ids.max()), vocab_size,
                 f'{f} (tokenized by data.tokenizer={tokenizer_path})',
                 'is data.tokenizer the model\'s tokenizer?')
    chunks.append(ids)
  return np.concatenate(chunks) if chunks else np.zeros(0, np.uint32)


def _load_token_file(path: str, dtype: str, vocab_size: int) -> np.ndarray:
  """A token file's ids, memory-mapped, checked against the model.

  `.npy` files carry their dtype; `.bin` files are read as data.token_dtype.
  A uint32 file read as uint16 is caught where it can be: its size is then a
  multiple of 4 bytes and every second uint16 (the high half of each
  little-endian uint32) is below ceil(vocab_size / 65536), i.e. 0 for a
  vocabulary of at most 65536, while some other one is not.
  """
  if path.endswith('.npy'):
    arr = np.load(path, mmap_mode='r')
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
      raise ValueError(f'{path}: expected a 1-D integer array of token ids,'
                       f' got {arr.dtype}{list(arr.shape)}.')
    if not len(arr):
      raise ValueError(f'data.paths: {path} holds no token ids.')
    _check_ids(*_id_range(arr), vocab_size, path, 'check the file.')
    return arr
  size = os.path.getsize(path)
  if size % np.dtype(dtype).itemsize:
    raise ValueError(
        f'{path}: its size ({size} bytes) is not a multiple of'
        f' data.token_dtype={dtype} ({np.dtype(dtype).itemsize} bytes);'
        ' is the dtype right? (data.token_dtype: uint16 or uint32)')
  arr = np.memmap(path, dtype=dtype, mode='r')
  hint = f'is data.token_dtype={dtype} the dtype it was written in?'
  if dtype != 'uint16' or len(arr) % 2:
    _check_ids(*_id_range(arr), vocab_size, path, hint)
    return arr
  even, odd = _pair_maxima(arr)
  high = -(-vocab_size // _UINT16_IDS)  # bound of a uint32's high half
  if odd < high <= even:
    raise ValueError(
        f'{path} looks like uint32 token ids read as data.token_dtype=uint16:'
        ' every second uint16 (the high half of a little-endian uint32) is'
        f' below {high} and the others are not. Set data.token_dtype=uint32.')
  _check_ids(0, max(even, odd), vocab_size, path, hint)
  return arr


def _check_ids(low: int, high: int, vocab_size: int, where: str,
               hint: str) -> None:
  """Raises ValueError, naming `where`, unless the ids low..high (the
  smallest and largest) are in [0, vocab_size)."""
  if low < 0:
    raise ValueError(f'{where} holds token id {low}: token ids cannot be'
                     f' negative; {hint}')
  if high >= vocab_size:
    raise ValueError(
        f'{where} holds token id {high}, but the model has vocab_size='
        f'{vocab_size}: raise model.vocab_size, or {hint}')


# Ids per chunk of the scans below: a memory-mapped file is read once, a
# chunk at a time, never loaded whole.
_CHUNK = 1 << 24


def _id_range(ids: np.ndarray) -> tuple[int, int]:
  """(smallest, largest) id of a non-empty 1-D array."""
  low, high = [], []
  for i in range(0, len(ids), _CHUNK):
    part = np.asarray(ids[i:i + _CHUNK])
    low.append(part.min())
    high.append(part.max())
  return int(min(low)), int(max(high))


def _pair_maxima(ids: np.ndarray) -> tuple[int, int]:
  """(largest even-indexed id, largest odd-indexed id) of a non-empty 1-D
  array of even length."""
  pairs = [np.asarray(ids[i:i + _CHUNK]).reshape(-1, 2).max(axis=0)
           for i in range(0, len(ids), _CHUNK)]
  even, odd = np.max(pairs, axis=0)
  return int(even), int(odd)


def _split_tail(tokens: np.ndarray, fraction: float):
  cut = int(len(tokens) * (1 - fraction))
  return tokens[:cut], tokens[cut:]


def load_dataset(config: DataConfig, vocab_size: int, *,
                 init_from: str | None = None) -> TokenDataset:
  """Loads the corpus that `config` names and checks it against the model.

  Every check reads only the data (no compilation): call it before compiling
  the step, so that bad data stops a run at once.

  Args:
    config: the data section of the config (data.tokenizer resolved, as
      `tasks.data_config` does).
    vocab_size: the model's vocabulary; every token id must be in
      [0, vocab_size).
    init_from: model.init_from, if the model starts from a checkpoint: its
      vocabulary is its tokenizer's, so byte-level data (no tokenizer) is
      refused when the vocabulary is larger than the 256 byte ids.

  Raises:
    FileNotFoundError: a path or glob matches nothing.
    ValueError: a path that names only directories, empty files, a corpus
      too short for one window, token ids the model cannot embed (negative,
      or vocab_size or more; naming the file), a uint32 file read as uint16,
      or byte-level data for a checkpoint's larger vocabulary.
  """
  byte_level = config.source == 'stdlib' or (
      config.source == 'text' and not config.tokenizer)
  if byte_level:
    _check_byte_level(config, vocab_size, init_from)
  fraction = config.val_fraction
  if config.source == 'stdlib':
    files = stdlib_files()
    if not files:
      raise FileNotFoundError('no .py files in this interpreter\'s standard'
                              ' library; use data.source=text.')
    root = sysconfig.get_paths()['stdlib']
    train_files, val_files = _split_files(files, fraction, root)
    train, val = _read_bytes(train_files), _read_bytes(val_files)
  else:
    files = _expand(config.paths, config.source)
    for f in files:
      if os.path.getsize(f) == 0:
        raise ValueError(f'data.paths: {f} is empty.')
    if config.source == 'text':
      load = ((lambda fs: _encode_text(fs, config.tokenizer, vocab_size))
              if config.tokenizer else _read_bytes)
    else:
      load = lambda fs: np.concatenate(
          [_load_token_file(f, config.token_dtype, vocab_size) for f in fs])
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
  return TokenDataset(train, val, vocab_size)


def _check_byte_level(config: DataConfig, vocab_size: int,
                      init_from: str | None) -> None:
  """Raises ValueError where byte ids (0-255) do not suit the model: a
  vocabulary smaller than 256, or a checkpoint's larger one (its ids are
  its tokenizer's, not bytes)."""
  if vocab_size < BYTE_VOCAB:
    raise ValueError(f'the data is byte-level ({BYTE_VOCAB} ids) but the'
                     f' model has vocab_size={vocab_size}: set'
                     f' model.vocab_size={BYTE_VOCAB} or more.')
  if init_from is None or vocab_size == BYTE_VOCAB:
    return
  shipped = os.path.join(init_from, 'tokenizer.model')
  convert = (f' ({init_from} has tokenizer.model but no tokenizer.json:'
             ' transformers writes one with AutoTokenizer.from_pretrained(DIR)'
             '.save_pretrained(DIR))' if os.path.isfile(shipped) else '')
  raise ValueError(
      f'model.init_from={init_from} has a {vocab_size}-token vocabulary,'
      f' but data.source={config.source} without data.tokenizer is'
      f' byte-level (ids 0-{BYTE_VOCAB - 1}): the model would train on raw'
      ' bytes. Use data.source=text with data.tokenizer=<the model\'s'
      f' tokenizer.json> (a tokenizer.json in {init_from} is used by'
      f' itself){convert}, or data.source=tokens with ids from its'
      ' tokenizer.')


class Prefetch:
  """make(i) for i in [start, stop), in order, each made on a background
  thread while the caller uses the ones before it, at most `depth` ahead.

  For host work (drawing images, gathering windows: numpy, which releases
  the GIL in its array work) that would otherwise sit between two steps. An
  exception in make(i) is raised by the `next` that returns i. `close`
  cancels what is not yet made.
  """

  def __init__(self, make: Callable[[int], Any], start: int, stop: int,
               depth: int = 2):
    if depth < 1:
      raise ValueError(f'depth={depth} must be >= 1.')
    self._make, self._next, self._stop = make, start, stop
    self._pool = concurrent.futures.ThreadPoolExecutor(
        1, thread_name_prefix='coat_jax_batches')
    self._made = collections.deque()
    for _ in range(depth):
      self._submit()

  def _submit(self) -> None:
    if self._next < self._stop:
      self._made.append(self._pool.submit(self._make, self._next))
      self._next += 1

  def __iter__(self) -> 'Prefetch':
    return self

  def __next__(self) -> Any:
    if not self._made:
      raise StopIteration
    future = self._made.popleft()
    self._submit()
    return future.result()

  def close(self) -> None:
    self._pool.shutdown(wait=True, cancel_futures=True)
    self._made.clear()
