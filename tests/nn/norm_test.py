"""FP8 RMSNorm: numerics against float32, what it saves, errors."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import coat_jax.nn as cnn
from coat_jax.nn import norm as norm_lib
from coat_jax.nn import residuals
from pallas_kernels.rms_norm_fp8 import reference as norm_reference


def _group_exact(key, shape, exponent=-6):
  """bf16 array whose E4M3 1x16 quantization (bf16 scales) is exact."""
  codes = jnp.clip(jax.random.normal(key, shape) * 100, -448, 448)
  codes = codes.astype(jnp.float8_e4m3fn).astype(jnp.float32)
  groups = codes.reshape(shape[:-1] + (shape[-1] // 16, 16))
  groups = groups.at[..., 0].set(448.0)  # every group's max is exactly 448
  return (groups.reshape(shape) * 2.0**exponent).astype(jnp.bfloat16)


def _ref(x, scale, eps=1e-5):
  xf = x.astype(jnp.float32)
  rstd = jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps)
  return xf * rstd * scale


@jax.jit
def _fwd_bwd(x, scale, g):
  y, vjp = jax.vjp(cnn.fp8_rms_norm, x, scale)
  y_ref, vjp_ref = jax.vjp(_ref, x, scale)
  return (y, *vjp(g)), (y_ref, *vjp_ref(g.astype(jnp.float32)))


def _rel(a, b):
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def test_exact_on_group_representable_input(seed):
  k = jax.random.split(jax.random.key(seed), 3)
  x = _group_exact(k[0], (3, 24, 128))
  scale = 1 + 0.1 * jax.random.normal(k[1], (128,))
  g = jax.random.normal(k[2], (3, 24, 128), jnp.bfloat16)
  (y, dx, ds), (y_ref, dx_ref, ds_ref) = _fwd_bwd(x, scale, g)
  assert y.dtype == dx.dtype == jnp.bfloat16 and ds.dtype == jnp.float32
  np.testing.assert_allclose(y.astype(jnp.float32), y_ref, rtol=2**-8,
                             atol=1e-3)
  np.testing.assert_allclose(dx.astype(jnp.float32), dx_ref, rtol=2**-7,
                             atol=2**-8 * np.abs(dx_ref).max())
  np.testing.assert_allclose(ds, ds_ref, rtol=1e-4,
                             atol=1e-5 * np.abs(ds_ref).max())


def test_random_input_within_fp8_error(seed):
  k = jax.random.split(jax.random.key(seed), 3)
  x = (3 * jax.random.normal(k[0], (2, 37, 256))).astype(jnp.bfloat16)
  scale = 1 + 0.1 * jax.random.normal(k[1], (256,))
  g = jax.random.normal(k[2], (2, 37, 256), jnp.bfloat16)
  (y, dx, ds), (y_ref, dx_ref, ds_ref) = _fwd_bwd(x, scale, g)
  assert _rel(y, y_ref) < 2**-7  # the forward is not quantized
  assert _rel(dx, dx_ref) < 0.05
  assert _rel(ds, ds_ref) < 0.05
  assert np.isfinite(np.asarray(dx, np.float32)).all()


def test_saves_fp8_groups_e8m0_scales_and_rstd():
  x = jnp.ones((2, 40, 128), jnp.bfloat16)
  res = cnn.saved_residuals(cnn.fp8_rms_norm, x, jnp.ones((128,)))
  assert [(r.shape, str(r.dtype)) for r in res] == [
      ((2, 40, 128), 'float8_e4m3fn'), ((2, 40, 8), 'float8_e8m0fnu'),
      ((2, 40, 1), 'float32')]
  per_element = residuals.nbytes(res) / x.size
  # 1 (code) + 1/16 (E8M0 scale) + 4/128 (rstd): 1.094 bytes vs 2 for bf16.
  print(f'fp8_rms_norm saves {per_element:.4f} bytes/element'
        ' (bf16 scales: 1.1563, fp32: 1.2813)')
  assert per_element == pytest.approx(1 + 1 / 16 + 4 / 128)


def test_nan_propagates_to_dx():
  x = jnp.ones((4, 32), jnp.bfloat16).at[1, 3].set(jnp.nan)
  dx = jax.jit(jax.grad(lambda x: jnp.sum(cnn.fp8_rms_norm(
      x, jnp.ones((32,))).astype(jnp.float32))))(x)
  assert np.isnan(np.asarray(dx[1], np.float32)).all()


def _with_input_case(implementation, pick_pallas, seed):
  """(x, scale, g_x, g_y) of a pre-norm block's norm, with the kernels
  picked if `implementation` is 'pallas' (as on one Hopper GPU;
  interpreted here)."""
  if implementation == 'pallas':
    pick_pallas()
  k = jax.random.split(jax.random.key(seed), 4)
  x = (3 * jax.random.normal(k[0], (2, 37, 256))).astype(jnp.bfloat16)
  scale = 1 + 0.1 * jax.random.normal(k[1], (256,))
  g_x = jax.random.normal(k[2], x.shape, jnp.bfloat16)
  g_y = jax.random.normal(k[3], x.shape, jnp.bfloat16)
  return x, scale, g_x, g_y


@pytest.mark.parametrize('implementation', ['xla', 'pallas'])
def test_with_input_adds_the_residual_gradient_before_rounding(
    implementation, pick_pallas, seed):
  """(x, norm(x)) with the residual stream's gradient added inside the
  norm's backward pass: the values of x, fp8_rms_norm(x); dscale the same;
  dx the separate sum's to one rounding, and closer to float32."""
  x, scale, g_x, g_y = _with_input_case(implementation, pick_pallas, seed)

  def grads(fn, x, scale):
    out, vjp = jax.vjp(fn, x, scale)
    return out[:2], vjp((g_x, g_y) + (jnp.float32(7.0),) * (len(out) - 2))

  grads = jax.jit(grads, static_argnums=0)

  fused = grads(norm_lib.fp8_rms_norm_with_input, x, scale)
  separate = grads(lambda x, s: (x, cnn.fp8_rms_norm(x, s)), x, scale)
  jaxpr = str(jax.make_jaxpr(
      lambda x, s: jax.vjp(norm_lib.fp8_rms_norm_with_input, x, s)[1](
          (g_x, g_y, jnp.float32(0))))(x, scale))
  assert ('rms_norm_fp8_bwd' in jaxpr) == (implementation == 'pallas')
  (x_out, y), (dx, ds) = fused
  (_, y_sep), (dx_sep, ds_sep) = separate
  np.testing.assert_array_equal(x_out, x)
  np.testing.assert_array_equal(y, y_sep)
  np.testing.assert_array_equal(ds, ds_sep)
  # The float32 sum: the norm's dx from the same FP8 residuals, in float32,
  # plus g_x. The separate sum rounds twice (the norm's dx, then the sum),
  # the fused one once: closer, and within one rounding of the other.
  _, codes, scales, rstd, _ = norm_reference.rms_norm_fp8_fwd(
      x, scale, 1e-5, scale_dtype=jnp.float8_e8m0fnu)
  dnorm = np.asarray(norm_reference.rms_norm_fp8_bwd(
      codes, scales, rstd, scale, g_y.astype(jnp.float32))[0])
  exact = dnorm + np.asarray(g_x, np.float32)
  dx32, dx_sep32 = (np.asarray(a, np.float32) for a in (dx, dx_sep))
  assert np.isfinite(dx32).all() and dx.dtype == jnp.bfloat16
  assert (np.abs(dx32 - exact) <= 2**-8 * np.abs(exact) + 1e-6).all()
  assert (np.abs(dx32 - dx_sep32)
          <= 2**-7 * (np.abs(dnorm) + np.abs(exact)) + 1e-6).all()
  assert np.abs(dx32 - exact).mean() < np.abs(dx_sep32 - exact).mean()


@pytest.mark.parametrize('implementation', ['xla', 'pallas'])
def test_grad_amax_slot_cotangent_is_max_abs_dx(implementation, pick_pallas,
                                               seed):
  """The slot's cotangent is max |dx| of the dx returned (the residual
  stream's gradient included), NaN if dx holds NaN; dx is the one without
  a slot. Here the jnp reference, or the kernel interpreted, runs as XLA
  fusions, which may contract float32 products into FMAs in one program
  and not in the other (dx within one bfloat16 step) and take the max
  before rounding dx to bfloat16 (xla_allow_excess_precision: within half
  a step); the compiled kernel's max is exact
  (tests/kernels/rms_norm_fp8_test.py)."""
  x, scale, g_x, g_y = _with_input_case(implementation, pick_pallas, seed)
  slot = jnp.zeros((), jnp.float32)
  cases = [
      (lambda x, s: norm_lib.fp8_rms_norm_with_input(x, scale,
                                                     grad_amax_slot=s),
       lambda x: norm_lib.fp8_rms_norm_with_input(x, scale),
       lambda g: (g_x, g, jnp.float32(0))),
      (lambda x, s: cnn.fp8_rms_norm(x, scale, grad_amax_slot=s),
       lambda x: cnn.fp8_rms_norm(x, scale), lambda g: g)]
  for with_slot, without, cotangent in cases:
    vjp = jax.jit(lambda x, s, g, f=with_slot, c=cotangent: jax.vjp(
        f, x, s)[1](c(g)))
    dx, dslot = (np.asarray(a, np.float32) for a in vjp(x, slot, g_y))
    dx0 = np.asarray(jax.jit(lambda x, g, f=without, c=cotangent: jax.vjp(
        f, x)[1](c(g))[0])(x, g_y), np.float32)
    # A bfloat16 step is at most 2^-7 of the value, half a step 2^-8.
    assert (np.abs(dx - dx0) <= 2.0**-7 * np.abs(dx0)).all()
    assert dslot.dtype == np.float32 and dslot.shape == ()
    amax = float(np.abs(dx).max())
    assert abs(float(dslot) - amax) <= amax * 2.0**-8 and amax > 0, (
        float(dslot), amax)
    nan_g = g_y.at[1, 3, 5].set(jnp.nan)
    assert np.isnan(float(vjp(x, slot, nan_g)[1]))


def test_grad_amax_slot_errors_name_the_setting():
  x = jnp.ones((3, 64), jnp.bfloat16)
  slot = jnp.zeros((), jnp.float32)
  with pytest.raises(ValueError, match="grad_amax_slot needs a recipe"):
    cnn.CoatRMSNorm(64, recipe='bf16', rngs=nnx.Rngs(0))(
        x, grad_amax_slot=slot)
  with pytest.raises(ValueError, match="grad_amax_slot needs a recipe"):
    cnn.CoatRMSNorm(64, recipe='coat', rngs=nnx.Rngs(0)).with_input(
        x.astype(jnp.float32), grad_amax_slot=slot)
  with pytest.raises(ValueError, match='float32 scalar slot'):
    cnn.fp8_rms_norm(x, jnp.ones((64,)), grad_amax_slot=jnp.zeros((1,)))


@pytest.mark.parametrize('precision', ['bf16', 'coat'])
def test_with_input_module(precision, seed):
  norm = cnn.CoatRMSNorm(64, recipe=precision, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(seed), (3, 5, 64), jnp.bfloat16)
  x_out, y, y_amax = nnx.jit(lambda m, x: m.with_input(x))(norm, x)
  np.testing.assert_array_equal(x_out, x)
  np.testing.assert_array_equal(y, nnx.jit(lambda m, x: m(x))(norm, x))
  if precision == 'bf16':
    assert y_amax is None
  else:  # the next GEMM's x_amax: max |y| exactly
    assert y_amax.dtype == jnp.float32
    np.testing.assert_array_equal(y_amax,
                                  np.abs(np.asarray(y, np.float32)).max())


@pytest.mark.parametrize('precision', ['bf16', 'coat'])
def test_module(precision, seed):
  norm = cnn.CoatRMSNorm(64, recipe=precision, scale_axes=('norm',),
                         rngs=nnx.Rngs(0))
  assert norm.scale.shape == (64,) and norm.scale.dtype == jnp.float32
  assert norm.scale.get_metadata()['out_sharding'] == ('norm',)
  x = jax.random.normal(jax.random.key(seed), (3, 5, 64), jnp.bfloat16)
  y = nnx.jit(lambda m, x: m(x))(norm, x)
  assert y.dtype == jnp.bfloat16
  assert _rel(y, _ref(x, 1.0)) < 2**-7


def test_errors():
  with pytest.raises(ValueError, match='num_features=40 must be a multiple'):
    cnn.CoatRMSNorm(40, recipe='coat', rngs=nnx.Rngs(0))
  cnn.CoatRMSNorm(40, recipe='fp8_linear', rngs=nnx.Rngs(0))  # BF16 norm
  with pytest.raises(ValueError, match=r'x.shape\[-1\]=40'):
    cnn.fp8_rms_norm(jnp.ones((2, 40)), jnp.ones((40,)))
  with pytest.raises(ValueError, match='scale has shape'):
    cnn.fp8_rms_norm(jnp.ones((2, 32)), jnp.ones((16,)))
  with pytest.raises(TypeError, match='floating'):
    cnn.fp8_rms_norm(jnp.ones((2, 32), jnp.int32), jnp.ones((32,)))
