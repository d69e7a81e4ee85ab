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


def test_stream_parts_are_a_share_of_free_memory_above_the_largest_leaf(
    monkeypatch):
  state = {'w': jax.ShapeDtypeStruct((1000, 1000), jnp.float32)}  # 4 MB
  monkeypatch.setattr(checkpoints, '_free_host_gb', lambda: 0.128)
  # Just above the largest leaf; free memory's sixty-fourth is 0.002.
  assert checkpoints.stream_part_gb(state) == pytest.approx(0.00404)
  monkeypatch.setattr(checkpoints, '_free_host_gb', lambda: 0.64)
  assert checkpoints.stream_part_gb(state) == pytest.approx(0.01)
  assert checkpoints.stream_part_gb(state, budget_gb=0.005) == 0.005
  # 13B on a 128 GB host: parts of about 2 GB, above any per-layer leaf.
  monkeypatch.setattr(checkpoints, '_free_host_gb', lambda: 122.0)
  assert checkpoints.stream_part_gb(state) == pytest.approx(1.90625)


def test_a_streaming_checkpointer_saves_and_reads_by_parts(tmp_path,
                                                           monkeypatch):
  state = {'w': jax.ShapeDtypeStruct((1000, 1000), jnp.float32),
           'v': jax.ShapeDtypeStruct((1000, 1000), jnp.float32)}  # 8 MB
  monkeypatch.setattr(checkpoints, '_ORBAX_CONCURRENT_GB', 0.006)
  monkeypatch.setattr(checkpoints, '_free_host_gb', lambda: 0.128)
  handler_of = checkpoints._state_handler
  asked = []
  monkeypatch.setattr(checkpoints, '_state_handler', lambda *a: (
      asked.append(a[1:]) or handler_of(*a)))
  saver = checkpoints.Checkpointer(str(tmp_path), training.Config(),
                                   template=state)
  assert saver.blocking_saves
  # The handler's budget is the part, not the whole budget (0.006).
  assert asked == [(pytest.approx(0.00404), True)]


def test_streaming_parts_are_written_from_aliases_of_the_state(
    tmp_path, monkeypatch):
  """A streaming save hands orbax's writer new array objects over the
  state's own device buffers, sharded ones included, collects their host
  copies after each part, and restores what it saved: jax keeps a host
  copy on the object it copied, so the state's own arrays would hold every
  part's copy until the save ends."""
  monkeypatch.setattr(checkpoints, '_ORBAX_CONCURRENT_GB', 1e-3)  # 1 MB
  mesh = jax.make_mesh((8,), ('x',))
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('x'))
  state = {'stacked': jax.device_put(
               jax.random.normal(jax.random.key(0), (8, 300, 128)), rows),
           'moment': jax.random.normal(jax.random.key(1), (4, 128, 128)
                                       ).astype(jnp.float8_e4m3fn),
           'step': jnp.int32(7)}
  expect = {k: np.asarray(v) for k, v in state.items()}
  template = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      state)
  alias_of = checkpoints._alias
  made = []
  monkeypatch.setattr(checkpoints, '_alias', lambda x: (
      made.append((x, alias_of(x))) or made[-1][1]))
  collected = []
  monkeypatch.setattr(checkpoints, '_return_freed_host_memory',
                      lambda: collected.append(True))
  saver = checkpoints.Checkpointer(str(tmp_path), training.Config(),
                                   template=template)
  assert saver.blocking_saves
  saver.save(3, state)
  assert {id(v) for v in state.values()} <= {id(x) for x, _ in made}
  # The host copies are collected after each part: 'stacked' (1.2 MB) is
  # one, the moment and the step another.
  assert len(collected) >= 2
  for x, alias in made:
    assert alias is not x
    for mine, its in zip(x.addressable_shards, alias.addressable_shards):
      assert its.data is not mine.data
      assert its.data.unsafe_buffer_pointer() == (
          mine.data.unsafe_buffer_pointer())  # no copy
  del made
  got = saver.restore(3, template)
  for k, v in expect.items():
    np.testing.assert_array_equal(np.asarray(got[k]), v)
  assert got['stacked'].sharding == rows
  saver.close()


def test_parts_are_written_by_orbax_itself_under_several_processes(
    monkeypatch):
  handler = lambda registry: registry.get(jax.Array)
  assert isinstance(
      handler(checkpoints._streaming_arrays())._dispatcher,
      checkpoints._PartWriter)
  monkeypatch.setattr(jax, 'process_count', lambda: 2)
  several = handler(checkpoints._streaming_arrays())
  assert several._dispatcher is None
  assert isinstance(several._callback, checkpoints._Deprioritized)


def test_save_returns_once_the_state_is_off_the_device(tmp_path,
                                                        monkeypatch):
  """A save that returns has copied every array off the device (the train
  step donates the state's buffers right after it), with write and read
  budgets below the state's size."""
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
    # 8.6 GB of float32 on the GPU in leaves stacked over 16 "layers", as
    # the train state holds them.
    state = {f'w{i}': jax.random.normal(jax.random.key(i), (16, 1024, 16384))
             for i in range(8)}
    template = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    saver = checkpoints.Checkpointer(sys.argv[1], training.Config(),
                                     template=template)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    saver.save(1, state)
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    kept = sum(x._npy_value is not None for x in state.values())
    print(f'streams {saver.blocking_saves} grew {grew / 1e9:.2f} GB'
          f' host copies kept on the state {kept}')
    got = saver.restore(1, template)
    same = all(np.array_equal(np.asarray(state[k]), np.asarray(got[k]))
               for k in ('w0', 'w7'))
    print('restored', 'bit-exact' if same else 'WRONG')
''')


@pytest.mark.gpu
def test_gpu_streaming_save_holds_a_few_parts_in_host_memory(tmp_path):
  """An 8.6 GB state of 1.07 GB stacked leaves with a 4 GB pinned pool (a
  1 GB budget, parts of one leaf) streams off the GPU: the process's host
  memory grows by a few parts, not by the state, and the state's arrays
  keep no host copy (jax keeps one on each array object it copies)."""
  out = _run_on_gpu(_STREAMING_SAVE, tmp_path, pinned_pool_gb=4)
  words = next(line for line in out.stdout.splitlines()
               if line.startswith('streams ')).split()
  assert words[1] == 'True', out.stdout  # it streamed
  assert float(words[3]) < 4.0, out.stdout  # the state is 8.6 GB
  assert words[-1] == '0', out.stdout
  assert 'restored bit-exact' in out.stdout, out.stdout


_TWO_PROCESS_SAVE = textwrap.dedent('''
    import os, sys
    import jax, numpy as np
    jax.distributed.initialize(
        num_processes=int(os.environ['JAX_NUM_PROCESSES']),
        process_id=int(os.environ['JAX_PROCESS_ID']))
    from coat_jax import training
    from coat_jax.training import checkpoints
    checkpoints._ORBAX_CONCURRENT_GB = 1e-3  # 1 MB: the state streams
    mesh = jax.make_mesh((8,), ('x',))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('x'))
    whole = {'stacked': np.arange(8 * 300 * 128, dtype=np.float32).reshape(
                 8, 300, 128),
             'bias': np.linspace(-1, 1, 8 * 4096, dtype=np.float32)}
    state = {k: jax.make_array_from_callback(v.shape, rows,
                                             lambda i, v=v: v[i])
             for k, v in whole.items()}
    template = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rows),
        state)
    saver = checkpoints.Checkpointer(sys.argv[1], training.Config(),
                                     template=template)
    assert saver.blocking_saves
    saver.save(1, state)
    got = saver.restore(1, template)
    for k, v in whole.items():
      for shard in got[k].addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), v[shard.index])
    saver.close()
    print('restored', jax.process_index())
''')


@pytest.mark.slow
def test_two_processes_stream_a_save(tmp_path):
  """A streaming save under jax.distributed (2 processes x 4 CPU devices):
  orbax writes the parts itself and every shard restores."""
  port = 21000 + os.getpid() % 10000
  procs = [subprocess.Popen(
      [sys.executable, '-c', _TWO_PROCESS_SAVE, str(tmp_path / 'run')],
      env=dict(os.environ,
               XLA_FLAGS='--xla_force_host_platform_device_count=4',
               JAX_PLATFORMS='cpu',
               JAX_COORDINATOR_ADDRESS=f'localhost:{port}',
               JAX_NUM_PROCESSES='2', JAX_PROCESS_ID=str(i)),
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      for i in range(2)]
  for i, p in enumerate(procs):
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    assert f'restored {i}' in out, out
