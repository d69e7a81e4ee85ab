"""jax's persistent compilation cache for train.py, with a size bound.

A rerun of a step (same program, compiler options and devices) loads XLA's
executable from the cache instead of compiling it. jax evicts the least
recently used entries once the directory passes
`jax_compilation_cache_max_size`; for that it keeps an access-time file
beside every entry (`<key>-atime`: the time in ns, 8 bytes little-endian,
written under the lock `.lockfile`, as jax's `lru_cache.py` does) and fails
every cache write in a directory where one entry lacks it, as every entry
written without a bound does. `use_compilation_cache` stamps those entries
(with their modification time) before it turns the bound on.
"""

import os

import filelock
import jax

from coat_jax.training.memory import GIB

_ENTRY_SUFFIX = '-cache'
_ACCESS_TIME_SUFFIX = '-atime'
_LOCK_FILE = '.lockfile'


def use_compilation_cache(directory: str, max_gib: float = 0.0) -> str | None:
  """Points jax's persistent compilation cache at `directory` (`~`
  expanded), bounded to `max_gib` GiB (least recently used entries evicted;
  0 or less: no bound), unless jax already has a cache directory
  (JAX_COMPILATION_CACHE_DIR or jax.config), whose settings are then left as
  they are; '' leaves jax's setting too. A size bound jax already has
  (JAX_COMPILATION_CACHE_MAX_SIZE) wins over `max_gib`. Returns the
  directory jax caches in, or None.

  Lowering, Mosaic GPU kernels included, still runs on a cache hit. Takes
  effect for compiles that follow.
  """
  current = jax.config.jax_compilation_cache_dir
  if current or not directory:
    return current or None
  directory = os.path.expanduser(directory)
  max_bytes = jax.config.jax_compilation_cache_max_size
  if max_bytes == -1 and max_gib > 0:  # -1: jax's default, no bound
    max_bytes = int(max_gib * GIB)
  if max_bytes > 0:
    stamp_entries_without_access_time(directory)
    jax.config.update('jax_compilation_cache_max_size', max_bytes)
  jax.config.update('jax_compilation_cache_dir', directory)
  return directory


def stamp_entries_without_access_time(directory: str) -> int:
  """Writes an access-time file, from the entry's modification time, for
  every cache entry in `directory` that has none, holding jax's lock (other
  processes may be reading, writing or evicting); returns how many."""
  if not os.path.isdir(directory):
    return 0
  stamped = 0
  with filelock.FileLock(os.path.join(directory, _LOCK_FILE)):
    names = set(os.listdir(directory))
    for name in names:
      if not name.endswith(_ENTRY_SUFFIX):
        continue
      access = name.removesuffix(_ENTRY_SUFFIX) + _ACCESS_TIME_SUFFIX
      if access in names:
        continue
      mtime_ns = os.stat(os.path.join(directory, name)).st_mtime_ns
      with open(os.path.join(directory, access), 'wb') as f:
        f.write(mtime_ns.to_bytes(8, 'little'))
      stamped += 1
  return stamped
