"""train.py's persistent compilation cache: which directory, and its bound."""

import os
import subprocess
import sys
import textwrap

import jax
import pytest

from coat_jax.training import compilation_cache

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


@pytest.fixture
def jax_cache_settings():
  """Restores jax's cache directory and bound after the test."""
  before = (jax.config.jax_compilation_cache_dir,
            jax.config.jax_compilation_cache_max_size)
  yield before
  jax.config.update('jax_compilation_cache_dir', before[0])
  jax.config.update('jax_compilation_cache_max_size', before[1])


def test_a_directory_jax_has_wins(tmp_path, monkeypatch, jax_cache_settings):
  """A directory jax already has (here conftest's JAX_COMPILATION_CACHE_DIR)
  wins over the argument, its bound too; '' leaves jax's setting; '~' is
  expanded; max_gib becomes jax's bound in bytes, 0 none."""
  before_dir, before_size = jax_cache_settings
  assert before_dir
  use = compilation_cache.use_compilation_cache
  assert use(str(tmp_path), max_gib=1.0) == before_dir
  assert jax.config.jax_compilation_cache_max_size == before_size
  assert use('') == before_dir
  monkeypatch.setenv('HOME', str(tmp_path))
  jax.config.update('jax_compilation_cache_dir', None)
  jax.config.update('jax_compilation_cache_max_size', -1)
  assert use('', max_gib=1.0) is None
  assert jax.config.jax_compilation_cache_dir is None
  want = str(tmp_path / 'xla')
  assert use('~/xla', max_gib=0) == want
  assert jax.config.jax_compilation_cache_dir == want
  assert jax.config.jax_compilation_cache_max_size == -1
  jax.config.update('jax_compilation_cache_dir', None)
  assert use('~/xla', max_gib=1.5) == want
  assert jax.config.jax_compilation_cache_max_size == 3 << 29
  jax.config.update('jax_compilation_cache_dir', None)
  jax.config.update('jax_compilation_cache_max_size', 12345)  # jax's wins
  assert use('~/xla', max_gib=1.5) == want
  assert jax.config.jax_compilation_cache_max_size == 12345


def test_stamps_only_entries_without_an_access_time(tmp_path):
  (tmp_path / 'a-cache').write_bytes(b'x')
  (tmp_path / 'b-cache').write_bytes(b'y')
  (tmp_path / 'b-atime').write_bytes((7).to_bytes(8, 'little'))
  (tmp_path / '.lockfile').write_bytes(b'')
  os.utime(tmp_path / 'a-cache', ns=(5, 123_456_789))
  stamp = compilation_cache.stamp_entries_without_access_time
  assert stamp(str(tmp_path)) == 1
  assert int.from_bytes((tmp_path / 'a-atime').read_bytes(), 'little') == (
      123_456_789)
  assert int.from_bytes((tmp_path / 'b-atime').read_bytes(), 'little') == 7
  assert stamp(str(tmp_path)) == 0
  assert stamp(str(tmp_path / 'missing')) == 0


_COMPILE_SIX = textwrap.dedent("""
    import sys, warnings
    import jax, jax.numpy as jnp, numpy as np
    from coat_jax.training import compilation_cache
    directory, max_gib, offset = sys.argv[1], float(sys.argv[2]), int(
        sys.argv[3])
    assert compilation_cache.use_compilation_cache(directory, max_gib)
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
    warnings.filterwarnings(  # a failed cache write fails the run
        'error', message='Error writing persistent compilation cache')
    x = np.ones(7, np.float32)  # no program of its own
    for i in range(offset, offset + 6):
      jax.jit(lambda x, i=i: jnp.sin(x) * i + 1)(x).block_until_ready()
    """)


def _compile_six(directory, max_gib, offset):
  """Six programs (`offset` tells them apart) compiled in a fresh process
  caching in `directory`, bounded to `max_gib`."""
  env = {k: v for k, v in os.environ.items()
         if k != 'JAX_COMPILATION_CACHE_DIR'}  # conftest's would win
  out = subprocess.run(
      [sys.executable, '-c', _COMPILE_SIX, str(directory), str(max_gib),
       str(offset)], cwd=ROOT, env=env, capture_output=True, text=True,
      timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  return {p: os.path.getsize(os.path.join(directory, p))
          for p in os.listdir(directory) if p.endswith('-cache')}


def test_bound_evicts_entries_written_without_one(tmp_path):
  """Entries an unbounded run wrote have no access time, on which jax's
  eviction fails every write; a bounded run in the same directory writes
  its own, evicting the least recently used (here the unbounded run's, the
  oldest) and staying under the bound."""
  old = _compile_six(tmp_path, 0, offset=0)
  assert len(old) == 6
  assert not [p for p in os.listdir(tmp_path) if p.endswith('-atime')]
  for name in old:
    os.utime(tmp_path / name, ns=(0, 10**18))  # 2001
  bound = 3.5 * max(old.values())  # about three entries
  now = _compile_six(tmp_path, bound / (1 << 30), offset=100)
  assert 1 <= len(now) <= 3 and sum(now.values()) <= bound
  assert not set(now) & set(old)
  for name in now:
    assert (tmp_path / name.replace('-cache', '-atime')).exists()
