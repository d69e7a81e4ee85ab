"""The host memory a train checkpoint's save and restore take."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coat_jax import training
from coat_jax.training import checkpoints


def test_budget_is_a_share_of_free_memory_capped_by_orbax():
  small = {'w': jax.ShapeDtypeStruct((4, 4), jnp.float32)}
  gb = checkpoints.host_transfer_gb(small)
  assert 0 < gb <= checkpoints._ORBAX_CONCURRENT_GB


def test_budget_above_the_largest_leaf():
  # 200 GB of float32: orbax refuses a leaf larger than its budget.
  huge = {'w': jax.ShapeDtypeStruct((50_000, 1_000_000), jnp.float32),
          'b': jax.ShapeDtypeStruct((3,), jnp.float8_e4m3fn)}
  assert checkpoints.host_transfer_gb(huge) >= 200


def test_only_a_state_past_the_budget_streams(tmp_path, monkeypatch):
  state = {'w': jax.ShapeDtypeStruct((1000, 1000), jnp.float32),
           'v': jax.ShapeDtypeStruct((1000, 1000), jnp.float32)}  # 8 MB
  assert not checkpoints.streams_to_host(state)
  monkeypatch.setattr(checkpoints, '_ORBAX_CONCURRENT_GB', 0.006)
  assert checkpoints.host_transfer_gb(state) == 0.006
  assert checkpoints.streams_to_host(state)
  saver = checkpoints.Checkpointer(str(tmp_path), training.Config())
  assert not saver.blocking_saves  # no template: orbax's defaults


def test_past_half_the_pinned_pool_does_not_fit_it(monkeypatch):
  monkeypatch.setenv('XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB', '0.01')
  assert checkpoints.fits_pinned_host(0.004)
  monkeypatch.setenv('XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB', '0.007')
  assert not checkpoints.fits_pinned_host(0.004)
  monkeypatch.delenv('XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB')
  # 13B's state: 48.5 GiB of params and 25.8 of FP8 moments.
  assert not checkpoints.fits_pinned_host(80)


def test_stream_parts_are_small_shares_of_the_pool_and_of_free_memory(
    monkeypatch):
  state = {'w': jax.ShapeDtypeStruct((1000, 1000), jnp.float32)}  # 4 MB
  monkeypatch.setattr(checkpoints, '_free_host_gb', lambda: 64.0)
  monkeypatch.setenv('XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB', '0.064')
  # Just above the largest leaf; the pool's thirty-second is 0.002.
  assert checkpoints.stream_part_gb(state) == pytest.approx(0.00404)
  monkeypatch.setenv('XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB', '0.32')
  part = checkpoints.stream_part_gb(state)
  assert part == pytest.approx(0.01)
  # Two parts alive grow the pool by up to four: half the pool at most.
  assert checkpoints.fits_pinned_host(4 * part)
  assert checkpoints.stream_part_gb(state, budget_gb=0.005) == 0.005
  monkeypatch.setattr(checkpoints, '_free_host_gb', lambda: 0.384)
  assert checkpoints.stream_part_gb(state) == pytest.approx(0.006)
  # 13B on a 128 GB host with the default pool: parts of about 2 GB.
  monkeypatch.delenv('XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB')
  monkeypatch.setattr(checkpoints, '_free_host_gb', lambda: 122.0)
  assert checkpoints.stream_part_gb(state) == pytest.approx(1.90625)


def test_a_streaming_checkpointer_saves_and_reads_by_parts(tmp_path,
                                                           monkeypatch):
  state = {'w': jax.ShapeDtypeStruct((1000, 1000), jnp.float32),
           'v': jax.ShapeDtypeStruct((1000, 1000), jnp.float32)}  # 8 MB
  monkeypatch.setattr(checkpoints, '_ORBAX_CONCURRENT_GB', 0.006)
  monkeypatch.setenv('XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB', '0.064')
  handler_of = checkpoints._state_handler
  asked = []
  monkeypatch.setattr(checkpoints, '_state_handler', lambda *a: (
      asked.append(a[1:]) or handler_of(*a)))
  saver = checkpoints.Checkpointer(str(tmp_path), training.Config(),
                                   template=state)
  assert saver.blocking_saves
  # The handler's budget is the part, not the whole budget (0.006).
  assert asked == [(pytest.approx(0.00404), True, True)]
  assert saver.host_memory_warning is None


def test_a_leaf_too_large_for_the_pinned_pool_warns(tmp_path, monkeypatch):
  state = {'w': jax.ShapeDtypeStruct((1000, 1000), jnp.float32),
           'v': jax.ShapeDtypeStruct((1000, 1000), jnp.float32)}  # 8 MB
  monkeypatch.setattr(checkpoints, '_ORBAX_CONCURRENT_GB', 0.006)
  # Four parts of one 4 MB leaf are more than half of a 16 MB pool.
  monkeypatch.setenv('XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB', '0.016')
  saver = checkpoints.Checkpointer(str(tmp_path), training.Config(),
                                   template=state)
  assert saver.blocking_saves
  warning = saver.host_memory_warning
  assert 'holds all of it' in warning and 'largest leaf' in warning
  assert 'XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB' in warning


@pytest.mark.parametrize('pinned_gb', ['64', '0.001'])
def test_save_returns_once_the_state_is_off_the_device(
    tmp_path, monkeypatch, pinned_gb):
  """A save that returns has copied every array off the device (the train
  step donates the state's buffers right after it), with write and read
  budgets below the state's size, through the pinned pool or not."""
  monkeypatch.setenv('XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB', pinned_gb)
  monkeypatch.setattr(checkpoints, '_ORBAX_CONCURRENT_GB', 1e-3)  # 1 MB
  state = {f'w{i}': jnp.arange(100_000, dtype=jnp.float32) * (i + 1)
           for i in range(12)}  # 4.8 MB in all
  expect = {k: np.asarray(v) for k, v in state.items()}
  template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                          state)
  config = training.Config()
  asked = []
  monkeypatch.setattr(checkpoints._Deprioritized, 'key_priority',
                      lambda self, key: asked.append(key) or
                      checkpoints.ocp_types.TransferPriority
                      .ASYNCHRONOUS_DEPRIORITIZED)
  saver = checkpoints.Checkpointer(str(tmp_path), config, template=template)
  # Larger than the budget: copied off the device a part at a time, so the
  # save returns only once written.
  assert saver.blocking_saves
  saver.save(1, state)
  assert saver.latest_step() == 1
  assert len(asked) == len(state)  # orbax took each array's priority
  for x in state.values():
    x.delete()  # what donation does to them
  saver.close()
  loader = checkpoints.Checkpointer(str(tmp_path), config, template=template)
  got = loader.restore(1, template)
  for k, v in expect.items():
    np.testing.assert_array_equal(np.asarray(got[k]), v)


def _run_on_gpu(script: str, tmp_path, pinned_pool_gb: float):
  """Runs `script` with tmp_path as its argument in a process of its own
  (XLA's pinned pool is sized when the GPU client starts); its output."""
  env = dict(os.environ,
             XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=str(pinned_pool_gb),
             XLA_PYTHON_CLIENT_MEM_FRACTION='0.3')
  out = subprocess.run([sys.executable, '-c', script, str(tmp_path)],
                       env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  return out


_PINNED_POOL_SAVE = textwrap.dedent('''
    import sys
    import jax, jax.numpy as jnp, numpy as np
    import orbax.checkpoint as ocp
    from coat_jax import training
    from coat_jax.training import checkpoints
    state = {f'w{i}': jax.random.normal(jax.random.key(i), (64, 1024, 1024))
             for i in range(6)}  # 1.6 GB of float32 on the GPU
    template = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    plain = ocp.StandardCheckpointer()
    try:
      plain.save(sys.argv[1] + '/plain', state)
      plain.wait_until_finished()
      print('orbax alone: saved')
    except Exception as e:  # the pinned pool overflows
      print('orbax alone: failed', type(e).__name__)
    saver = checkpoints.Checkpointer(sys.argv[1] + '/ours', training.Config(),
                                     template=template)
    saver.save(1, state, wait=True)
    got = saver.restore(1, template)
    same = all(np.array_equal(np.asarray(state[k]), np.asarray(got[k]))
               for k in state)
    print('checkpointer: saved and restored', 'bit-exact' if same else 'WRONG')
''')


@pytest.mark.gpu
def test_gpu_state_larger_than_the_pinned_pool_saves(tmp_path):
  """A 1 GB pinned pool (XLA's default is 64 GB, below a 13B state) and a
  1.6 GB state: orbax alone fails to copy it off the GPU; the train
  checkpointer saves it through ordinary host memory."""
  out = _run_on_gpu(_PINNED_POOL_SAVE, tmp_path, pinned_pool_gb=1)
  assert 'orbax alone: failed' in out.stdout, out.stdout
  assert 'checkpointer: saved and restored bit-exact' in out.stdout, out.stdout


_STREAMING_SAVE = textwrap.dedent('''
    import resource, sys
    import jax, numpy as np
    from coat_jax import training
    from coat_jax.training import checkpoints
    state = {f'w{i}': jax.random.normal(jax.random.key(i), (64, 1024, 1024))
             for i in range(32)}  # 8.6 GB of float32 on the GPU
    template = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    saver = checkpoints.Checkpointer(sys.argv[1], training.Config(),
                                     template=template)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    saver.save(1, state)
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    print(f'streams {saver.blocking_saves} grew {grew / 1e9:.2f} GB')
    got = saver.restore(1, template)
    same = all(np.array_equal(np.asarray(state[k]), np.asarray(got[k]))
               for k in ('w0', 'w31'))
    print('restored', 'bit-exact' if same else 'WRONG')
''')


@pytest.mark.gpu
def test_gpu_streaming_save_holds_a_few_parts_in_host_memory(tmp_path):
  """An 8.6 GB state with a 4 GB pinned pool (a 1 GB budget, parts of one
  0.27 GB leaf) streams off the GPU: the process's host memory, the pinned
  pool's pages included, grows by a few parts, not by the state (jax
  keeps a host copy on each array it copies to ordinary host memory, so
  parts copied there would pile up)."""
  out = _run_on_gpu(_STREAMING_SAVE, tmp_path, pinned_pool_gb=4)
  words = out.stdout.split()
  assert words[1] == 'True', out.stdout  # it streamed
  assert float(words[3]) < 3.0, out.stdout  # the state is 8.6 GB
  assert 'restored bit-exact' in out.stdout, out.stdout
