"""fp8_states: other optax optimizers with FP8 states, against float32."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import coat_jax
from coat_jax import quant

_IS_Q = lambda x: isinstance(x, quant.QuantizedArray)


def _problem():
  """A small least-squares MLP: params (a dict), and a loss of them."""
  k = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(k[0], (64, 32))
  w_true = jax.random.normal(k[1], (32, 8)) / 6
  y = jnp.tanh(x @ w_true)
  params = {'w1': jax.random.normal(k[2], (32, 256)) * 0.1,
            'b1': jnp.zeros(256),
            'w2': jax.random.normal(k[3], (8, 256)) * 0.05}
  loss = lambda p: jnp.mean((jnp.tanh(x @ p['w1'] + p['b1']) @ p['w2'].T - y)
                            ** 2)
  return params, loss


def _train(tx, steps=60):
  params, loss = _problem()
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    value, grads = jax.value_and_grad(loss)(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value

  for _ in range(steps):
    params, state, _ = step(params, state)
  return float(loss(params)), state


def _state_bytes_per_param(state, params):
  """Bytes per param of `state`'s param-sized leaves (not its scalars)."""
  n = sum(p.size for p in jax.tree.leaves(params))
  return sum(x.nbytes for x in jax.tree.leaves(state) if x.ndim) / n


INNERS = {
    'sgd_momentum': lambda: optax.sgd(0.1, momentum=0.9),
    'lion': lambda: optax.lion(1e-3, weight_decay=0.01),
    'adamw': lambda: optax.adamw(3e-3, weight_decay=0.01),
}
# Moments per param: float32 state bytes per param 4 or 8 (and a count).
STATES = {'sgd_momentum': 1, 'lion': 1, 'adamw': 2}


@pytest.mark.parametrize('name', list(INNERS))
def test_trains_like_the_float32_optimizer(name):
  params, loss = _problem()
  start = float(loss(params))
  ref, ref_state = _train(INNERS[name]())
  ours, state = _train(coat_jax.fp8_states(INNERS[name]()))
  fp32_bytes = _state_bytes_per_param(ref_state, params)
  fp8_bytes = _state_bytes_per_param(state, params)
  print(f'\n{name}: loss {start:.4f} -> float32 {ref:.5f}, fp8 states'
        f' {ours:.5f}; state bytes/param {fp32_bytes:.3f} -> {fp8_bytes:.3f}')
  assert ref < 0.5 * start
  # Within 10% of the float32 optimizer's loss reduction.
  assert abs(ours - ref) <= 0.1 * (start - ref)
  # 1 byte per element, 4 + 4 bytes (scale, exponent) per 128 (every last
  # axis here is a multiple of 128: no partial groups), per moment.
  assert fp8_bytes == STATES[name] * 1.0625
  assert fp32_bytes == STATES[name] * 4
  mirrored = jax.tree.leaves(state, is_leaf=_IS_Q)
  assert sum(map(_IS_Q, mirrored)) == 3 * STATES[name]


def _dequantized(state):
  """`state` with each FP8 leaf (a QuantizedArray) dequantized to float32."""
  return jax.tree.map(lambda x: quant.dequantize(x) if _IS_Q(x) else x,
                      state, is_leaf=_IS_Q)


@pytest.mark.parametrize('name, dtype', [
    ('sgd_momentum', 'e4m3'), ('lion', 'e4m3'), ('adamw', 'e4m3'),
    ('adamw', 'e5m2')])
def test_each_step_is_the_inner_step_on_the_dequantized_state(name, dtype):
  """The oracle, step after step: the inner optimizer in float32 on the
  dequantized state gives the update, bit for bit, and its new state
  quantized (group_size, dtype, expansion as fp8_states') is the new state,
  code for code. The reference runs on its own: it never reads the state
  fp8_states returns."""
  params, loss = _problem()
  inner = INNERS[name]()
  tx = coat_jax.fp8_states(INNERS[name](), group_size=64, dtype=dtype)
  state = tx.init(params)
  quantize = lambda x: quant.quantize_per_group(x, 64, dtype, expansion=True)
  requantize = lambda tree: jax.tree.map(
      lambda x, like: quantize(x) if _IS_Q(like) else x, tree,
      jax.eval_shape(tx.init, params), is_leaf=_IS_Q)
  ref_state = requantize(inner.init(params))
  for step in range(4):
    grads = jax.grad(loss)(params)
    want, ref_float = inner.update(grads, _dequantized(ref_state), params)
    ref_state = requantize(ref_float)
    updates, state = tx.update(grads, state, params)
    for path, got, w in zip(jax.tree_util.tree_flatten_with_path(want)[0],
                            jax.tree.leaves(updates), jax.tree.leaves(want)):
      np.testing.assert_array_equal(got, w, err_msg=f'step {step} {path}')
    got_leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    assert len(got_leaves) == len(jax.tree.leaves(ref_state))
    for (path, got), w in zip(got_leaves, jax.tree.leaves(ref_state)):
      assert got.dtype == w.dtype, (step, path)
      np.testing.assert_array_equal(
          np.asarray(got, np.float32), np.asarray(w, np.float32),
          err_msg=f'step {step} {jax.tree_util.keystr(path)}')
    params = optax.apply_updates(params, updates)
  # The momentum moved: zero states would pass the comparison above only
  # if the reference froze them too.
  moments = [q for q in jax.tree.leaves(state, is_leaf=_IS_Q) if _IS_Q(q)]
  assert all(np.abs(np.asarray(quant.dequantize(q))).max() > 0
             for q in moments)


def test_counts_stay_and_moments_are_fp8():
  params, _ = _problem()
  state = coat_jax.fp8_states(optax.adam(1e-3), dtype='e5m2').init(params)
  adam = state[0]
  assert adam.count.dtype == jnp.int32
  for moment in (adam.mu, adam.nu):
    for q in jax.tree.leaves(moment, is_leaf=_IS_Q):
      assert _IS_Q(q) and q.values.dtype == jnp.float8_e5m2
      assert q.exponent is not None and q.group_size == 128


def test_under_nnx_optimizer_and_jit():
  """nnx.Optimizer hands the FP8 leaves back as nnx State mappings."""

  class Mlp(nnx.Module):
    def __init__(self, rngs):
      self.a = nnx.Linear(16, 128, rngs=rngs)
      self.b = nnx.Linear(128, 4, rngs=rngs)

    def __call__(self, x):
      return self.b(jnp.tanh(self.a(x)))

  x = jax.random.normal(jax.random.key(1), (32, 16))
  y = jax.random.normal(jax.random.key(2), (32, 4))
  loss = lambda m: jnp.mean((m(x) - y) ** 2)

  def run(tx):
    model = Mlp(nnx.Rngs(0))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, opt):
      value, grads = nnx.value_and_grad(loss)(model)
      opt.update(model, grads)
      return value

    return [float(step(model, opt)) for _ in range(4)]

  ours = run(optax.MultiSteps(coat_jax.fp8_states(optax.lion(1e-3)), 1))
  ref = run(optax.MultiSteps(optax.lion(1e-3), 1))
  assert ours[-1] < ours[0]
  np.testing.assert_allclose(ours, ref, rtol=2e-2)


def test_bad_arguments():
  with pytest.raises(TypeError, match='inner'):
    coat_jax.fp8_states(optax.sgd)
  with pytest.raises(ValueError, match='dtype'):
    coat_jax.fp8_states(optax.sgd(0.1), dtype='int8')
  with pytest.raises(ValueError, match='group_size'):
    coat_jax.fp8_states(optax.sgd(0.1), group_size=0)
  tx = coat_jax.fp8_states(optax.sgd(0.1, momentum=0.9))
  state = tx.init({'w': jnp.ones((4, 8)), 'b': jnp.ones(8)})
  with pytest.raises(ValueError, match='tree structure'):
    tx.update({'w': jnp.ones((4, 8))}, state)
