"""FP8 linear layer: numerics against float32, residuals, module, errors."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import coat_jax.nn as cnn
from coat_jax.quant import fp8_max


def _key():
  return jax.random.key(np.random.randint(1 << 30))


def _exact(key, shape, fmt, exponent):
  """Array whose per-tensor quantization in `fmt` is exact: FP8 codes with
  max |code| = fp8_max, times 2**exponent."""
  dtype = {'e4m3': jnp.float8_e4m3fn, 'e5m2': jnp.float8_e5m2}[fmt]
  m = fp8_max(fmt)
  codes = jnp.clip(jax.random.normal(key, shape) * m / 4, -m, m).astype(dtype)
  codes = codes.reshape(-1).at[0].set(m).reshape(shape)
  return codes.astype(jnp.float32) * 2.0**exponent


def _rel(a, b):
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def _ref(x, w):
  return jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32),
                 precision=jax.lax.Precision.HIGHEST)


def _fp8(x, w):
  return cnn.fp8_dense(x, [w])[0]


@jax.jit
def _fwd_bwd(x, w, dy):
  """Forward and gradients of the FP8 layer and of the float32 reference."""
  y, vjp = jax.vjp(_fp8, x, w)
  y_ref, vjp_ref = jax.vjp(_ref, x, w)
  return (y, *vjp(dy)), (y_ref, *vjp_ref(dy.astype(jnp.float32)))


def test_exact_on_fp8_representable_inputs():
  k = jax.random.split(_key(), 3)
  x = _exact(k[0], (3, 32, 128), 'e4m3', -6).astype(jnp.bfloat16)
  w = _exact(k[1], (128, 64), 'e4m3', -10)
  dy = _exact(k[2], (3, 32, 64), 'e5m2', -14).astype(jnp.bfloat16)
  (y, dx, dw), (y_ref, dx_ref, dw_ref) = _fwd_bwd(x, w, dy)
  assert y.dtype == jnp.bfloat16 and dx.dtype == jnp.bfloat16
  assert dw.dtype == jnp.float32
  # Only the bf16 rounding of outputs (and f32 summation order) remains.
  np.testing.assert_allclose(y.astype(jnp.float32), y_ref, rtol=2**-8,
                             atol=1e-6 * np.abs(y_ref).max())
  np.testing.assert_allclose(dx.astype(jnp.float32), dx_ref, rtol=2**-8,
                             atol=1e-6 * np.abs(dx_ref).max())
  np.testing.assert_allclose(dw, dw_ref, rtol=1e-5,
                             atol=1e-6 * np.abs(dw_ref).max())


@pytest.mark.parametrize('shape', [(4, 37, 128), (1, 1, 128), (23, 128)])
def test_random_inputs_within_fp8_error(shape):
  k = jax.random.split(_key(), 3)
  x = jax.random.normal(k[0], shape, jnp.bfloat16)
  w = jax.random.normal(k[1], (128, 96)) * 0.05
  dy = jax.random.normal(k[2], shape[:-1] + (96,), jnp.bfloat16)
  (y, dx, dw), (y_ref, dx_ref, dw_ref) = _fwd_bwd(x, w, dy)
  assert y.shape == y_ref.shape and dx.shape == x.shape
  assert _rel(y, y_ref) < 0.06   # E4M3 x E4M3: ~0.036 typical
  assert _rel(dx, dx_ref) < 0.09  # E5M2 x E4M3: ~0.057 typical
  assert _rel(dw, dw_ref) < 0.09


def test_fanout_shares_the_input_and_sums_dgrad():
  k = jax.random.split(_key(), 4)
  x = jax.random.normal(k[0], (2, 16, 64), jnp.bfloat16)
  w1 = jax.random.normal(k[1], (64, 32)) * 0.1
  w2 = jax.random.normal(k[2], (64, 48)) * 0.1
  def loss(fn, x, w1, w2):
    a, b = fn(x, [w1, w2])
    return jnp.sum(a.astype(jnp.float32) ** 2) + jnp.sum(
        jnp.sin(b.astype(jnp.float32)))
  ref_fn = lambda x, ws: tuple(_ref(x, w) for w in ws)
  grad = lambda fn: jax.jit(jax.grad(
      lambda *a: loss(fn, *a), argnums=(0, 1, 2)))(x, w1, w2)
  g, g_ref = grad(cnn.fp8_dense), grad(ref_fn)
  for a, b in zip(g, g_ref):
    assert _rel(a, b) < 0.1
  res = cnn.saved_residuals(cnn.fp8_dense, x, [w1, w2])
  assert [str(r.dtype) for r in res] == ['float8_e4m3fn', 'float32']
  assert res[0].shape == (64, 32) and res[1].shape == ()  # x^T, saved once


def test_saves_only_the_fp8_input_and_its_scale():
  x = jax.random.normal(_key(), (2, 40, 64), jnp.bfloat16)
  w = jnp.ones((64, 32))
  res = cnn.saved_residuals(_fp8, x, w)
  # The input is saved transposed (K, M): the K-major operand of wgrad.
  assert [(r.shape, str(r.dtype)) for r in res] == [
      ((64, 80), 'float8_e4m3fn'), ((), 'float32')]


def test_nan_input_gives_nan_output():
  x = jnp.ones((16, 32), jnp.bfloat16).at[3, 5].set(jnp.nan)
  y = jax.jit(_fp8)(x, jnp.ones((32, 16)))
  assert np.isnan(np.asarray(y, np.float32)).all()
  dw = jax.jit(jax.grad(lambda w: jnp.sum(
      _fp8(jnp.ones((16, 32), jnp.bfloat16), w) * jnp.nan)))(jnp.ones((32, 16)))
  assert np.isnan(np.asarray(dw)).all()


@pytest.mark.parametrize('precision', ['bf16', 'fp8_linear', 'coat'])
def test_module_mirrors_nnx_linear(precision):
  layer = cnn.CoatLinear(64, 32, precision=precision, rngs=nnx.Rngs(0))
  ref = nnx.Linear(64, 32, rngs=nnx.Rngs(0))
  assert layer.kernel.shape == (64, 32) and layer.kernel.dtype == jnp.float32
  assert layer.bias.shape == (32,)
  np.testing.assert_array_equal(layer.kernel[...], ref.kernel[...])
  layer.bias[...] = jax.random.normal(_key(), (32,))
  ref.bias[...] = layer.bias[...]
  x = jax.random.normal(_key(), (5, 64), jnp.bfloat16)
  y = nnx.jit(lambda m, x: m(x))(layer, x)
  assert y.dtype == jnp.bfloat16 and y.shape == (5, 32)
  assert _rel(y, ref(x.astype(jnp.float32))) < 0.06


def test_module_records_logical_axes():
  layer = cnn.CoatLinear(64, 32, kernel_axes=('embed', 'mlp'),
                         rngs=nnx.Rngs(0))
  assert layer.kernel.get_metadata()['out_sharding'] == ('embed', 'mlp')
  assert layer.bias.get_metadata()['out_sharding'] == ('mlp',)


def test_errors_name_the_argument():
  with pytest.raises(ValueError, match='in_features=40 must be a multiple'):
    cnn.CoatLinear(40, 32, precision='coat', rngs=nnx.Rngs(0))
  cnn.CoatLinear(40, 30, precision='bf16', rngs=nnx.Rngs(0))  # fine in bf16
  with pytest.raises(ValueError, match='precision='):
    cnn.CoatLinear(32, 32, precision='fp8', rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match='floating'):
    cnn.fp8_dense(jnp.ones((16, 32), jnp.int32), [jnp.ones((32, 16))])
  with pytest.raises(ValueError, match=r'kernels\[0\] has shape'):
    cnn.fp8_dense(jnp.ones((16, 32)), [jnp.ones((16, 32))])
