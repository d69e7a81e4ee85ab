"""FP8 SwiGLU and CoatMLP: numerics against float32, what they save."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import coat_jax.nn as cnn


def _group_exact(key, shape, exponent=-7):
  codes = jnp.clip(jax.random.normal(key, shape) * 100, -448, 448)
  codes = codes.astype(jnp.float8_e4m3fn).astype(jnp.float32)
  groups = codes.reshape(shape[:-1] + (shape[-1] // 16, 16))
  groups = groups.at[..., 3].set(-448.0)
  return (groups.reshape(shape) * 2.0**exponent).astype(jnp.bfloat16)


def _ref(gate, up):
  g = gate.astype(jnp.float32)
  return g * jax.nn.sigmoid(g) * up.astype(jnp.float32)


@jax.jit
def _fwd_bwd(gate, up, dh):
  h, vjp = jax.vjp(cnn.fp8_swiglu, gate, up)
  h_ref, vjp_ref = jax.vjp(_ref, gate, up)
  return (h, *vjp(dh)), (h_ref, *vjp_ref(dh.astype(jnp.float32)))


def _rel(a, b):
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def test_swiglu_exact_on_group_representable_inputs(seed):
  k = jax.random.split(jax.random.key(seed), 3)
  gate = _group_exact(k[0], (2, 24, 176))
  up = _group_exact(k[1], (2, 24, 176))
  dh = jax.random.normal(k[2], (2, 24, 176), jnp.bfloat16)
  (h, dg, du), (h_ref, dg_ref, du_ref) = _fwd_bwd(gate, up, dh)
  for a, b in ((h, h_ref), (dg, dg_ref), (du, du_ref)):
    assert a.dtype == jnp.bfloat16
    np.testing.assert_allclose(a.astype(jnp.float32), b, rtol=2**-7,
                               atol=1e-6 * np.abs(b).max())


def test_swiglu_random_within_fp8_error(seed):
  k = jax.random.split(jax.random.key(seed), 3)
  gate = (2 * jax.random.normal(k[0], (3, 37, 64))).astype(jnp.bfloat16)
  up = jax.random.normal(k[1], (3, 37, 64), jnp.bfloat16)
  dh = jax.random.normal(k[2], (3, 37, 64), jnp.bfloat16)
  (h, dg, du), (h_ref, dg_ref, du_ref) = _fwd_bwd(gate, up, dh)
  assert _rel(h, h_ref) < 2**-7  # forward uses the exact inputs
  assert _rel(dg, dg_ref) < 0.06
  assert _rel(du, du_ref) < 0.06


def test_swiglu_saves_only_fp8_groups():
  gate = jnp.ones((2, 40, 176), jnp.bfloat16)
  res = cnn.saved_residuals(cnn.fp8_swiglu, gate, gate + 1)
  assert [(r.shape, str(r.dtype)) for r in res] == [
      ((2, 40, 176), 'float8_e4m3fn'), ((2, 40, 11), 'float8_e8m0fnu')] * 2


def _mlp_grads(precision, params_from, x, dy):
  mlp = cnn.CoatMLP(64, 176, recipe=precision, rngs=nnx.Rngs(0))
  graph, state = nnx.split(mlp)
  if params_from is not None:
    state = params_from

  @jax.jit
  def run(state, x):
    y, vjp = jax.vjp(lambda s, x: nnx.merge(graph, s)(x), state, x)
    return y, vjp(dy)
  return state, graph, run(state, x)


def test_mlp_modes_agree_and_coat_saves_only_fp8(seed):
  k = jax.random.split(jax.random.key(seed), 2)
  x = jax.random.normal(k[0], (2, 20, 64), jnp.bfloat16)
  dy = jax.random.normal(k[1], (2, 20, 64), jnp.bfloat16)
  state, _, (y_ref, (ds_ref, dx_ref)) = _mlp_grads('bf16', None, x, dy)
  for precision in ('fp8_linear', 'coat'):
    _, graph, (y, (ds, dx)) = _mlp_grads(precision, state, x, dy)
    assert _rel(y, y_ref) < 0.08
    assert _rel(dx, dx_ref) < 0.12
    for a, b in zip(jax.tree.leaves(ds), jax.tree.leaves(ds_ref)):
      assert a.dtype == jnp.float32 and _rel(a, b) < 0.12
  res = cnn.saved_residuals(lambda s, x: nnx.merge(graph, s)(x), state, x)
  big = [r for r in res if r.size >= x.size]
  assert {str(r.dtype) for r in big} == {'float8_e4m3fn'}, res


def test_coat_mlp_one_rule_matches_the_layers_composed(seed):
  """CoatMLP in 'coat' mode runs gate/up and SwiGLU as one custom_vjp
  (`fp8_gate_up_swiglu`), whose backward hands SwiGLU's max |dgate| and max
  |dup| to their quantizers: the bits of fp8_dense + fp8_swiglu + fp8_dense
  composed, which compute those maxima apart (tokens padded: 42 rows)."""
  k = jax.random.split(jax.random.key(seed), 2)
  x = jax.random.normal(k[0], (2, 21, 64), jnp.bfloat16)
  dy = jax.random.normal(k[1], (2, 21, 64), jnp.bfloat16)
  graph, state = nnx.split(
      cnn.CoatMLP(64, 176, recipe='coat', rngs=nnx.Rngs(1)))

  def composed(state, x):
    m = nnx.merge(graph, state)
    gate, up = cnn.fp8_dense(x, [m.gate_proj.kernel[...],
                                 m.up_proj.kernel[...]])
    return cnn.fp8_dense(cnn.fp8_swiglu(gate, up),
                         [m.down_proj.kernel[...]])[0]

  def layer(state, x):
    return nnx.merge(graph, state)(x)

  def layer_given_amax(state, x):  # as the decoder layer's RMSNorm hands it
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
    return nnx.merge(graph, state)(x, x_amax=amax)

  got, want, given = (jax.jit(lambda s, x, f=f: (lambda y, vjp: (y, vjp(dy)))(
      *jax.vjp(f, s, x)))(state, x)
                      for f in (layer, composed, layer_given_amax))
  for a, b, c in zip(jax.tree.leaves(got), jax.tree.leaves(want),
                     jax.tree.leaves(given), strict=True):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a, np.float32),
                                  np.asarray(b, np.float32))
    np.testing.assert_array_equal(np.asarray(a, np.float32),
                                  np.asarray(c, np.float32))
  mlp = nnx.merge(graph, state)
  kernels = [mlp.gate_proj.kernel[...], mlp.up_proj.kernel[...]]
  h, h_amax = cnn.fp8_gate_up_swiglu(x, *kernels)
  assert h.shape == (2, 21, 176) and h_amax.dtype == jnp.float32
  assert float(h_amax) == float(jnp.max(jnp.abs(h.astype(jnp.float32))))


def test_errors():
  with pytest.raises(ValueError, match='hidden_features=100 must be'):
    cnn.CoatMLP(64, 100, recipe='coat', rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match='same shape'):
    cnn.fp8_swiglu(jnp.ones((2, 32)), jnp.ones((2, 16)))
  with pytest.raises(ValueError, match=r'gate.shape\[-1\]=24'):
    cnn.fp8_swiglu(jnp.ones((2, 24)), jnp.ones((2, 24)))
