"""The fused COAT AdamW step against coat_adamw and its reference.

XLA contracts a * b + c into an FMA inside a fusion (CPU and GPU), so the
float32 arithmetic of the step rounds differently depending on how it is
fused: the 'xla' path reproduces coat_adamw + optax.apply_updates exactly
under one jit; the Pallas kernel (interpreted or compiled) is held to a few
ulps on the param and to FP8 codes that move by at most one step in a tiny
fraction of elements. With hyperparameters that make every product of the
step exact (FMA_NEUTRAL), contraction cannot change any rounding, and the
kernel must equal its reference bit for bit.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import coat_jax
from pallas_kernels.coat_adam_step import api
from pallas_kernels.coat_adam_step import reference
from pallas_kernels.quantize_per_group import reference as group_reference

# b1 = b2 = 1/2 and powers of two for the learning rate and weight decay:
# every multiply of the update is exact (normal operands), so a multiply-add
# rounds the same whether or not it is contracted into an FMA. They are
# passed as arrays: with constants XLA factors 0.5 g^2 + 0.5 v into
# (g^2 + v) 0.5 and then contracts g * g + v, which the kernel, reading them
# from memory, cannot.
FMA_NEUTRAL = dict(b1=0.5, b2=0.5, learning_rate=2.0**-7,
                   weight_decay=2.0**-3)


def _codes(a):
  return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8)).astype(int)


def _ulps(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return np.abs(a.view(np.int32).astype(np.int64)
                - b.view(np.int32).astype(np.int64))


def _assert_param_close(new, ref, old):
  """new == ref up to 4 ulp of the param plus 1e-4 of the update."""
  new, ref, old = (np.asarray(a, np.float32) for a in (new, ref, old))
  nan = np.isnan(ref)
  np.testing.assert_array_equal(np.isnan(new), nan)
  ulp = lambda x: np.spacing(np.abs(x).astype(np.float32))
  # On GPU, XLA and the kernel contract different multiply-adds into FMAs:
  # seen on a Hopper GPU: a few % of params differ, by up to 4 ulp.
  tol = 4 * ulp(ref) + 1e-4 * np.abs(ref - old)
  err = np.abs(np.where(nan, 0, new - ref))
  assert np.all(err <= np.where(nan, 0, tol)), err.max()


def _assert_moment_close(new, ref, max_frac=2e-3, max_step=1, scale_ulps=4):
  """Codes move by at most `max_step` steps in max_frac of the elements;
  scales by `scale_ulps` (the group max); exponents by one step of 1/16."""
  nan_ref = np.isnan(np.atleast_1d(ref.values.astype(jnp.float32)))
  diff = np.atleast_1d(np.abs(_codes(new.values) - _codes(ref.values)))
  diff[nan_ref] = 0
  assert diff.max(initial=0) <= max_step and (diff > 0).mean() <= max_frac, (
      diff.max(initial=0), (diff > 0).mean())
  finite = np.isfinite(np.asarray(ref.scale))
  assert _ulps(np.asarray(new.scale)[finite],
               np.asarray(ref.scale)[finite]).max(initial=0) <= scale_ulps
  if ref.exponent is not None:
    step = np.abs(np.asarray(new.exponent) - np.asarray(ref.exponent))
    assert step[finite].max(initial=0) <= 1 / 16 + 1e-6
    assert (step[finite] > 0).mean() <= 0.02


def _grads(shape, seed):
  rng = np.random.default_rng(seed)
  g = rng.standard_normal(shape) * np.exp(rng.uniform(-12, 2, shape))
  if len(shape) == 2 and shape[0] >= 2:
    g[1] = 0.0  # rows that never see a gradient (all-zero groups)
  return jnp.asarray(g, jnp.float32)


def _spec_step(tx):
  @jax.jit
  def step(g, state, p):
    u, state = tx.update(g, state, p)
    return optax.apply_updates(p, u), state
  return step


def _run(shape, implementation, *, weight_decay=0.1, expansion=True,
         moment_dtypes=('e4m3', 'e4m3'), steps=3, lr=1e-2, exact=False,
         moment_tol=None):
  rng = np.random.default_rng(0)
  p = {'w': jnp.asarray(rng.standard_normal(shape), jnp.float32)}
  tx = coat_jax.coat_adamw(lr, weight_decay=weight_decay,
                           moment_dtypes=moment_dtypes, expansion=expansion)
  state = tx.init(p)
  spec = _spec_step(tx)
  fused = jax.jit(functools.partial(
      api.coat_adam_step, learning_rate=lr, weight_decay=weight_decay,
      expansion=expansion, implementation=implementation))
  for step in range(steps):
    g = {'w': _grads(shape, step)}
    adam = state[0]
    p_ref, state_ref = spec(g, state, p)
    new_p, mu, nu = fused(p['w'], g['w'], adam.mu['w'], adam.nu['w'],
                          adam.count + 1)
    assert isinstance(mu, coat_jax.QuantizedArray)
    ref_mu, ref_nu = state_ref[0].mu['w'], state_ref[0].nu['w']
    if exact:
      np.testing.assert_array_equal(new_p, p_ref['w'])
      for a, b in ((mu, ref_mu), (nu, ref_nu)):
        np.testing.assert_array_equal(_codes(a.values), _codes(b.values))
        np.testing.assert_array_equal(a.scale, b.scale)
        if expansion:
          np.testing.assert_array_equal(a.exponent, b.exponent)
    else:
      _assert_param_close(new_p, p_ref['w'], p['w'])
      _assert_moment_close(mu, ref_mu, **(moment_tol or {}))
      _assert_moment_close(nu, ref_nu, **(moment_tol or {}))
    p, state = p_ref, state_ref


@pytest.mark.parametrize('shape', [(5, 300), (300,), ()])
def test_xla_path_is_coat_adamw(shape):
  # Bit for bit on the CPU. XLA:GPU fuses the two programs differently (FMA
  # contraction, its own exp and log): on a Hopper GPU a few % of the params
  # move by 1 ulp and a group scale by up to 5 ulps.
  if jax.default_backend() != 'gpu':
    _run(shape, 'xla', exact=True)
  else:
    _run(shape, 'xla', moment_tol=dict(scale_ulps=8))


@pytest.mark.parametrize('shape,weight_decay,expansion,moment_dtypes', [
    ((5, 300), 0.1, True, ('e4m3', 'e4m3')),
    ((3, 128), None, True, ('e4m3', 'e5m2')),
    ((300,), 0.0, False, ('e4m3', 'e4m3')),
    ((), 0.1, True, ('e4m3', 'e4m3')),
    ((1, 1), 0.1, False, ('e5m2', 'e5m2')),
    ((2, 3, 40), 0.1, True, ('e4m3', 'e4m3')),
])
def test_pallas_kernel_matches_coat_adamw(shape, weight_decay, expansion,
                                          moment_dtypes):
  _run(shape, 'pallas', weight_decay=weight_decay or 0.0,
       expansion=expansion, moment_dtypes=moment_dtypes)


def _bits(a):
  """float32 bits of any float array, NaNs made equal."""
  a = np.atleast_1d(np.asarray(jnp.asarray(a).astype(jnp.float32)))
  return np.where(np.isnan(a), np.float32(np.nan), a).view(np.int32)


def _assert_step_is_reference(shape, moment_dtypes, expansion=True,
                              steps=3, param_atol=0.0, approx=False):
  """The Pallas step equals the jitted reference step bit for bit (the
  param within `param_atol`)."""
  rng = np.random.default_rng(1)
  p = jnp.asarray(rng.standard_normal(shape), jnp.float32)
  zeros = jnp.zeros(shape, jnp.float32)
  mu, nu = (reference.Moment(*group_reference.quantize_per_group(
      zeros, 128, fmt, expansion)) for fmt in moment_dtypes)
  hp = {k: jnp.float32(v) for k, v in FMA_NEUTRAL.items()}
  ref = jax.jit(lambda *a, hp: reference.coat_adam_step(
      *a, **hp, expansion=expansion))
  fused = jax.jit(lambda *a, hp: api.coat_adam_step(
      *a, **hp, expansion=expansion, implementation='pallas',
      approx=approx))
  for step in range(steps):
    g = _grads(shape, step)
    want = ref(p, g, mu, nu, jnp.int32(step + 1), hp=hp)
    got = fused(p, g, mu, nu, jnp.int32(step + 1), hp=hp)
    np.testing.assert_allclose(got[0], want[0], rtol=0, atol=param_atol)
    if not param_atol:
      np.testing.assert_array_equal(_bits(got[0]), _bits(want[0]))
    for a, b in zip(jax.tree.leaves(got[1:]), jax.tree.leaves(want[1:])):
      assert a.shape == b.shape and a.dtype == b.dtype
      np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=f'{step}')
    p, mu, nu = want


@pytest.mark.parametrize('shape,moment_dtypes,expansion', [
    ((5, 300), ('e4m3', 'e4m3'), True),
    ((4, 256), ('e4m3', 'e5m2'), True),
    ((300,), ('e5m2', 'e5m2'), True),
    ((2, 3, 40), ('e4m3', 'e4m3'), False),
])
def test_pallas_kernel_is_its_reference_bit_for_bit(shape, moment_dtypes,
                                                    expansion):
  _assert_step_is_reference(shape, moment_dtypes, expansion)


@pytest.mark.parametrize('implementation', ['xla', 'pallas'])
@pytest.mark.parametrize('layer_shape,expansion', [
    ((5, 300), True), ((4, 256), False), ((300,), True)])
def test_one_layer_of_a_stack_is_the_step_on_that_layer(
    implementation, layer_shape, expansion):
  """`layer=i` on a stack (L, ...) gives layer i exactly what the step on
  the slice gives, and leaves every other layer's bytes as they were."""
  num_layers, layer = 3, 1
  shape = (num_layers, *layer_shape)
  rng = np.random.default_rng(5)
  p = jnp.asarray(rng.standard_normal(shape), jnp.float32)
  mu, nu = (coat_jax.quant.quantize_per_group(
      jnp.asarray(rng.standard_normal(shape) * s, jnp.float32), 128, fmt,
      expansion=expansion) for s, fmt in ((1e-2, 'e4m3'), (1e-4, 'e5m2')))
  g = _grads(layer_shape, 7)
  kw = dict(learning_rate=1e-2, weight_decay=0.1, expansion=expansion,
            implementation=implementation, apply=jnp.bool_(True))
  stacked = jax.jit(lambda p, g, mu, nu: api.coat_adam_step(
      p, g, mu, nu, jnp.int32(3), layer=layer, **kw))(p, g, mu, nu)
  at = lambda tree, i: jax.tree.map(lambda a: a[i], tree)
  alone = jax.jit(lambda p, g, mu, nu: api.coat_adam_step(
      p, g, mu, nu, jnp.int32(3), **kw))(*at((p,), layer), g,
                                          *at((mu, nu), layer))
  assert isinstance(stacked[1], coat_jax.QuantizedArray)
  for got, want, old in zip(jax.tree.leaves(stacked), jax.tree.leaves(alone),
                            jax.tree.leaves((p, mu, nu))):
    assert got.shape == old.shape and got.dtype == old.dtype
    np.testing.assert_array_equal(_bits(got[layer]), _bits(want))
    for other in set(range(num_layers)) - {layer}:
      np.testing.assert_array_equal(_bits(got[other]), _bits(old[other]))


def test_every_layer_of_a_stack_shares_one_kernel():
  """Stepping each layer of a stack traces the Pallas kernel once: the layer
  is an operand, so unrolled models lower and compile one kernel per leaf
  shape, not one per layer (22 per leaf at 1b: most of its compile time)."""
  shape = (4, 8, 256)
  p = jnp.zeros(shape, jnp.float32)
  q = coat_jax.quant.quantize_per_group(p, 128, 'e4m3', expansion=True)

  def step_all(p, g, mu, nu):
    for layer in range(shape[0]):
      p, mu, nu = api.coat_adam_step(p, g, mu, nu, jnp.int32(1),
                                     learning_rate=1e-3, layer=layer,
                                     implementation='pallas')
    return p

  calls = [e for e in jax.make_jaxpr(step_all)(p, p[0], q, q).jaxpr.eqns
           if e.primitive.name in ('jit', 'pjit')
           and e.params['name'] == 'coat_adam_step']
  assert len(calls) == shape[0]
  assert len({id(e.params['jaxpr']) for e in calls}) == 1


def test_layer_validation():
  p = jnp.ones((2, 4, 8))
  q = coat_jax.quant.quantize_per_group(p, 128, 'e4m3', expansion=True)
  with pytest.raises(ValueError, match=r'param.shape\[1:\]'):
    api.coat_adam_step(p, p, q, q, 1, learning_rate=1e-3, layer=0)
  with pytest.raises(ValueError, match='outside the stack'):
    api.coat_adam_step(p, p[0], q, q, 1, learning_rate=1e-3, layer=2)


@pytest.mark.parametrize('implementation', ['xla', 'pallas'])
def test_apply_false_changes_nothing(implementation):
  shape = (5, 300)
  rng = np.random.default_rng(3)
  p = jnp.asarray(rng.standard_normal(shape), jnp.float32)
  q = coat_jax.quant.quantize_per_group(
      jnp.asarray(rng.standard_normal(shape), jnp.float32), 128, 'e4m3',
      expansion=True)
  step = jax.jit(lambda apply, g: api.coat_adam_step(
      p, g, q, q, jnp.int32(3), learning_rate=1e-2, weight_decay=0.1,
      apply=apply, implementation=implementation))
  g = _grads(shape, 0).at[0, 0].set(jnp.nan)
  for a, b in zip(jax.tree.leaves(step(False, g)),
                  jax.tree.leaves((p, q, q))):
    np.testing.assert_array_equal(_bits(a), _bits(b))
  g = _grads(shape, 0)
  # The same step without `apply`, jitted alike (XLA's FMAs depend on it).
  want = jax.jit(lambda g: api.coat_adam_step(
      p, g, q, q, jnp.int32(3), learning_rate=1e-2, weight_decay=0.1,
      implementation=implementation))(g)
  for a, b in zip(jax.tree.leaves(step(True, g)), jax.tree.leaves(want)):
    np.testing.assert_array_equal(_bits(a), _bits(b))


def test_nonfinite_grad_matches_reference():
  shape = (4, 256)
  p = jnp.ones(shape)
  g = _grads(shape, 1).at[0, 5].set(jnp.nan).at[2, 200].set(jnp.inf)
  zeros = coat_jax.quant.quantize_per_group(
      jnp.zeros(shape), 128, 'e4m3', expansion=True)
  outs = [api.coat_adam_step(p, g, zeros, zeros, jnp.int32(1),
                             learning_rate=1e-3, implementation=impl)
          for impl in ('xla', 'pallas')]
  for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])):
    np.testing.assert_array_equal(
        np.isnan(np.asarray(a, np.float32)),
        np.isnan(np.asarray(b, np.float32)))


def test_validation():
  p = jnp.ones((4, 8))
  q = coat_jax.quant.quantize_per_group(p, 128, 'e4m3', expansion=True)
  with pytest.raises(ValueError, match='grad'):
    api.coat_adam_step(p, jnp.ones((4, 9)), q, q, 1, learning_rate=1e-3)
  with pytest.raises(ValueError, match='exponent'):
    api.coat_adam_step(p, p, q, q, 1, learning_rate=1e-3, expansion=False)
  with pytest.raises(TypeError, match='mu'):
    api.coat_adam_step(p, p, p, q, 1, learning_rate=1e-3)
  with pytest.raises(ValueError, match='implementation'):
    api.coat_adam_step(p, p, q, q, 1, learning_rate=1e-3,
                       implementation='cuda')


@pytest.mark.gpu
@pytest.mark.parametrize('shape', [(1024, 4096), (37, 1000), (4097,)])
def test_gpu_kernel_matches_coat_adamw(shape):
  """The kernel as it runs (approximate lg2/ex2 in the group math): codes
  within 2 steps in at most 1% of the elements, every exponent within one
  step, scales within 4 ulps, params within 4 ulps + 1e-4 of the update."""
  _run(shape, 'pallas', steps=4, moment_tol=dict(max_frac=1e-2, max_step=2))


@pytest.mark.gpu
@pytest.mark.parametrize('shape,moment_dtypes', [
    ((1024, 4096), ('e4m3', 'e4m3')),  # whole tiles: no masks
    ((37, 1000), ('e4m3', 'e5m2')),  # partial tiles and groups
    ((4097,), ('e5m2', 'e5m2')),
])
def test_gpu_kernel_is_xla_reference_bit_for_bit(shape, moment_dtypes):
  """The compiled kernel and the reference compiled by XLA: the same bits,
  params included (XLA's GPU simplifier turns the bias-corrected ratio
  (m / bc1) / den into m / (bc1 den); the kernel divides so too). With
  exact log and exp (approx=False)."""
  _assert_step_is_reference(shape, moment_dtypes, steps=4)


@pytest.mark.gpu
@pytest.mark.parametrize('expansion', [False, True])
def test_gpu_tiny_gradients_keep_the_params_finite(expansion):
  """Gradients near 1e-18 make second moments whose group amax / fp8_max
  is subnormal; the compiled step keeps params and moments finite and
  steps like the reference (lr 0 leaves the params as they are)."""
  rng = np.random.default_rng(3)
  shape = (256, 1024)
  p = jnp.asarray(rng.standard_normal(shape), jnp.float32)
  g = jnp.asarray(rng.standard_normal(shape) * 1e-18, jnp.float32)
  zeros = jnp.zeros(shape, jnp.float32)
  mu, nu = (reference.Moment(*group_reference.quantize_per_group(
      zeros, 128, 'e4m3', expansion)) for _ in range(2))
  for lr in (0.0, 1e-3):
    new_p, new_mu, new_nu = api.coat_adam_step(
        p, g, mu, nu, jnp.int32(1), learning_rate=lr, weight_decay=0.1,
        expansion=expansion, implementation='pallas')
    for leaf in jax.tree.leaves((new_p, new_mu, new_nu)):
      assert np.isfinite(np.asarray(leaf, np.float32)).all()
    if lr == 0.0:
      np.testing.assert_array_equal(new_p, p)
