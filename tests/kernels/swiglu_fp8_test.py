"""The FP8 SwiGLU kernels against their reference.

Elementwise with per-group and per-program maxima: interpreted on CPU, both
kernels give the reference's bits (h, codes, scales, dgate, dup and the
three amax). `gpu` tests compile them on a Hopper GPU against the reference
compiled by XLA there: codes and scales bit for bit; h, dgate, dup and the
amax within one ulp of their dtype (Triton's exp is not XLA's).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.quantize_per_group import reference as group_reference
from pallas_kernels.swiglu_fp8 import api
from pallas_kernels.swiglu_fp8 import pallas_triton
from pallas_kernels.swiglu_fp8 import reference

F32_EPS = float(np.finfo(np.float32).eps)


def _data(shape, dtype=jnp.bfloat16, seed=0, specials=False,
          nonfinite=False, mag=1.0):
  """Random values of varied magnitude (times `mag`); with `specials`
  all-zero, constant and +-max groups; with `nonfinite` a NaN and Infs."""
  rng = np.random.default_rng(seed)
  x = (mag * rng.standard_normal(shape)
       * np.exp(rng.uniform(-6, 3, shape))).astype(np.float32)
  flat = x.reshape(-1, shape[-1])
  if specials:
    flat[1] = 0.0
    flat[2, :16] = -3.0
    flat[3, :16:2] = float(jnp.finfo(dtype).max)
    flat[3, 1:16:2] = -float(jnp.finfo(dtype).max)
  if nonfinite:
    flat[4, 5] = np.nan
    flat[5, -1] = np.inf
    flat[6, 0] = -np.inf
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


def _assert_ulp(a, b, mag, what=''):
  """Within one ulp of the dtype plus 16 float32 ulp of `mag`, the
  magnitude of the terms (so that a sigmoid or 1 + g (1 - s) rounded
  differently near 0 is allowed for); NaN and Inf where b has them."""
  assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape)
  a32, b32 = _f32(a).astype(np.float64), _f32(b).astype(np.float64)
  nan = np.isnan(b32)
  np.testing.assert_array_equal(np.isnan(a32), nan, err_msg=what)
  inf = np.isinf(b32)
  np.testing.assert_array_equal(a32[inf], b32[inf], err_msg=what)
  ok = ~(nan | inf)
  tol = (float(jnp.finfo(b.dtype).eps) * np.abs(b32[ok])
         + 16 * F32_EPS * np.broadcast_to(mag, b32.shape)[ok])
  err = np.abs(a32[ok] - b32[ok])
  assert (err <= tol).all(), (what, int((err > tol).sum()))


def _magnitudes(gate, up, gate_groups, up_groups, dh):
  """|gate up|, |dh g|, |dh u| (1 + |g|): bounds of the terms of h, dup and
  dgate (sigmoid in [0, 1]; g, u: the dequantized groups), in float64."""
  g, u = (_f32(group_reference.dequantize_per_group(*q, None, 16))
          .astype(np.float64) for q in (gate_groups, up_groups))
  d = _f32(dh).astype(np.float64)
  with np.errstate(invalid='ignore', over='ignore'):
    return (np.abs(_f32(gate).astype(np.float64) * _f32(up)),
            np.abs(d * g), np.abs(d * u) * (1 + np.abs(g)))


def _run(gate, up, dh, block_sizes=None, interpret=True,
         scale_dtype=jnp.bfloat16):
  kwargs = dict(interpret=interpret)
  if block_sizes is not None:
    kwargs['block_sizes'] = block_sizes
  ref = jax.jit(functools.partial(reference.swiglu_fp8_fwd,
                                  scale_dtype=scale_dtype))(gate, up)
  out = pallas_triton.swiglu_fp8_fwd(gate, up, scale_dtype=scale_dtype,
                                     **kwargs)
  dref = jax.jit(reference.swiglu_fp8_bwd)(ref[1], ref[2], dh)
  dout = pallas_triton.swiglu_fp8_bwd(ref[1], ref[2], dh, **kwargs)
  return jax.tree.leaves(ref), jax.tree.leaves(out), dref, dout


FWD = ('h', 'gate codes', 'gate scales', 'up codes', 'up scales', 'amax h')
BWD = ('dgate', 'dup', 'amax dgate', 'amax dup')


def _assert_matches(shape, dtype, seed=0, block_sizes=None,
                    scale_dtype=jnp.bfloat16, **kw):
  gate = _data(shape, dtype, seed, mag=4.0, **kw)
  up = _data(shape, dtype, seed + 1, **kw)
  dh = _data(shape, dtype, seed + 2)
  ref, out, dref, dout = _run(gate, up, dh, block_sizes,
                              scale_dtype=scale_dtype)
  for a, b, what in zip(out + list(dout), ref + list(dref), FWD + BWD):
    _assert_same(a, b, what)
  return ref, dref


# The layers' E8M0 scales travel through the kernels as their bytes.
SCALE_DTYPES = [jnp.bfloat16, jnp.float8_e8m0fnu]

CASES = [  # shape, dtype
    ((1, 16), jnp.bfloat16),
    ((37, 48), jnp.bfloat16),
    ((19, 2064), jnp.bfloat16),
    ((5, 5632), jnp.bfloat16),
    ((6, 80), jnp.float32),
    ((2, 3, 64), jnp.bfloat16),
]


@pytest.mark.parametrize('scale_dtype', SCALE_DTYPES)
@pytest.mark.parametrize('shape,dtype', CASES)
def test_kernels_match_reference(shape, dtype, scale_dtype):
  _assert_matches(shape, dtype, seed=1, scale_dtype=scale_dtype)


def test_many_tiles_partial_in_both_axes():
  _assert_matches((37, 80), jnp.bfloat16, seed=2,
                  block_sizes=pallas_triton.BlockSizes(block_rows=8,
                                                       block_cols=32))


@pytest.mark.parametrize('scale_dtype', SCALE_DTYPES)
def test_specials_and_nonfinite_stay_in_their_group(scale_dtype):
  ref, dref = _assert_matches((8, 48), jnp.bfloat16, seed=3, specials=True,
                              nonfinite=True, scale_dtype=scale_dtype)
  h, gate_codes, gate_scales, up_codes, up_scales, amax = ref
  dgate, dup, amax_dgate, amax_dup = dref
  assert np.isnan(float(amax))  # NaN never passes
  assert np.isnan(float(amax_dgate)) and np.isnan(float(amax_dup))
  np.testing.assert_array_equal(_f32(h)[1], 0.0)
  np.testing.assert_array_equal(_f32(gate_codes)[1], 0.0)
  # A group's max |x| codes to 448, or with E8M0 (the scale rounded up to
  # a power of two) to x / 2^ceil(log2(max |x| / 448)).
  top = lambda x: (448.0 if scale_dtype == jnp.bfloat16 else float(
      jnp.float8_e4m3fn(x / 2.0**np.ceil(np.log2(x / 448.0)))))
  np.testing.assert_array_equal(_f32(gate_codes)[2, :16], -top(3.0))
  np.testing.assert_array_equal(_f32(up_codes)[3, :16:2],
                                top(float(jnp.finfo(jnp.bfloat16).max)))
  # Non-finite inputs: a NaN scale for their group only, hence NaN
  # gradients in that group only (h: NaN where the product is).
  for scales in (gate_scales, up_scales):
    assert sorted(map(tuple, np.argwhere(np.isnan(_f32(scales))))) == [
        (4, 0), (5, 2), (6, 0)]
  groups = np.zeros((8, 48), bool)
  groups[4, :16] = groups[5, 32:] = groups[6, :16] = True
  # +-max gate times +-max up overflows float32: inf * 0 there, as in the
  # reference.
  groups[3, :16] = True
  for d in (dgate, dup):
    nan = np.isnan(_f32(d))
    assert nan.any() and not (nan & ~groups).any()
  # h: NaN for NaN and for -inf * sigmoid(-inf); inf * inf stays inf.
  assert sorted(map(tuple, np.argwhere(np.isnan(_f32(h))))) == [(4, 5),
                                                                (6, 0)]
  assert _f32(h)[5, -1] == np.inf


def test_amax_is_max_abs_of_outputs():
  gate = _data((20, 96), seed=4, mag=4.0)
  up = _data((20, 96), seed=5)
  h, _, _, amax = api.swiglu_fp8_fwd(gate, up, implementation='pallas')
  assert amax.dtype == jnp.float32 and amax.shape == ()
  assert float(amax) == float(np.abs(_f32(h)).max()) > 0
  _, g_groups, u_groups, _ = api.swiglu_fp8_fwd(gate, up)
  dh = _data((20, 96), seed=6)
  dgate, dup, amax_g, amax_u = api.swiglu_fp8_bwd(
      g_groups, u_groups, dh, implementation='pallas')
  assert float(amax_g) == float(np.abs(_f32(dgate)).max()) > 0
  assert float(amax_u) == float(np.abs(_f32(dup)).max()) > 0
  zeros = jnp.zeros((3, 32), jnp.bfloat16)
  assert float(api.swiglu_fp8_fwd(zeros, zeros,
                                  implementation='pallas')[-1]) == 0.0
  # One NaN in a large h: NaN (XLA's CPU max reduction alone would drop it).
  gate = _data((16, 2048), seed=18).at[9, 1000].set(jnp.nan)
  for impl in ('pallas', 'xla'):
    _, g_groups, u_groups, amax = api.swiglu_fp8_fwd(
        gate, gate, implementation=impl)
    assert np.isnan(float(amax)), impl
    assert all(np.isnan(float(a)) for a in api.swiglu_fp8_bwd(
        g_groups, u_groups, gate, implementation=impl)[2:]), impl


def test_dispatch_jit_and_bad_input():
  gate, up = _data((4, 32), seed=7), _data((4, 32), seed=8)
  ref = jax.tree.leaves(reference.swiglu_fp8_fwd(gate, up))
  for impl in ('xla', None):  # on CPU, None is the reference
    out = api.swiglu_fp8_fwd(gate, up, implementation=impl)
    for a, b in zip(jax.tree.leaves(out), ref):
      _assert_same(a, b)
  f = jax.jit(lambda g, u: api.swiglu_fp8_fwd(g, u, implementation='pallas'))
  for a, b in zip(jax.tree.leaves(f(gate, up)), jax.tree.leaves(
      jax.jit(reference.swiglu_fp8_fwd)(gate, up))):
    _assert_same(a, b)
  empty = api.swiglu_fp8_fwd(gate[:0], up[:0], implementation='pallas')
  assert empty[0].shape == (0, 32) and float(empty[-1]) == 0.0
  assert api.swiglu_fp8_bwd(*empty[1:3], gate[:0],
                            implementation='pallas')[0].shape == (0, 32)
  with pytest.raises(ValueError, match='implementation'):
    api.swiglu_fp8_fwd(gate, up, implementation='triton')
  with pytest.raises(ValueError, match='same shape and dtype'):
    api.swiglu_fp8_fwd(gate, up[:, :16])
  with pytest.raises(TypeError, match='floats'):
    api.swiglu_fp8_fwd(gate.astype(jnp.int32), up.astype(jnp.int32))
  with pytest.raises(ValueError, match='scale_dtype'):
    api.swiglu_fp8_fwd(gate, up, scale_dtype=jnp.float16)
  _, g_groups, u_groups, _ = reference.swiglu_fp8_fwd(gate, up)
  with pytest.raises(ValueError, match='up_groups'):
    api.swiglu_fp8_bwd(g_groups, (u_groups[0], u_groups[1][:, :1]), gate)


# ---------------------------------------------------------------- GPU ----

GPU_CASES = [  # shape, dtype
    ((37, 2064), jnp.bfloat16),
    ((4096, 5632), jnp.bfloat16),  # 1b intermediate
    ((2048, 11008), jnp.bfloat16),  # 7B intermediate
    ((1000, 48), jnp.float32),
]


@pytest.mark.gpu
@pytest.mark.parametrize('scale_dtype', SCALE_DTYPES)
@pytest.mark.parametrize('shape,dtype', GPU_CASES)
def test_gpu_kernels_match_xla(shape, dtype, scale_dtype):
  kw = dict(specials=True, nonfinite=True)
  gate = _data(shape, dtype, 10, mag=4.0, **kw)
  up = _data(shape, dtype, 11, **kw)
  dh = _data(shape, dtype, 12)
  ref, out, dref, dout = _run(gate, up, dh, interpret=False,
                              scale_dtype=scale_dtype)
  for i in (1, 2, 3, 4):
    _assert_same(out[i], ref[i], FWD[i])
  differ = lambda a, b: int(((_f32(a) != _f32(b))
                              & ~np.isnan(_f32(b))).sum())
  print(f'\n{shape} {np.dtype(dtype).name}: h differing'
        f' {differ(out[0], ref[0])}, dgate {differ(dout[0], dref[0])}, dup'
        f' {differ(dout[1], dref[1])} of {gate.size}')
  mag_h, mag_dup, mag_dgate = _magnitudes(gate, up, ref[1:3], ref[3:5], dh)
  for a, b, mag, what in ((out[0], ref[0], mag_h, 'h'),
                          (dout[0], dref[0], mag_dgate, 'dgate'),
                          (dout[1], dref[1], mag_dup, 'dup')):
    _assert_ulp(a, b, mag, what)
  for a in (out[5], dout[2], dout[3]):
    assert np.isnan(float(a))
  # Finite inputs: the amax within an ulp.
  gate, up = _data(shape, dtype, 13, mag=4.0), _data(shape, dtype, 14)
  ref, out, dref, dout = _run(gate, up, dh, interpret=False,
                              scale_dtype=scale_dtype)
  for a, b, what in ((out[5], ref[5], 'amax h'),
                     (dout[2], dref[2], 'amax dgate'),
                     (dout[3], dref[3], 'amax dup')):
    np.testing.assert_allclose(float(a), float(b), err_msg=what,
                               rtol=float(jnp.finfo(dtype).eps))


def test_fp8_swiglu_gradients_through_the_kernels(pick_pallas):
  """coat_jax.nn's fp8_swiglu under jit(grad) with the kernels picked (as
  on one Hopper GPU; interpreted here), with the layers' E8M0 scales: the
  reference's bits."""
  from coat_jax.nn import activations  # pylint: disable=g-import-not-at-top
  gate, up = _data((2, 3, 48), seed=15, mag=4.0), _data((2, 3, 48), seed=16)
  w = _data((2, 3, 48), seed=17)
  loss = lambda g, u: jnp.sum(
      (activations.fp8_swiglu(g, u) * w).astype(jnp.float32))
  f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  ref = f(gate, up)
  pick_pallas()
  f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  assert 'swiglu_fp8_bwd' in str(jax.make_jaxpr(f)(gate, up))
  for a, b in zip(jax.tree.leaves(f(gate, up)), jax.tree.leaves(ref)):
    _assert_same(a, b)
