"""The FP8 RMSNorm kernels against their reference.

Interpreted on CPU, the forward kernel gives the reference's bits (y, codes,
scales, rstd, amax). The backward sums in another order (rows padded to a
power of two; dscale per program, then over programs), so dx and dscale are
held to float32 rounding bounds computed from the inputs. `gpu` tests
compile the kernels on a Hopper GPU against the reference compiled by XLA
there: codes and scales bit for bit, the rest to stated tolerances.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _common
from pallas_kernels.quantize_per_group import reference as group_reference
from pallas_kernels.rms_norm_fp8 import api
from pallas_kernels.rms_norm_fp8 import pallas_triton
from pallas_kernels.rms_norm_fp8 import reference

EPS = 1e-5
F32_EPS = float(np.finfo(np.float32).eps)


def _data(shape, dtype=jnp.bfloat16, seed=0, specials=False,
          nonfinite=False):
  """Random rows of varied magnitude; with `specials` an all-zero row,
  constant groups and +-max rows; with `nonfinite` a NaN and an Inf."""
  rng = np.random.default_rng(seed)
  x = (rng.standard_normal(shape)
       * np.exp(rng.uniform(-4, 4, shape[:-1] + (1,)))).astype(np.float32)
  flat = x.reshape(-1, shape[-1])
  if specials:
    flat[1] = 0.0
    flat[2, :16] = 3.0
    flat[3, ::2] = float(jnp.finfo(dtype).max)
    flat[3, 1::2] = -float(jnp.finfo(dtype).max)
  if nonfinite:
    flat[4, 5] = np.nan
    flat[5, -1] = np.inf
  return jnp.asarray(x).astype(dtype)


def _f32(a):
  return np.asarray(jnp.asarray(a).astype(jnp.float32))


def _assert_same(a, b, what=''):
  """Same shape, dtype and bits; NaNs only need to be NaN in both."""
  assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape,
                                                     a.dtype, b.dtype)
  a32, b32 = _f32(a), _f32(b)
  np.testing.assert_array_equal(np.isnan(a32), np.isnan(b32), err_msg=what)
  np.testing.assert_array_equal(np.where(np.isnan(a32), 0, a32).view(np.int32),
                                np.where(np.isnan(b32), 0, b32).view(np.int32),
                                err_msg=what)


def _assert_close(a, b, atol, what=''):
  """|a - b| <= atol elementwise (broadcast), NaN exactly where b has NaN."""
  assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape)
  a32, b32 = _f32(a).astype(np.float64), _f32(b).astype(np.float64)
  nan = np.isnan(b32)
  np.testing.assert_array_equal(np.isnan(a32), nan, err_msg=what)
  err = np.abs(np.where(nan, 0, a32 - b32))
  bound = np.broadcast_to(np.where(nan, 0, atol), err.shape)
  assert (err <= bound).all(), (what, float((err / (bound + 1e-300)).max()))


@np.errstate(invalid='ignore', over='ignore')
def _bwd_bounds(codes, scales, rstd, scale, g, out_dtype):
  """Bounds on |dx - dx_ref| and |dscale - dscale_ref| from the summation
  order: 8 ulp of float32 per term magnitude, plus one ulp of dx's dtype.
  Rows holding NaN or Inf get NaN bounds, which `_assert_close` skips."""
  x = _f32(group_reference.dequantize_per_group(codes, scales, None, 16))
  x_hat = x.astype(np.float64) * _f32(rstd)
  gf = _f32(g).astype(np.float64)
  g_hat = gf * _f32(scale)
  n = x.shape[-1]
  mean_terms = np.abs(g_hat * x_hat).sum(-1, keepdims=True) / n
  sum_err = 8 * F32_EPS * np.sqrt(n) * mean_terms
  dx_mag = _f32(rstd) * (np.abs(g_hat) + np.abs(x_hat) * mean_terms)
  ulp = float(jnp.finfo(out_dtype).eps)
  dx_tol = (_f32(rstd) * np.abs(x_hat) * sum_err + 4 * F32_EPS * dx_mag
            + ulp * dx_mag)
  terms = np.abs(gf * x_hat).reshape(-1, n)
  ds_tol = 8 * F32_EPS * np.sqrt(terms.shape[0]) * terms.sum(0) + 1e-30
  return dx_tol, ds_tol


def _check(x, scale, block_sizes=None, interpret=True,
           scale_dtype=jnp.bfloat16, residual_grad=None):
  """Forward and backward of the kernels against the reference."""
  kwargs = dict(interpret=interpret)
  if block_sizes is not None:
    kwargs['block_sizes'] = block_sizes
  ref = jax.jit(lambda x, s: reference.rms_norm_fp8_fwd(
      x, s, EPS, scale_dtype=scale_dtype))(x, scale)
  out = pallas_triton.rms_norm_fp8_fwd(x, scale, EPS, scale_dtype=scale_dtype,
                                       **kwargs)
  g = _data(x.shape, x.dtype, seed=11)
  dref = jax.jit(reference.rms_norm_fp8_bwd)(*ref[1:4], scale, g,
                                             residual_grad=residual_grad)
  dout = pallas_triton.rms_norm_fp8_bwd(*ref[1:4], scale, g,
                                        residual_grad=residual_grad, **kwargs)
  return ref, out, g, dref, dout


def _residual_tol(residual_grad):
  """What adding residual_grad in float32 before rounding adds to the dx
  bound: its own rounding to dx's dtype, and float32's."""
  if residual_grad is None:
    return 0.0
  r = np.abs(_f32(residual_grad))
  return (float(jnp.finfo(residual_grad.dtype).eps) + F32_EPS) * r


def _assert_forward(out, ref, exact):
  """codes and scales the same bits; y, rstd, amax too if `exact`, else
  rstd within the rounding of a sum of H squares in another order (and
  2 ulp of rsqrt), y and amax within that plus one ulp of y's dtype."""
  for i, what in ((1, 'codes'), (2, 'scales')):
    _assert_same(out[i], ref[i], what)
  if exact:
    for i, what in ((0, 'y'), (3, 'rstd'), (4, 'amax')):
      _assert_same(out[i], ref[i], what)
    return
  rstd_rel = F32_EPS * (2 + 4 * np.sqrt(ref[0].shape[-1]))
  _assert_close(out[3], ref[3], rstd_rel * np.abs(_f32(ref[3])), 'rstd')
  tol = (float(jnp.finfo(ref[0].dtype).eps) + rstd_rel + 4 * F32_EPS) * (
      np.abs(_f32(ref[0])))
  _assert_close(out[0], ref[0], tol, 'y')
  _assert_close(out[4], ref[4], tol.max(initial=0.0), 'amax')


def _assert_matches(x, scale, block_sizes=None, scale_dtype=jnp.bfloat16,
                    residual_grad=None):
  """Interpreted: the reference's bits where the arithmetic is the same
  (the row sums are when H is a power of two: no padded lanes)."""
  ref, out, g, dref, dout = _check(x, scale, block_sizes,
                                   scale_dtype=scale_dtype,
                                   residual_grad=residual_grad)
  h = x.shape[-1]
  _assert_forward(out, ref, exact=h & (h - 1) == 0)
  dx_tol, ds_tol = _bwd_bounds(*ref[1:4], scale, g, g.dtype)
  _assert_close(dout[0], dref[0], dx_tol + _residual_tol(residual_grad),
                'dx')
  _assert_close(dout[1], dref[1], ds_tol, 'dscale')
  # max |dx| of the dx each returns: the same bits as an XLA pass over it.
  for d, what in ((dout, 'kernel'), (dref, 'reference')):
    _assert_same(d[2], _common.tensor_abs_max(d[0]), f'amax |dx| {what}')
  return ref, dout


# The layers' E8M0 scales travel through the kernels as their bytes.
SCALE_DTYPES = [jnp.bfloat16, jnp.float8_e8m0fnu]

CASES = [  # shape, dtype
    ((1, 16), jnp.bfloat16),
    ((37, 48), jnp.bfloat16),
    ((19, 2064), jnp.bfloat16),
    ((6, 5632), jnp.float32),
    ((2, 3, 64), jnp.bfloat16),
]


@pytest.mark.parametrize('scale_dtype', SCALE_DTYPES)
@pytest.mark.parametrize('shape,dtype', CASES)
def test_kernels_match_reference(shape, dtype, scale_dtype):
  x = _data(shape, dtype, seed=1)
  scale = jnp.asarray(np.random.default_rng(2).uniform(
      -2, 2, shape[-1]).astype(np.float32))
  _assert_matches(x, scale, scale_dtype=scale_dtype)


@pytest.mark.parametrize('shape,dtype', CASES)
def test_backward_adds_the_residual_gradient(shape, dtype):
  """residual_grad is added to dx: the reference's dx + residual_grad
  (within the bounds), and the reference itself is dx + residual_grad
  summed in float32 and rounded once."""
  x = _data(shape, dtype, seed=21)
  scale = jnp.asarray(np.random.default_rng(22).uniform(
      -2, 2, shape[-1]).astype(np.float32))
  r = _data(shape, dtype, seed=23)
  _assert_matches(x, scale, scale_dtype=jnp.float8_e8m0fnu, residual_grad=r)
  _, codes, scales, rstd, _ = reference.rms_norm_fp8_fwd(
      x, scale, EPS, scale_dtype=jnp.float8_e8m0fnu)
  g = _data(shape, dtype, seed=24)
  dx, dscale, _ = jax.jit(lambda g, r: reference.rms_norm_fp8_bwd(
      codes, scales, rstd, scale, g, residual_grad=r))(g, r)
  dx32 = jax.jit(lambda g: reference.rms_norm_fp8_bwd(
      codes, scales, rstd, scale, g.astype(jnp.float32))[0])(g)
  expect = np.asarray(dx32, np.float32) + _f32(r)
  if dtype == jnp.bfloat16:  # one rounding to bfloat16, of the float32 sum
    _assert_same(dx, jnp.asarray(expect).astype(dtype), 'dx + residual')
  else:  # XLA's float32 fusions may contract to FMAs: a few ulps
    np.testing.assert_allclose(_f32(dx), expect, rtol=1e-6,
                               atol=1e-6 * np.abs(expect).max())
  _assert_same(dscale, jax.jit(lambda g: reference.rms_norm_fp8_bwd(
      codes, scales, rstd, scale, g)[1])(g), 'dscale')


def test_several_programs_and_steps_with_a_partial_last_block():
  """block_rows 4 x 3 steps over 37 rows: 4 programs, the last one partial
  (its third block lies past the view)."""
  x = _data((37, 48), seed=3, specials=True)
  scale = jnp.linspace(-1.5, 2.0, 48, dtype=jnp.float32)
  _assert_matches(x, scale, pallas_triton.BlockSizes(block_rows=4, steps=3))
  _assert_matches(x[:36], scale,
                  pallas_triton.BlockSizes(block_rows=4, steps=3))
  _assert_matches(x, scale, pallas_triton.BlockSizes(block_rows=4, steps=3),
                  residual_grad=_data((37, 48), seed=25))


def test_backward_default_leaves_about_512_programs():
  """8 to 32 blocks of 2048 elements per program (RESULTS.md
  "kernels-fused": fewer dscale rows to sum, enough programs to fill the
  GPU)."""
  sizes = pallas_triton.bwd_block_sizes
  assert sizes(16384, 2048) == pallas_triton.BlockSizes(1, 32, 8)
  assert sizes(32768, 4096) == pallas_triton.BlockSizes(1, 32, 16)
  assert sizes(8192, 2048) == pallas_triton.BlockSizes(1, 16, 8)
  assert sizes(2048, 2048) == pallas_triton.BlockSizes(1, 8, 8)
  assert sizes(16384, 512) == pallas_triton.BlockSizes(4, 8, 8)
  assert sizes(16384, 48) == pallas_triton.BlockSizes(32, 8, 8)


def test_a_nan_residual_gradient_reaches_dx():
  x = _data((8, 48), seed=26)
  scale = jnp.ones((48,), jnp.float32)
  _, codes, scales, rstd, _ = reference.rms_norm_fp8_fwd(x, scale, EPS)
  g = _data((8, 48), seed=27)
  r = jnp.zeros_like(g).at[3, 7].set(jnp.nan)
  for impl in ('pallas', 'xla'):
    dx, _, dx_amax = api.rms_norm_fp8_bwd(codes, scales, rstd, scale, g,
                                          residual_grad=r,
                                          implementation=impl)
    nan = np.isnan(_f32(dx))
    assert nan[3, 7] and nan.sum() == 1, impl
    assert np.isnan(float(dx_amax)), impl


@pytest.mark.parametrize('scale_dtype', SCALE_DTYPES)
def test_specials_and_nonfinite_stay_in_their_row_and_group(scale_dtype):
  x = _data((8, 48), seed=4, specials=True, nonfinite=True)
  scale = jnp.ones((48,), jnp.float32)
  ref, dout = _assert_matches(x, scale, scale_dtype=scale_dtype)
  y, codes, scales, rstd, amax = ref
  assert np.isnan(float(amax))  # NaN never passes
  bad_rows = {4, 5}
  assert set(np.nonzero(np.isnan(_f32(y)).any(1))[0]) == bad_rows
  np.testing.assert_array_equal(_f32(y)[1], 0.0)  # all-zero row
  # +-max: x^2 overflows, rstd is 0 and y 0, as in the reference.
  np.testing.assert_array_equal(_f32(y)[3], 0.0)
  nan_groups = np.argwhere(np.isnan(_f32(scales)))
  assert sorted(map(tuple, nan_groups)) == [(4, 0), (5, 2)]
  np.testing.assert_array_equal(_f32(codes)[1], 0.0)
  # A constant group codes to 448, or with E8M0 (the scale rounded up to a
  # power of two) to x / 2^ceil(log2(x / 448)).
  x2 = float(_f32(x)[2, 0])
  top = 448.0 if scale_dtype == jnp.bfloat16 else float(jnp.float8_e4m3fn(
      x2 / 2.0**np.ceil(np.log2(x2 / 448.0))))
  np.testing.assert_array_equal(_f32(codes)[2, :16], top)  # constant
  # With E8M0 the +-max row's code rounds up (255 -> 256 x 2^120) and
  # dequantizes to +-inf, so its dx is NaN too (the reference's as well).
  if scale_dtype != jnp.bfloat16:
    bad_rows = bad_rows | {3}
  assert set(np.nonzero(np.isnan(_f32(dout[0])).any(1))[0]) <= bad_rows
  good_rows = sorted(set(range(8)) - bad_rows)
  assert not np.isnan(_f32(dout[0])[good_rows]).any()
  # rstd of the NaN row is NaN, so every column of dscale is NaN (as in the
  # reference: NaN never passes).
  assert np.isnan(_f32(rstd)[4]) and np.isnan(_f32(dout[1])).all()


def test_amax_is_max_abs_y():
  x = _data((20, 80), seed=5)
  scale = jnp.full((80,), -3.0, jnp.float32)
  y, *_, amax = api.rms_norm_fp8_fwd(x, scale, implementation='pallas')
  assert amax.dtype == jnp.float32 and amax.shape == ()
  assert float(amax) == float(np.abs(_f32(y)).max()) > 0
  zero = api.rms_norm_fp8_fwd(jnp.zeros((3, 32)), scale[:32],
                              implementation='pallas')
  assert float(zero[-1]) == 0.0
  # One NaN in a large y: NaN (XLA's CPU max reduction alone would drop it).
  x = _data((16, 2048), seed=14).at[9, 1000].set(jnp.nan)
  scale = jnp.ones((2048,), jnp.float32)
  for impl in ('pallas', 'xla'):
    assert np.isnan(float(api.rms_norm_fp8_fwd(
        x, scale, implementation=impl)[-1])), impl


def test_dispatch_jit_and_bad_input():
  x = _data((4, 32), seed=6)
  scale = jnp.ones((32,), jnp.float32)
  ref = reference.rms_norm_fp8_fwd(x, scale, EPS)
  for impl in ('xla', None):  # on CPU, None is the reference
    for a, b in zip(api.rms_norm_fp8_fwd(x, scale, implementation=impl), ref):
      _assert_same(a, b)
  f = jax.jit(lambda x, s: api.rms_norm_fp8_fwd(x, s, implementation='pallas'))
  for a, b in zip(f(x, scale), jax.jit(
      lambda x, s: reference.rms_norm_fp8_fwd(x, s, EPS))(x, scale)):
    _assert_same(a, b)
  empty = api.rms_norm_fp8_fwd(x[:0], scale, implementation='pallas')
  assert empty[0].shape == (0, 32) and float(empty[-1]) == 0.0
  empty_bwd = api.rms_norm_fp8_bwd(*empty[1:4], scale, x[:0],
                                   implementation='pallas')
  assert empty_bwd[1].shape == (32,) and float(empty_bwd[2]) == 0.0
  with pytest.raises(ValueError, match='implementation'):
    api.rms_norm_fp8_fwd(x, scale, implementation='triton')
  with pytest.raises(ValueError, match='scale has shape'):
    api.rms_norm_fp8_fwd(x, scale[:16])
  with pytest.raises(TypeError, match='floating'):
    api.rms_norm_fp8_fwd(x.astype(jnp.int32), scale)
  with pytest.raises(ValueError, match='group_size'):
    api.rms_norm_fp8_fwd(x, scale, group_size=0)
  with pytest.raises(ValueError, match='forward outputs'):
    api.rms_norm_fp8_bwd(ref[1], ref[2][:, :1], ref[3], scale, x)
  with pytest.raises(ValueError, match='residual_grad'):
    api.rms_norm_fp8_bwd(*ref[1:4], scale, x, residual_grad=x[:2])
  with pytest.raises(ValueError, match='residual_grad'):
    api.rms_norm_fp8_bwd(*ref[1:4], scale, x,
                         residual_grad=x.astype(jnp.float32))


# ---------------------------------------------------------------- GPU ----

GPU_CASES = [  # shape, dtype
    ((37, 2064), jnp.bfloat16),
    ((4096, 2048), jnp.bfloat16),  # 1b hidden
    ((16384, 2048), jnp.bfloat16),  # 1b, batch 8: 32 blocks per program
    ((2048, 4096), jnp.bfloat16),  # 7B hidden
    ((1000, 5632), jnp.float32),
]


@pytest.mark.gpu
@pytest.mark.parametrize('scale_dtype', SCALE_DTYPES)
@pytest.mark.parametrize('shape,dtype', GPU_CASES)
def test_gpu_kernels_match_xla(shape, dtype, scale_dtype):
  """Compiled kernels against the reference compiled by XLA (see
  `_assert_forward`; dx and dscale within the summation bounds)."""
  x = _data(shape, dtype, seed=7, specials=True, nonfinite=True)
  scale = jnp.asarray(np.random.default_rng(8).uniform(
      -2, 2, shape[-1]).astype(np.float32))
  r = _data(shape, dtype, seed=10)
  ref, out, g, dref, dout = _check(x, scale, interpret=False,
                                   scale_dtype=scale_dtype)
  _, _, _, dref_r, dout_r = _check(x, scale, interpret=False,
                                   scale_dtype=scale_dtype, residual_grad=r)
  _assert_forward(out, ref, exact=False)
  assert np.isnan(float(out[4])) and np.isnan(float(ref[4]))
  clean = _data(shape, dtype, seed=9)
  _assert_forward(
      pallas_triton.rms_norm_fp8_fwd(clean, scale, EPS,
                                     scale_dtype=scale_dtype),
      reference.rms_norm_fp8_fwd(clean, scale, EPS, scale_dtype=scale_dtype),
      exact=False)
  dx_tol, ds_tol = _bwd_bounds(*ref[1:4], scale, g, g.dtype)
  differ = lambda a, b: int(((_f32(a) != _f32(b))
                              & ~np.isnan(_f32(b))).sum())
  print(f'\n{shape} {np.dtype(dtype).name}: y differing'
        f' {differ(out[0], ref[0])} / {x.size}, dx'
        f' {differ(dout[0], dref[0])}')
  _assert_close(dout[0], dref[0], dx_tol, 'dx')
  _assert_close(dout[1], dref[1], ds_tol, 'dscale')
  _assert_close(dout_r[0], dref_r[0], dx_tol + _residual_tol(r),
                'dx + residual_grad')
  _assert_close(dout_r[1], dref_r[1], ds_tol, 'dscale with residual_grad')
  for d in (dout, dout_r):  # NaN here: the inputs hold NaN
    _assert_same(d[2], _common.tensor_abs_max(d[0]), 'amax |dx|')
  clean_bwd = _check(clean, scale, interpret=False, scale_dtype=scale_dtype,
                     residual_grad=r)[4]
  amax = float(clean_bwd[2])
  assert 0 < amax == float(np.abs(_f32(clean_bwd[0])).max()), amax


def test_fp8_rms_norm_layer_gradients_through_the_kernels(pick_pallas):
  """coat_jax.nn's fp8_rms_norm under jit(grad) with the kernels picked (as
  on one Hopper GPU; interpreted here), with the layers' E8M0 scales: the
  reference's y and gradients."""
  from coat_jax.nn import norm  # pylint: disable=g-import-not-at-top
  x = _data((2, 5, 64), jnp.float32, seed=12)
  scale = jnp.linspace(0.5, 1.5, 64, dtype=jnp.float32)
  w = _data((2, 5, 64), jnp.float32, seed=13)
  loss = lambda x, s: jnp.sum(norm.fp8_rms_norm(x, s) * w)
  f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  ref = f(x, scale)
  pick_pallas()
  f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  assert 'rms_norm_fp8_bwd' in str(jax.make_jaxpr(f)(x, scale))
  (value, (dx, dscale)), (value_ref, (dx_ref, dscale_ref)) = f(x, scale), ref
  np.testing.assert_allclose(value, value_ref, rtol=1e-6)
  np.testing.assert_allclose(dx, dx_ref, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(dscale, dscale_ref, rtol=1e-5, atol=1e-5)
