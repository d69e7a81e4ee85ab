"""The in-backward train step: the fused step's result (a language model
and a VLM), clipping by the previous norm, non-finite gradients, what the
compiled step keeps, and train.py with optim.apply_in_backward=true."""

import dataclasses
import math
import os
import sys

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from coat_jax import optim
from coat_jax import training
from coat_jax.models import lm_loss
from coat_jax.training import in_backward
from coat_jax.training import memory
from coat_jax.training import tasks
from coat_jax.training import trainer
from tests.training import run_files

ONE = jax.devices()[:1]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
sys.path.insert(0, ROOT)
import train as train_py  # noqa: E402


def _setup(tiny_config, recipe='coat', clip_norm=1e9, train=None, clip=None,
           **model):
  """A tiny config and its `trainer.build`: the ordinary step, or with
  `clip` the in-backward step clipping so."""
  optim = {'warmup_steps': 0, 'clip_norm': clip_norm}
  if clip is not None:
    optim.update(apply_in_backward=True, in_backward_clip=clip)
  config = tiny_config(model={'recipe': recipe, **model}, optim=optim,
                       train=train or {})
  return config, trainer.build(config, ONE)


def _step(config, setup, clip, loss):
  """The in-backward step of `setup` with `loss` as the task's loss."""
  o = config.optim
  return jax.jit(in_backward.make_train_step(
      dataclasses.replace(setup.task, loss=loss), setup.graphdef,
      **trainer._adamw_args(config), group_size=o.group_size,
      expansion=o.expansion, clip=clip, clip_norm=o.clip_norm),
                 donate_argnums=0)


def _batch(seed):
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.integers(0, 256, (8, 32)), jnp.int32)
               for _ in range(2))


def _assert_states_close(got, want):
  for (path, g), w in zip(
      jax.tree_util.tree_flatten_with_path(got['params'])[0],
      jax.tree.leaves(want['params']), strict=True):
    np.testing.assert_allclose(g, w, rtol=0, atol=1e-6, err_msg=str(path))
  for g, w in zip(jax.tree.leaves(got['opt_state'][1]),
                  jax.tree.leaves(want['opt_state'][1]), strict=True):
    g, w = (np.asarray(a).astype(np.float32) for a in (g, w))
    # FP8 codes: a rare step from rounding; scales: float rounding.
    close = np.isclose(g, w, rtol=1e-5, atol=0)
    assert np.mean(~close) <= 1e-3, np.mean(~close)


@pytest.mark.parametrize('recipe,remat', [('coat', 'auto'), ('bf16', 'auto'),
                                          ('coat', 'full')])
def test_three_steps_equal_the_fused_step(tiny_config, recipe, remat, seed):
  """With clip 'none' and a clip norm the fused step never reaches, both
  steps are the same AdamW steps on the same gradients; under remat 'full'
  too (against the fused step without remat: the same forward in
  backward), where each layer recomputes itself in backward from the
  params the carrier brings (`in_backward._recomputed_layer`)."""
  _, setup = _setup(tiny_config, recipe)
  _, inb = _setup(tiny_config, recipe, clip='none', remat=remat)
  want, got = setup.init_state(), inb.init_state()
  for i in range(3):
    x, y = _batch(seed + i)
    old = jax.tree.map(np.asarray, got['params'])
    want, want_metrics = setup.train_step(want, x, y)
    got, metrics = inb.train_step(got, x, y)
    np.testing.assert_allclose(metrics['loss'], want_metrics['loss'],
                               rtol=1e-6)
    np.testing.assert_allclose(metrics['grad_norm'],
                               want_metrics['grad_norm'], rtol=1e-5)
    assert bool(metrics['finite'])
    for a, b in zip(jax.tree.leaves(got['params']), jax.tree.leaves(old)):
      assert not np.array_equal(a, b)  # every param moved
  _assert_states_close(got, want)
  assert int(got['step']) == 3 and int(got['nonfinite']) == 0
  assert int(got['opt_state'][1][0].count) == 3


@pytest.mark.parametrize('remat', ['auto', 'full'])
def test_the_pallas_kernel_steps_each_layer_in_place(tiny_config, seed,
                                                     pick_pallas, remat):
  """The Pallas kernel (interpreted here) steps layer i of the stacks
  (`layer=`) inside backward: the fused step's result again, also where
  each layer recomputes itself from the stacks in backward (remat
  'full')."""
  pick_pallas()
  _, setup = _setup(tiny_config)
  _, inb = _setup(tiny_config, clip='none', remat=remat)
  got, _ = inb.train_step(inb.init_state(), *_batch(seed))
  want, _ = setup.train_step(setup.init_state(), *_batch(seed))
  _assert_states_close(got, want)


def test_a_vlm_step_equals_the_fused_step(tmp_path):
  """The decoder's layers inside a VLM (`Task.layers_path`) step inside
  backward; the vision tower and projector step after it."""
  def build(clip):
    config = training.load_config(os.path.join(ROOT, 'configs',
                                               'vlm_tiny.py'))
    config.optim = dataclasses.replace(
        config.optim, warmup_steps=0, clip_norm=1e9,
        apply_in_backward=clip is not None, in_backward_clip=clip or 'none')
    config.train = dataclasses.replace(config.train, batch_size=4,
                                       run_dir=str(tmp_path))
    return config, trainer.build(config, ONE)

  config, setup = build(None)
  _, inb = build('none')
  assert inb.task.layers_path == ('decoder', 'layers')
  batch = tasks.load_data(config, setup.task).batch('train', 0, 4)
  want, want_metrics = setup.train_step(setup.init_state(), *batch)
  got, metrics = inb.train_step(inb.init_state(), *batch)
  np.testing.assert_allclose(metrics['loss'], want_metrics['loss'],
                             rtol=1e-6)
  assert bool(metrics['finite'])
  _assert_states_close(got, want)


def test_previous_norm_clipping_matches_a_reference(tiny_config, seed):
  """Each step scales its gradients by min(1, c / the previous step's
  global norm) (1 at the first step): the fused optimizer run by hand on
  value_and_grad's gradients with those scales."""
  clip_norm = 0.5  # below every step's norm here: it bites from step 2
  config, setup = _setup(tiny_config, clip_norm=clip_norm, clip='previous')
  o = config.optim
  apply = optim.fused_coat_adamw(**trainer._adamw_args(config),
                                 group_size=o.group_size,
                                 expansion=o.expansion)
  got = setup.init_state()
  assert float(got['opt_state'][0].norm) == 0  # no norm yet
  params, (_, adamw) = jax.tree.map(jnp.copy, (got['params'],
                                               got['opt_state']))

  @jax.jit
  def reference(params, adamw, x, y, previous):
    loss, grads = jax.value_and_grad(lambda p: lm_loss(
        nnx.merge(setup.graphdef, p), x, y))(params)
    scale = jnp.where(previous < clip_norm, 1.0, clip_norm / previous)
    return apply(grads, adamw, params, True, scale.astype(jnp.float32)), (
        loss, optax.tree.norm(grads))

  previous, norms = 0.0, []
  for i in range(3):
    x, y = _batch(seed + i)
    (params, adamw), (loss, norm) = reference(params, adamw, x, y,
                                              jnp.float32(previous))
    norm = float(norm)
    got, metrics = setup.train_step(got, x, y)
    np.testing.assert_allclose(metrics['loss'], loss, rtol=1e-6)
    np.testing.assert_allclose(metrics['grad_norm'], norm, rtol=1e-5)
    np.testing.assert_allclose(got['opt_state'][0].norm, norm, rtol=1e-5)
    previous = norm
    norms.append(norm)
  assert min(norms) > clip_norm  # the clipping did bite
  _assert_states_close(got, {'params': params,
                             'opt_state': (None, adamw)})


def test_clip_by_previous_norm_as_an_optax_transformation():
  tx = in_backward.clip_by_previous_norm(1.0)
  state = tx.init({'w': jnp.zeros(2)})
  first = {'w': jnp.array([3.0, 4.0])}  # norm 5: not scaled, recorded
  out, state = tx.update(first, state)
  np.testing.assert_allclose(out['w'], [3.0, 4.0])
  np.testing.assert_allclose(state.norm, 5.0)
  out, state = tx.update({'w': jnp.array([0.0, 1.0])}, state)
  np.testing.assert_allclose(out['w'], [0.0, 0.2])  # 1 / 5
  np.testing.assert_allclose(state.norm, 1.0)
  out, state = tx.update({'w': jnp.array([jnp.nan, 1.0])}, state)
  np.testing.assert_allclose(state.norm, 1.0)  # a non-finite norm: kept


def test_a_non_finite_loss_changes_no_param(tiny_config, seed):
  _, setup = _setup(tiny_config, clip_norm=0.5, clip='previous')
  state = setup.init_state()
  state['opt_state'] = (in_backward.PreviousNormState(jnp.float32(2.0)),
                        state['opt_state'][1])
  state['params']['norm']['scale'] = (
      state['params']['norm']['scale'].at[0].set(jnp.nan))
  before = jax.tree.map(np.asarray, state)
  new, metrics = setup.train_step(state, *_batch(seed))
  assert not bool(metrics['finite']) and not np.isfinite(metrics['loss'])
  assert int(new['nonfinite']) == 1 and int(new['step']) == 1
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(new)[0],
                          jax.tree.leaves(before)):
    if path[0].key not in ('step', 'nonfinite'):
      np.testing.assert_array_equal(a, b, err_msg=str(path))


def test_a_layer_with_a_non_finite_gradient_does_not_step(tiny_config,
                                                          seed):
  """The loss is finite but layer 0's gradient is not: layer 0, the
  embeddings, final norm and head keep their values and the count does not
  advance; layer 1, whose gradient is finite, steps (as documented)."""
  config, setup = _setup(tiny_config, clip='none')

  def poisoned_loss(model, tokens, targets, layers):
    read = layers.read

    def poisoned_read(i, source):
      source, params = read(i, source)
      if i == 0:
        scale = params['mlp_norm']['scale']
        # + 0 in value; d/dscale[0] = 0 * sqrt'(0) = NaN.
        params['mlp_norm']['scale'] = scale + 0.0 * jnp.sqrt(jnp.abs(
            scale[0] - jax.lax.stop_gradient(scale[0])))
      return source, params

    layers.read = poisoned_read
    return lm_loss(model, tokens, targets, layers=layers)

  state = setup.init_state()
  before = jax.tree.map(np.asarray, state)
  new, metrics = _step(config, setup, 'none', poisoned_loss)(
      state, *_batch(seed))
  assert np.isfinite(metrics['loss']) and not bool(metrics['finite'])
  assert int(new['nonfinite']) == 1
  adam = new['opt_state'][1][0]
  assert int(adam.count) == 0
  for name in ('embed', 'norm', 'lm_head'):
    for a, b in zip(jax.tree.leaves(new['params'][name]),
                    jax.tree.leaves(before['params'][name])):
      np.testing.assert_array_equal(a, b, err_msg=name)
  layers = zip(jax.tree.leaves(new['params']['layers']),
               jax.tree.leaves(before['params']['layers']))
  for a, b in layers:
    np.testing.assert_array_equal(a[0], b[0])  # layer 0: unchanged
    assert not np.array_equal(a[1], b[1])  # layer 1 stepped
  moments = zip(jax.tree.leaves(adam.mu['layers']),
                jax.tree.leaves(before['opt_state'][1][0].mu['layers']))
  for a, b in moments:
    np.testing.assert_array_equal(np.asarray(a[0]).astype(np.float32),
                                  np.asarray(b[0]).astype(np.float32))


def test_the_compiled_step_keeps_no_stacked_gradients(tiny_config):
  """XLA's plan on this backend: the in-backward step's temporaries are
  smaller than the ordinary fused step's by at least the layers' float32
  gradients (figures: docs/in_backward.md), and the memory breakdown counts
  only the other params' gradients."""
  sizes = dict(train={'batch_size': 1}, hidden_size=256,
               intermediate_size=768, num_layers=4)
  _, setup = _setup(tiny_config, **sizes)
  _, inb = _setup(tiny_config, clip='previous', **sizes)
  ordinary = memory.compile_train_step(setup).memory_analysis()
  compiled = memory.compile_train_step(inb)
  stats = compiled.memory_analysis()
  nbytes = lambda tree: sum(math.prod(x.shape) * x.dtype.itemsize
                            for x in jax.tree.leaves(tree))
  params = inb.abstract_state['params']
  grads = nbytes(params['layers'])  # float32 params: their gradients'
  print(f'temp: ordinary {ordinary.temp_size_in_bytes / 2**20:.2f} MiB,'
        f' in backward {stats.temp_size_in_bytes / 2**20:.2f} MiB, layer'
        f' gradients {grads / 2**20:.2f} MiB')
  assert stats.temp_size_in_bytes <= ordinary.temp_size_in_bytes - grads
  # The state is updated in place: every argument but the batch (two int32
  # arrays of 1 x 32 tokens) is aliased.
  assert stats.argument_size_in_bytes - stats.alias_size_in_bytes == (
      2 * 32 * 4)
  mem = memory.breakdown(inb, compiled)
  assert mem.gradients == nbytes(params) - grads
  assert mem.params == nbytes(params)




def test_a_run_trains_and_resumes_bit_exactly(tiny_config, tmp_path,
                                              monkeypatch, ctrl_c_at_call):
  """train.py with optim.apply_in_backward=true: a run stopped after step 3
  (its checkpoint keeps the previous norm) and resumed ends where an
  uninterrupted run does, bit for bit."""
  def config(name):
    return tiny_config(optim={'apply_in_backward': True},
                       train={'steps': 5, 'run_dir': str(tmp_path / name)})

  whole = config('whole')
  summary = training.train(whole, devices=ONE)
  norms = run_files.logged(whole.train.run_dir, 'grad_norm')
  assert len(norms) == 5 and max(norms[:3]) > whole.optim.clip_norm
  assert summary['memory']['gradients'] < summary['memory']['params']

  part = config('part')
  build = trainer.build
  ctrl_c_at_call(4)
  assert training.train(part, devices=ONE)['step'] == 3
  monkeypatch.setattr(trainer, 'build', build)
  np.testing.assert_array_equal(
      run_files.saved_state(part, 3)['opt_state'][0].norm,
      np.float32(norms[2]))
  summary = training.train(part, devices=ONE)
  assert summary['resumed_from'] == 3 and summary['step'] == 5
  loss = lambda run: run_files.logged(run.train.run_dir, 'loss')
  assert loss(part) == loss(whole)
  jax.tree.map(np.testing.assert_array_equal, run_files.saved_state(part, 5),
               run_files.saved_state(whole, 5))


def test_the_command_line_turns_it_on(tmp_path, capsys):
  """`--set optim.apply_in_backward=true` reaches the config: here, on 8
  devices, the error says how to run it."""
  code = train_py.main(['--set', 'optim.apply_in_backward=true',
                        f'train.run_dir={tmp_path}'])
  assert code == 2
  assert ('error: optim.apply_in_backward=true runs on one device (8 given:'
          ' make one visible') in capsys.readouterr().err


def test_unsupported_settings_are_refused():
  ok = dict(fused_optimizer=True, scan_layers=False, microbatches=1,
            num_devices=1)
  in_backward.check_supported(**ok)
  for change, match in (
      ({'fused_optimizer': False}, r'fused optimizer.*optim\.fused'),
      ({'scan_layers': True}, r'model\.scan_layers=false'),
      ({'microbatches': 2}, r'train\.microbatches=2: set 1'),
      ({'num_devices': 8}, r'one device \(8 given: make one visible')):
    with pytest.raises(ValueError, match=r'optim\.apply_in_backward=true '
                       + r'.*' + match):
      in_backward.check_supported(**{**ok, **change})
  with pytest.raises(ValueError, match=r"clip='global'.*\('previous',"
                     r" 'none'\)"):
    in_backward.clipping('global', 1.0)
  with pytest.raises(ValueError, match='max_norm=0 must be positive'):
    in_backward.clip_by_previous_norm(0)
  assert isinstance(in_backward.clipping('none', 1.0).init({}),
                    optax.EmptyState)
