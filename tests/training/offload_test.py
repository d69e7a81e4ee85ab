"""train.offload='optimizer': the optimizer state in pinned host memory."""

import jax
import numpy as np
import pytest

from coat_jax import training
from coat_jax.training import memory
from coat_jax.training import trainer
from tests.training import run_files

ONE = jax.devices()[:1]




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
  build = trainer.build
  ctrl_c_at_call(4)
  assert training.train(part, devices=ONE)['step'] == 3
  monkeypatch.setattr(trainer, 'build', build)
  summary = training.train(part, devices=ONE)
  assert summary['resumed_from'] == 3 and summary['step'] == 5
  assert loss(part) == loss(whole)
  jax.tree.map(np.testing.assert_array_equal,
               run_files.saved_state(part, 5), saved)


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
  with pytest.raises(ValueError, match=r"train\.offload='optimizer' cannot"
                     r' run with optim\.apply_in_backward=true'):
    training.validate(tiny_config(train={'offload': 'optimizer'},
                                  optim={'apply_in_backward': True}), 1)


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
