"""train.offload='optimizer': the optimizer state in pinned host memory."""

import jax
import numpy as np
import pytest

from coat_jax import training
from coat_jax.training import memory
from coat_jax.training import trainer
from tests.training import run_files

ONE = jax.devices()[:1]


def _stopped_and_resumed(config, ctrl_c_at_call, monkeypatch):
  """Trains `config` (5 steps) stopped after step 3, then resumed: the
  resumed run's summary."""
  build = trainer.build
  ctrl_c_at_call(4)
  assert training.train(config, devices=ONE)['step'] == 3
  monkeypatch.setattr(trainer, 'build', build)
  summary = training.train(config, devices=ONE)
  assert summary['resumed_from'] == 3 and summary['step'] == 5
  return summary


def _kinds(tree):
  return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


@pytest.mark.parametrize('optim', [{}, {'name': 'adamw'}],
                         ids=['coat_adamw', 'adamw'])
def test_offloaded_run_equals_the_device_one_and_resumes(
    tiny_config, tmp_path, monkeypatch, ctrl_c_at_call, optim):
  """The same losses and final state, bit for bit, as without offload
  (fused and optax optimizers); the state stays in host memory across
  steps; a run stopped after step 3 resumes into host memory and ends
  where the uninterrupted one does."""
  def config(name, offload):
    return tiny_config(optim=dict(optim),
                       train={'steps': 5, 'offload': offload,
                              'run_dir': str(tmp_path / name)})

  device = config('device', 'none')
  training.train(device, devices=ONE)
  whole = config('whole', 'optimizer')
  summary = training.train(whole, devices=ONE)
  assert summary['memory']['optimizer_state'] == 0  # none on the device
  loss = lambda run: run_files.logged(run.train.run_dir, 'loss')
  assert loss(whole) == loss(device)
  saved = run_files.saved_state(whole, 5)
  assert _kinds(saved['opt_state']) == {'pinned_host'}
  assert _kinds(saved['params']) == {'device'}
  jax.tree.map(np.testing.assert_array_equal, saved,
               run_files.saved_state(device, 5))

  setup = trainer.build(whole, ONE)
  state = setup.init_state()
  assert _kinds(state['opt_state']) == {'pinned_host'}
  batch = [np.zeros((8, 32), np.int32)] * 2
  state, _ = setup.train_step(state, *batch)
  assert _kinds(state['opt_state']) == {'pinned_host'}
  assert memory.host_bytes(setup) == sum(
      x.nbytes for x in jax.tree.leaves(state['opt_state']))

  part = config('part', 'optimizer')
  _stopped_and_resumed(part, ctrl_c_at_call, monkeypatch)
  assert loss(part) == loss(whole)
  jax.tree.map(np.testing.assert_array_equal,
               run_files.saved_state(part, 5), saved)


@pytest.mark.parametrize('remat,pallas', [('auto', False), ('full', True)],
                         ids=['xla', 'remat_full_pallas'])
def test_in_backward_offload_equals_the_device_step(tiny_config, seed,
                                                    pick_pallas, remat,
                                                    pallas):
  """optim.apply_in_backward=true with train.offload='optimizer': each
  layer's moments come from host memory for its step inside backward and
  go back. The optimizer state stays in pinned host memory, and three steps
  end where the in-backward step on the device does, bit for bit (under
  remat 'full' too, each layer recomputed from the carrier; with the
  Pallas kernel, interpreted, which steps a slice instead of layer i of
  the stack in place)."""
  if pallas:
    pick_pallas()
  def build(offload):
    return trainer.build(tiny_config(
        model={'remat': remat}, optim={'apply_in_backward': True},
        train={'offload': offload}), ONE)
  device, host = build('none'), build('optimizer')
  want, got = device.init_state(), host.init_state()
  assert _kinds(got['opt_state']) == {'pinned_host'}
  rng = np.random.default_rng(seed)
  for _ in range(3):
    batch = [rng.integers(0, 256, (8, 32)).astype(np.int32)
             for _ in range(2)]
    want, want_metrics = device.train_step(want, *batch)
    got, metrics = host.train_step(got, *batch)
    assert float(metrics['loss']) == float(want_metrics['loss'])
  assert _kinds(got['opt_state']) == {'pinned_host'}
  assert _kinds(got['params']) == {'device'}
  jax.tree.map(np.testing.assert_array_equal, got, want)
  params, opt, grads = memory.state_bytes(host)
  assert opt == 0 and grads < params
  assert memory.host_bytes(host) == sum(
      x.nbytes for x in jax.tree.leaves(got['opt_state']))


def test_an_in_backward_offloaded_run_resumes(tiny_config, tmp_path,
                                              monkeypatch, ctrl_c_at_call):
  """train.py with the in-backward step and the optimizer state in host
  memory: a run stopped after step 3 resumes into host memory and logs the
  losses of the same run on the device."""
  def config(name, offload):
    return tiny_config(optim={'apply_in_backward': True},
                       train={'steps': 5, 'offload': offload,
                              'run_dir': str(tmp_path / name)})

  device = config('device', 'none')
  training.train(device, devices=ONE)
  part = config('part', 'optimizer')
  summary = _stopped_and_resumed(part, ctrl_c_at_call, monkeypatch)
  assert summary['memory']['optimizer_state'] == 0
  loss = lambda run: run_files.logged(run.train.run_dir, 'loss')
  assert len(loss(part)) == 5 and loss(part) == loss(device)
  saved = run_files.saved_state(part, 5)
  assert _kinds(saved['opt_state']) == {'pinned_host'}
  jax.tree.map(np.testing.assert_array_equal, saved,
               run_files.saved_state(device, 5))


def test_the_plan_counts_host_memory_apart(tiny_config):
  setup = trainer.build(tiny_config(train={'offload': 'optimizer'}), ONE)
  params, opt, grads = memory.state_bytes(setup)
  assert opt == 0 and params == grads > 0
  mem = memory.breakdown(setup, memory.compile_train_step(setup))
  assert mem.host == memory.host_bytes(setup) > params / 4
  assert 'in pinned host memory' in mem.format()


def test_offload_settings_are_checked(tiny_config):
  with pytest.raises(ValueError, match=r"train\.offload='params'.*"
                     r"\('none', 'optimizer'\)"):
    training.validate(tiny_config(train={'offload': 'params'}), 1)


def test_offload_under_fsdp_on_8_devices(tiny_config, tmp_path):
  """Each device's shard of the state in its host memory: the losses of
  the run without offload."""
  losses = {}
  for offload in ('none', 'optimizer'):
    config = tiny_config(mesh={'data': 1, 'fsdp': 8, 'tensor': 1},
                         train={'offload': offload,
                                'run_dir': str(tmp_path / offload)})
    training.train(config)
    losses[offload] = run_files.logged(config.train.run_dir, 'loss')
  assert len(losses['none']) == 3 and losses['optimizer'] == losses['none']
