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


def test_budget_never_below_the_largest_leaf():
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


def test_a_state_past_half_the_pinned_pool_does_not_fit_it(monkeypatch):
  state = {'w': jax.ShapeDtypeStruct((1000, 1000), jnp.float32)}  # 4 MB
  monkeypatch.setenv('XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB', '0.01')
  assert checkpoints.fits_pinned_host(state)
  monkeypatch.setenv('XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB', '0.007')
  assert not checkpoints.fits_pinned_host(state)
  monkeypatch.delenv('XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB')
  # 13B's state: 48.5 GiB of params and 25.8 of FP8 moments.
  state_13b = {'w': jax.ShapeDtypeStruct((80, 10**9), jnp.int8)}
  assert not checkpoints.fits_pinned_host(state_13b)


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
  env = dict(os.environ, XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB='1',
             XLA_PYTHON_CLIENT_MEM_FRACTION='0.3')
  out = subprocess.run([sys.executable, '-c', _PINNED_POOL_SAVE,
                        str(tmp_path)], env=env, capture_output=True,
                       text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert 'orbax alone: failed' in out.stdout, out.stdout
  assert 'checkpointer: saved and restored bit-exact' in out.stdout, out.stdout
