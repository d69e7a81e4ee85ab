"""coat_adamw in every optax / Flax NNX path, on stacked layers and dicts.

nnx.Optimizer stores the state it gets back through `nnx.state`, which turns
each QuantizedArray moment into an nnx State mapping (init builds the moments
of Variable params as such mappings already, so the state's structure never
changes): every path below runs at least two updates. Each path is checked
against the same transformation run by plain optax on the same numbers.
"""

import contextlib
import functools
import logging
import math

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import coat_jax
from coat_jax import checkpoint

P = jax.sharding.PartitionSpec

LAYERS, WIDTH = 3, 256  # two groups of 128 per row: shardable 2 ways


def _forward(params, x):
  """A stack of LAYERS tanh layers run by lax.scan, then a head."""

  def layer(h, lp):
    return jnp.tanh(h @ lp['w'] + lp['b']), None

  h, _ = jax.lax.scan(layer, x, params['layers'])
  return h @ params['head']


class Stacked(nnx.Module):
  """Scanned layers as one stacked param per weight (like the Llama)."""

  def __init__(self, rngs):
    k = rngs.params
    self.layers = nnx.Dict(
        w=nnx.Param(jax.random.normal(k(), (LAYERS, WIDTH, WIDTH)) * 0.1),
        b=nnx.Param(jnp.zeros((LAYERS, WIDTH))))
    self.head = nnx.Param(jax.random.normal(k(), (WIDTH, 8)) * 0.2)

  def __call__(self, x):
    return _forward(nnx.to_pure_dict(nnx.state(self, nnx.Param)), x)


def _batch(i):
  k1, k2 = jax.random.split(jax.random.fold_in(jax.random.key(7), i))
  return jax.random.normal(k1, (16, WIDTH)), jax.random.normal(k2, (16, 8))


def _loss(y, target):
  return jnp.mean((y - target) ** 2)


def _nnx_loss(model, x, target):
  return _loss(model(x), target)


def _pure(model):
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _grad_step(model, opt, x, target, poison=False):
  grads = nnx.grad(_nnx_loss)(model, x, target)
  if poison:
    grads = jax.tree.map(lambda g: g * jnp.nan, grads)
  opt.update(model, grads)


def run_nnx(make_tx, steps, mode, poison_at=None):
  """`steps` updates of nnx.Optimizer(Stacked, make_tx()); params, optimizer.

  mode: 'eager', 'nnx.jit', or 'jax.jit' (nnx.split / merge, donated).
  """
  model = Stacked(nnx.Rngs(0))
  opt = nnx.Optimizer(model, make_tx(), wrt=nnx.Param)
  if mode == 'jax.jit':
    graphdef, state = nnx.split((model, opt))

    @functools.partial(jax.jit, donate_argnums=0, static_argnums=3)
    def step(state, x, target, poison):
      model, opt = nnx.merge(graphdef, state)
      _grad_step(model, opt, x, target, poison)
      return nnx.state((model, opt))

    for i in range(steps):
      old = jax.tree.leaves(state)[0]
      state = step(state, *_batch(i), i == poison_at)
      assert old.is_deleted()  # donated: updated in place
    model, opt = nnx.merge(graphdef, state)
  else:
    step = nnx.jit(_grad_step, static_argnums=4) if mode == 'nnx.jit' else (
        _grad_step)
    for i in range(steps):
      step(model, opt, *_batch(i), i == poison_at)
  return _pure(model), opt


def run_plain(make_tx, steps, poison_at=None, jit=True):
  """The same updates with plain optax on a dict of the same params, under
  jax.jit or (jit=False) op by op."""
  params = _pure(Stacked(nnx.Rngs(0)))
  tx = make_tx()
  state = tx.init(params)

  def step(params, state, x, target, poison):
    grads = jax.grad(lambda p: _loss(_forward(p, x), target))(params)
    grads = jax.tree.map(lambda g: jnp.where(poison, g * jnp.nan, g), grads)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  if jit:
    step = jax.jit(step)
  for i in range(steps):
    params, state = step(params, state, *_batch(i), i == poison_at)
  return params, state


def _assert_close(a, b, frac=1e-4, atol=1e-3):
  """Equal up to float rounding: nnx and plain optax, each jitted,
  differ in the last bits of a gradient, and where that moves an FP8 moment
  across a rounding boundary its code steps by one and the param moves by
  up to ~lr/8 more: such elements are allowed in `frac`, within `atol`."""

  def check(x, y):
    x, y = np.asarray(x), np.asarray(y)
    off = ~np.isclose(x, y, rtol=1e-5, atol=1e-6)
    assert off.mean() <= frac, (off.mean(), np.abs(x - y).max())
    np.testing.assert_allclose(x, y, rtol=0, atol=atol)

  jax.tree.map(check, a, b)


def _total_loss(params):
  return sum(float(_loss(_forward(params, *_batch(i)[:1]), _batch(i)[1]))
             for i in range(4))


TXS = {
    'coat_adamw': lambda: coat_jax.coat_adamw(3e-3),
    'chain(clip)': lambda: optax.chain(
        optax.clip_by_global_norm(0.5), coat_jax.coat_adamw(3e-3)),
    'MultiSteps': lambda: optax.MultiSteps(
        coat_jax.coat_adamw(3e-3), every_k_schedule=2),
    'inject_hyperparams': lambda: optax.inject_hyperparams(
        coat_jax.coat_adamw, static_args=('group_size',))(
            learning_rate=3e-3, group_size=32),
    'mask': lambda: coat_jax.coat_adamw(
        3e-3, weight_decay=0.5,
        mask=lambda p: jax.tree.map(lambda x: x.ndim == 3, p)),
}


@pytest.mark.parametrize('name', list(TXS))
def test_nnx_optimizer_under_nnx_jit_equals_plain_optax(name):
  params, opt = run_nnx(TXS[name], 4, 'nnx.jit')
  ref, _ = run_plain(TXS[name], 4)
  _assert_close(params, ref)
  assert _total_loss(params) < 0.9 * _total_loss(_pure(Stacked(nnx.Rngs(0))))
  assert int(opt.step[...]) == 4


@pytest.mark.parametrize('mode', ['eager', 'jax.jit'])
def test_nnx_optimizer_eager_and_split_merge_donated(mode):
  params, _ = run_nnx(TXS['chain(clip)'], 3, mode)
  if mode == 'eager':
    # Op by op both ways: the same bits. (Against the jitted reference an
    # eager step rounds a few gradients differently and FP8 moment codes
    # flip: 119 of ~197K params moved by up to 1.3e-4 after 3 steps.)
    ref, _ = run_plain(TXS['chain(clip)'], 3, jit=False)
    jax.tree.map(np.testing.assert_array_equal, params, ref)
  else:
    ref, _ = run_plain(TXS['chain(clip)'], 3)
    _assert_close(params, ref)


def test_nnx_optimizer_apply_if_finite_skips_a_nan_step():
  make = lambda: optax.apply_if_finite(coat_jax.coat_adamw(3e-3), 2)
  params, opt = run_nnx(make, 4, 'nnx.jit', poison_at=2)
  ref, ref_state = run_plain(make, 4, poison_at=2)
  _assert_close(params, ref)
  assert int(ref_state.total_notfinite) == 1
  state = nnx.as_pure(opt.opt_state)
  assert int(state.total_notfinite) == 1
  # The skipped step changed nothing: 3 real Adam steps were taken.
  assert int(state.inner_state[0].count) == 3
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))


def test_mask_decays_only_the_masked_leaves():
  # One step from the same params: the same gradients in both runs.
  no_decay = lambda: coat_jax.coat_adamw(3e-3, weight_decay=0.0)
  masked, _ = run_nnx(TXS['mask'], 1, 'nnx.jit')
  plain, _ = run_nnx(no_decay, 1, 'nnx.jit')
  _assert_close(masked['layers']['b'], plain['layers']['b'])
  _assert_close(masked['head'], plain['head'])
  assert not np.allclose(masked['layers']['w'], plain['layers']['w'])


def test_sharded_state_keeps_the_params_sharding():
  P = jax.sharding.PartitionSpec
  mesh = jax.make_mesh((4, 2), ('data', 'model'),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  spec = {'layers': {'w': P(None, 'data', 'model'), 'b': P(None, 'model')},
          'head': P('data', None)}
  make = TXS['chain(clip)']
  with jax.set_mesh(mesh):
    model = Stacked(nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(
        lambda x, s: jax.device_put(x, jax.NamedSharding(mesh, s)),
        nnx.to_pure_dict(state), spec))
    opt = nnx.Optimizer(model, make(), wrt=nnx.Param)
    step = nnx.jit(_grad_step, static_argnums=4)
    for i in range(3):
      step(model, opt, *_batch(i), False)
  mu = nnx.as_pure(opt.opt_state)[1][0].mu
  assert model.head[...].sharding.spec == P('data', None)
  assert mu['head']['values'].sharding.spec == P('data', None)
  assert mu['head']['scale'].sharding.spec == P('data', None)
  assert mu['layers']['w']['values'].sharding.spec == P(None, 'data', 'model')
  assert mu['layers']['b']['values'].sharding.spec == P(None, 'model')
  ref, _ = run_plain(make, 3)
  # Sharded matmuls sum in another order: every gradient rounds differently,
  # so more FP8 codes step (each by < lr / 8 on the param) than unsharded.
  _assert_close(_pure(model), ref, frac=0.05, atol=1e-3)


def test_orbax_resume_of_nnx_optimizer_is_bit_exact(tmp_path):
  make = TXS['chain(clip)']
  model = Stacked(nnx.Rngs(0))
  opt = nnx.Optimizer(model, make(), wrt=nnx.Param)
  step = nnx.jit(_grad_step, static_argnums=4)
  for i in range(2):
    step(model, opt, *_batch(i), False)
  checkpoint.save(tmp_path / 'ckpt', nnx.state((model, opt)))
  # A fresh model and optimizer as the template.
  model2 = Stacked(nnx.Rngs(1))
  opt2 = nnx.Optimizer(model2, make(), wrt=nnx.Param)
  restored = checkpoint.restore(tmp_path / 'ckpt', nnx.state((model2, opt2)))
  nnx.update((model2, opt2), restored)
  for i in range(2, 4):
    step(model, opt, *_batch(i), False)
    step(model2, opt2, *_batch(i), False)
  for a, b in zip(jax.tree.leaves(nnx.state((model, opt))),
                  jax.tree.leaves(nnx.state((model2, opt2)))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_checkpoint_of_the_earlier_init_layout_restores(tmp_path):
  """Before moments.nnx_layout a new nnx.Optimizer held QuantizedArrays in
  its Variables: a checkpoint saved then has the same leaf names."""
  make = TXS['chain(clip)']
  model = Stacked(nnx.Rngs(0))
  opt = nnx.Optimizer(model, make(), wrt=nnx.Param)
  is_fields = lambda x: isinstance(x, nnx.State) and 'values' in x
  earlier = jax.tree.map(
      lambda s: coat_jax.optim.moments.as_quantized(s, 128),
      nnx.state((model, opt)), is_leaf=is_fields)
  assert any(isinstance(x, coat_jax.QuantizedArray) for x in jax.tree.leaves(
      earlier, is_leaf=coat_jax.optim.moments.is_moment))
  checkpoint.save(tmp_path / 'ckpt', earlier)
  model2 = Stacked(nnx.Rngs(1))
  opt2 = nnx.Optimizer(model2, make(), wrt=nnx.Param)
  nnx.update((model2, opt2), checkpoint.restore(
      tmp_path / 'ckpt', nnx.state((model2, opt2))))
  step = nnx.jit(_grad_step, static_argnums=4)
  for i in range(2):
    step(model, opt, *_batch(i), False)
    step(model2, opt2, *_batch(i), False)
  for a, b in zip(jax.tree.leaves(nnx.state((model, opt))),
                  jax.tree.leaves(nnx.state((model2, opt2)))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@contextlib.contextmanager
def _compiles(name):
  """Yields a list that collects jax's 'Compiling jit(name)' log records."""
  seen = []
  handler = logging.Handler()
  handler.emit = lambda record: seen.append(record.getMessage())
  logger = logging.getLogger('jax')
  logger.addHandler(handler)
  try:
    with jax.log_compiles(True):
      yield lambda: sum(f'Compiling jit({name})' in m for m in seen)
  finally:
    logger.removeHandler(handler)


@pytest.mark.parametrize('graph', [True, False])
@pytest.mark.parametrize(
    'name', ['coat_adamw', 'MultiSteps', 'fp8_states', 'float32 nu'])
def test_nnx_jit_step_compiles_once(name, graph):
  """The state nnx.Optimizer builds has the structure it keeps after an
  update: the step compiles once, not again at the second update."""
  make = dict(TXS, fp8_states=lambda: coat_jax.fp8_states(optax.adam(3e-3)))
  make['float32 nu'] = lambda: coat_jax.coat_adamw(
      3e-3, moment_dtypes=('e4m3', 'float32'))
  model = nnx.Linear(256, 256, rngs=nnx.Rngs(0))
  opt = nnx.Optimizer(model, make[name](), wrt=nnx.Param, graph=graph)
  before = jax.tree.structure(nnx.state(opt))

  @nnx.jit
  def step(model, opt, x):
    grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
    opt.update(model, grads)

  with _compiles('step') as count:
    for i in range(3):
      step(model, opt, _batch(i)[0])
  assert count() == 1
  assert jax.tree.structure(nnx.state(opt)) == before
  assert int(opt.step[...]) == 3


def test_plain_dict_state_in_state_mappings_still_checks_the_tree():
  tx = coat_jax.coat_adamw(1e-3)
  params = {'w': jnp.ones((4, 8)), 'b': jnp.ones(8)}
  state = tx.init(params)
  # The moments as nnx State mappings (what nnx.Optimizer hands back).
  to_state = lambda q: nnx.State(
      {'values': q.values, 'scale': q.scale, 'exponent': q.exponent})
  adam = state[0]
  as_state = (adam._replace(
      mu=jax.tree.map(to_state, adam.mu, is_leaf=coat_jax.optim.moments
                      .is_moment),
      nu=jax.tree.map(to_state, adam.nu, is_leaf=coat_jax.optim.moments
                      .is_moment)), *state[1:])
  updates, new = tx.update(params, as_state, params)
  ref_updates, ref = tx.update(params, state, params)
  _assert_close(updates, ref_updates)
  assert (jax.tree.structure(new) == jax.tree.structure(as_state))
  with pytest.raises(ValueError, match='tree structure'):
    tx.update({'w': jnp.ones((4, 8))}, as_state, params)
  with pytest.raises(ValueError, match=r"updates\['w'\] has shape \(8, 4\)"):
    tx.update({'w': jnp.ones((8, 4)), 'b': jnp.ones(8)}, state, params)


@pytest.mark.parametrize('scan_layers', [True, False])
def test_llama_nnx_jit_trains(scan_layers):
  """The issue's reproduction: the tiny Llama (COAT FP8 activations, scanned
  layers then; unrolled, the default, now) with chain(clip, coat_adamw)
  under nnx.jit."""
  cfg = coat_jax.models.LlamaConfig.preset('tiny', scan_layers=scan_layers)
  model = coat_jax.models.Llama(cfg, recipe='coat', rngs=nnx.Rngs(0))
  tx = optax.chain(optax.clip_by_global_norm(1.0), coat_jax.coat_adamw(3e-3))
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
  tokens = jax.random.randint(jax.random.key(0), (2, 17), 0, cfg.vocab_size)
  loss_fn = lambda m: coat_jax.models.lm_loss(m, tokens[:, :-1], tokens[:, 1:])

  @nnx.jit
  def step(model, opt):
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss

  losses = [float(step(model, opt)) for _ in range(4)]
  assert losses[-1] < losses[0] - 0.2, losses
  assert int(nnx.as_pure(opt.opt_state)[1][0].count) == 4


def _mesh_size(mesh, entry):
  names = entry if isinstance(entry, tuple) else (entry,)
  return math.prod(mesh.shape[n] for n in names if n is not None)


@pytest.mark.parametrize('axis_type', ['auto', 'explicit'])
def test_llama_eager_sharded_params_train(axis_type):
  """The tiny Llama's params sharded at creation (eager sharding by their
  logical axes) on a (1, 1, 4) mesh: 'tensor' splits axes of 64 and 176,
  whose moments have 1 or 2 groups of 128, so a moment's scale and exponent
  cannot take the param's spec on their last axis. Both mesh axis types
  (Explicit: shardings in the types) train on the LM loss."""
  at = {'auto': jax.sharding.AxisType.Auto,
        'explicit': jax.sharding.AxisType.Explicit}[axis_type]
  mesh = jax.make_mesh((1, 1, 4), ('data', 'fsdp', 'tensor'),
                       axis_types=(at,) * 3)
  cfg = coat_jax.models.LlamaConfig.preset('tiny')
  tokens = jax.random.randint(jax.random.key(0), (2, 17), 0, cfg.vocab_size)
  loss_fn = lambda m: coat_jax.models.lm_loss(m, tokens[:, :-1],
                                              tokens[:, 1:])

  @nnx.jit
  def step(model, opt):
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss

  with (jax.set_mesh(mesh),
        nnx.logical_axis_rules(coat_jax.nn.LOGICAL_AXIS_RULES),
        nnx.use_eager_sharding(True)):
    model = coat_jax.models.Llama(cfg, recipe='coat', rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    w = params['layers']['mlp']['down_proj']['kernel']  # (2, 176, 64)
    assert tuple(w.sharding.spec)[1] == 'tensor'
    opt = nnx.Optimizer(model, coat_jax.coat_adamw(1e-3), wrt=nnx.Param)
    replicated = []  # per moment: whether its scales' last axis is

    def check_moments():
      adam = nnx.as_pure(opt.opt_state)[0]
      for mu in (adam.mu, adam.nu):
        for path, p in jax.tree_util.tree_leaves_with_path(params):
          m = functools.reduce(lambda t, k: t[k.key], path, mu)
          assert m['values'].sharding.is_equivalent_to(p.sharding, p.ndim)
          spec = tuple(p.sharding.spec) + (None,) * p.ndim
          spec = spec[:p.ndim]
          fits = m['scale'].shape[-1] % _mesh_size(mesh, spec[-1]) == 0
          want = jax.NamedSharding(
              mesh, P(*spec[:-1], spec[-1] if fits else None))
          for f in ('scale', 'exponent'):
            assert m[f].sharding.is_equivalent_to(want, p.ndim), (path, f)
          replicated.append(not fits)

    check_moments()
    losses = [float(step(model, opt)) for _ in range(2)]
    check_moments()
  assert np.isfinite(losses).all(), losses
  assert any(replicated) and not all(replicated)  # both kinds were seen
  assert int(opt.step[...]) == 2
