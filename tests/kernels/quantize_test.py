"""Quantize kernels against their references.

On CPU the Pallas kernels run in interpret mode and must match the jnp
reference bit for bit (NaN compared as NaN). `gpu` tests compile them on a
Hopper GPU and hold them to the same bits as the reference compiled by XLA
there (the kernels use Triton's own division, which rounds as XLA's does).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coat_jax import quant
from pallas_kernels import _common
from pallas_kernels.quantize_per_group import api as group_api
from pallas_kernels.quantize_per_group import reference as group_ref
from pallas_kernels.quantize_per_tensor import api as tensor_api
from pallas_kernels.quantize_per_tensor import reference as tensor_ref


def _data(shape, seed=0, specials=True, nonfinite=False):
  rng = np.random.default_rng(seed)
  x = (rng.standard_normal(shape)
       * np.exp(rng.uniform(-12, 6, shape))).astype(np.float32)
  if specials and x.ndim == 2 and x.shape[0] >= 3:
    x[1] = 0.0  # all-zero groups
    x[2] = 3.0  # constant groups
  if specials and x.size >= 24:
    flat = x.reshape(-1)
    flat[[0, 1, 2, 3, 4, 5, 6]] = [0.0, -0.0, 448.0, -448.0, 465.0,
                                   2.0**-9, -(2.0**-16)]
    flat[7:12] = np.float32(2.0**-140)  # float32 subnormals
    if nonfinite:
      flat[[13, 17, 21]] = [np.nan, np.inf, -np.inf]
  return jnp.asarray(x)


def _codes(a):
  return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8)).astype(int)


def _assert_same(a, b, what=''):
  """Bitwise equality; NaNs only need to be NaN in both."""
  a32 = np.asarray(jnp.asarray(a).astype(jnp.float32))
  b32 = np.asarray(jnp.asarray(b).astype(jnp.float32))
  assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape)
  nan = np.isnan(a32)
  np.testing.assert_array_equal(nan, np.isnan(b32), err_msg=what)
  a_bits = np.where(nan, 0, a32).view(np.int32)
  b_bits = np.where(nan, 0, b32).view(np.int32)
  np.testing.assert_array_equal(a_bits, b_bits, err_msg=what)


GROUP_CASES = [  # shape, group, format, expansion
    ((1, 1), 16, 'e4m3', False),
    ((1, 1), 128, 'e4m3', True),
    ((), 128, 'e4m3', True),
    ((3,), 16, 'e5m2', False),
    ((300,), 128, 'e4m3', True),
    ((5, 37), 16, 'e4m3', True),
    ((5, 37), 128, 'e5m2', True),
    ((7, 1), 128, 'e4m3', False),
    ((4, 256), 128, 'e4m3', True),
    ((4, 256), 16, 'e5m2', False),
    ((2, 3, 200), 16, 'e4m3', False),
    ((33, 130), 128, 'e5m2', False),
]


@pytest.mark.parametrize('shape,group,fmt,expansion', GROUP_CASES)
def test_group_kernel_matches_reference(shape, group, fmt, expansion):
  x = _data(shape, nonfinite=True)
  ref = jax.jit(lambda x: group_ref.quantize_per_group(
      x, group, fmt, expansion))(x)
  out = group_api.quantize_per_group(
      x, group, fmt, expansion, implementation='pallas')
  _assert_same_quantized(out, ref)
  deq_ref = jax.jit(lambda *a: group_ref.dequantize_per_group(*a, group))(
      *ref)
  deq = group_api.dequantize_per_group(*ref, group, implementation='pallas')
  _assert_same(deq, deq_ref, 'dequantize')


def _assert_same_quantized(out, ref):
  for a, b, what in zip(out, ref, ('values', 'scale', 'exponent')):
    assert (a is None) == (b is None), what
    if b is not None:
      _assert_same(a, b, what)


def test_group_bf16_input_and_scale():
  x = _data((6, 64), seed=3).astype(jnp.bfloat16)
  ref = jax.jit(lambda x: group_ref.quantize_per_group(
      x, 16, 'e4m3', scale_dtype=jnp.bfloat16))(x)
  out = group_api.quantize_per_group(
      x, 16, 'e4m3', scale_dtype=jnp.bfloat16, implementation='pallas')
  for a, b in zip(out[:2], ref[:2]):
    _assert_same(a, b)
  deq = group_api.dequantize_per_group(
      *out, 16, out_dtype=jnp.bfloat16, implementation='pallas')
  assert deq.dtype == jnp.bfloat16
  _assert_same(deq, group_ref.dequantize_per_group(
      *ref, 16, out_dtype=jnp.bfloat16))


@pytest.mark.parametrize('fmt', ['e4m3', 'e5m2'])
def test_group_e8m0_scales_are_powers_of_two_above_amax(fmt, seed):
  """E8M0 scales: the smallest power of two >= amax / fp8_max (>= 2^-126),
  so codes never clip and dequantize exactly; 1 for all-zero groups, NaN for
  groups with NaN or Inf; the Pallas kernels (E8M0 as bytes inside) give
  the same bits."""
  x = _data((6, 64), seed=seed, nonfinite=True)
  fmax = float(jnp.finfo(_common.fp8_dtype(fmt)).max)
  x = x.at[3, :16].set(fmax * 2.0**-5)  # amax / fp8_max an exact power
  e8m0 = jnp.float8_e8m0fnu
  values, scale, exponent = jax.jit(lambda x: group_ref.quantize_per_group(
      x, 16, fmt, scale_dtype=e8m0))(x)
  assert exponent is None and scale.dtype == e8m0 and scale.shape == (6, 4)
  groups = np.asarray(x, np.float64).reshape(6, 4, 16)
  amax = np.abs(groups).max(-1)
  s = np.asarray(scale.astype(jnp.float32), np.float64)
  finite = np.isfinite(amax)
  assert np.isnan(s[~finite]).all() and (~finite).any()
  assert (s[amax == 0] == 1).all() and (amax == 0).any()
  nz = finite & (amax > 0)
  want = np.maximum(2.0 ** np.ceil(np.log2(amax[nz] / fmax)), 2.0**-126)
  np.testing.assert_array_equal(s[nz], want)
  assert s[3, 0] == 2.0**-5
  codes = np.abs(np.asarray(values.astype(jnp.float32))).reshape(6, 4, 16)
  assert (codes.max(-1)[nz] <= fmax).all()
  assert (codes.max(-1)[nz & (amax >= 2.0**-110)] >= fmax / 2).all()
  deq = group_ref.dequantize_per_group(values, scale, None, 16)
  np.testing.assert_array_equal(  # dividing by a power of two is exact
      np.asarray(deq)[3, :16], np.asarray(x)[3, :16])
  out = group_api.quantize_per_group(x, 16, fmt, scale_dtype=e8m0,
                                     implementation='pallas')
  for a, b in zip(out[:2], (values, scale)):
    _assert_same(a, b)
  _assert_same(group_api.dequantize_per_group(*out, 16,
                                              implementation='pallas'), deq)


def test_group_e8m0_error_within_e4m3_and_no_expansion(seed):
  """E8M0 against bf16 scales on normal data, and expansion (which stores M
  itself) refuses E8M0 scales. Measured: 0.0264 against 0.0223 relative
  error (a bf16 scale maps each group's max to 448 exactly, a power of two
  maps it anywhere in [224, 448])."""
  x = jax.random.normal(jax.random.key(seed), (256, 1024)) * 3
  err = {}
  for sd in (jnp.bfloat16, jnp.float8_e8m0fnu):
    q = group_ref.quantize_per_group(x, 16, 'e4m3', scale_dtype=sd)
    deq = group_ref.dequantize_per_group(*q, 16)
    err[sd.dtype.name] = float(jnp.linalg.norm(deq - x) / jnp.linalg.norm(x))
  print('relative error, 1x16 E4M3 by scale dtype:', err)
  assert err['float8_e8m0fnu'] < 1.25 * err['bfloat16'] < 0.03
  with pytest.raises(ValueError, match='expansion'):
    group_api.quantize_per_group(x, 128, 'e4m3', expansion=True,
                                 scale_dtype=jnp.float8_e8m0fnu)
  with pytest.raises(ValueError, match='float8_e8m0fnu'):
    group_api.quantize_per_group(x, 16, scale_dtype=jnp.float16)


@pytest.mark.parametrize('expansion', [False, True])
def test_coat_jax_quant_dispatches_to_the_kernels(expansion):
  """coat_jax.quant's implementation= reaches the kernels, bit for bit."""
  x = _data((9, 256), seed=1, nonfinite=True)
  for fmt in ('e4m3', 'e5m2'):
    ref = quant.quantize_per_group(x, 128, fmt, expansion=expansion)
    out = quant.quantize_per_group(x, 128, fmt, expansion=expansion,
                                   implementation='pallas')
    _assert_same(out.values, ref.values)
    _assert_same(out.scale, ref.scale)
    # Compare jitted: XLA rounds eager and fused float math differently.
    _assert_same(
        jax.jit(lambda q: quant.dequantize(q, implementation='pallas'))(out),
        jax.jit(quant.dequantize)(ref))


def test_all_zero_and_constant_groups_are_exact():
  x = jnp.stack([jnp.zeros(256), jnp.full(256, -2.5), jnp.full(256, 1e-30)])
  for expansion in (False, True):
    out = group_api.quantize_per_group(
        x, 128, 'e4m3', expansion, implementation='pallas')
    deq = group_api.dequantize_per_group(*out, 128, implementation='pallas')
    np.testing.assert_array_equal(deq, x)
    assert np.all(np.isfinite(np.asarray(out[1])))


TENSOR_CASES = [  # shape, dtype, transpose, amax given
    ((1, 1), jnp.float32, True, False),
    ((5,), jnp.float32, False, False),
    ((), jnp.float32, False, False),
    ((33, 70), jnp.bfloat16, True, False),
    ((130, 65), jnp.float32, True, True),
    ((2, 3, 9), jnp.bfloat16, True, True),
]


@pytest.mark.parametrize('shape,dtype,transpose,given', TENSOR_CASES)
def test_tensor_kernel_matches_reference(shape, dtype, transpose, given,
                                         max_moved=0.0):
  x = _data(shape, seed=2).astype(dtype)
  amax = jnp.max(jnp.abs(x.astype(jnp.float32))) if given else None
  for fmt in ('e4m3', 'e5m2'):
    ref = jax.jit(lambda x: tensor_ref.quantize_per_tensor(
        x, fmt, amax=amax, transpose=transpose))(x)
    out = tensor_api.quantize_per_tensor(
        x, fmt, amax=amax, transpose=transpose, implementation='pallas')
    steps = np.abs(_codes(out[0]) - _codes(ref[0]))
    assert (steps > 0).mean() <= max_moved and steps.max() <= 1, fmt
    if not max_moved:
      _assert_same(out[0], ref[0], 'values')
    _assert_same(out[1], ref[1], 'scale')
    if transpose:
      if not max_moved:
        _assert_same(out[2], ref[2], 'transpose')
      _assert_same(out[2], tensor_ref.as_matrix(out[0]).T)
    else:
      assert out[2] is None


def test_tensor_kernel_fresh_inputs_differ_only_at_float32_ties(seed):
  """Random bf16 inputs of a random shape over a wide range: the kernel
  gives the reference's codes except at float32 ties, where x / scale or
  x * (1 / scale) lies exactly halfway between two FP8 codes. XLA:CPU
  computes the kernel's division as x * (1 / scale) and the reference's
  as a division; the two differ by a float32 ulp, so where one of them
  is the tie (rounded to even) and the other is not, each picks a
  different neighbour. (On the GPU both multiply by the reciprocal: the
  `gpu` tests compare bit for bit.)"""
  rng = np.random.default_rng(seed)
  shape = (int(rng.integers(1, 200)), int(rng.integers(1, 300)))
  x = jnp.asarray(rng.standard_normal(shape) * np.exp(rng.uniform(
      -8, 8, shape)), jnp.bfloat16)
  for fmt in ('e4m3', 'e5m2'):
    ref = jax.jit(lambda x: tensor_ref.quantize_per_tensor(
        x, fmt, transpose=True))(x)
    out = tensor_api.quantize_per_tensor(x, fmt, transpose=True,
                                         implementation='pallas')
    _assert_same(out[1], ref[1], 'scale')
    _assert_same(out[2], tensor_ref.as_matrix(out[0]).T, 'transpose')
    a, b = (np.asarray(v.astype(jnp.float32), np.float64)
            for v in (out[0], ref[0]))
    moved = a != b
    x32, scale = np.asarray(x, np.float32), np.float32(ref[1])
    mid = (a[moved] + b[moved]) / 2
    ties = ((x32 / scale)[moved] == mid) | (
        (x32 * (np.float32(1) / scale))[moved] == mid)
    print(f'seed {seed} {fmt}: {moved.sum()} of {x.size} codes at ties')
    assert ties.all(), (seed, fmt, np.argwhere(moved)[~ties][:3])
    assert (np.abs(_codes(out[0]) - _codes(ref[0])) <= 1).all()


def test_tensor_special_values():
  quantize = lambda x, **kw: tensor_api.quantize_per_tensor(
      x, implementation='pallas', **kw)
  zeros = quantize(jnp.zeros((4, 8)))
  assert zeros[1] == 1.0 and not np.any(np.asarray(zeros[0], np.float32))
  for bad in (np.nan, np.inf):
    x = jnp.ones((40, 40)).at[3, 7].set(bad)
    values, scale, _ = quantize(x)
    assert np.isnan(scale) and np.all(np.isnan(np.asarray(
        values.astype(jnp.float32))))
  x = _data((16, 16), seed=4)
  ref = tensor_ref.quantize_per_tensor(x, scale_dtype=jnp.bfloat16)
  out = quantize(x, scale_dtype=jnp.bfloat16)
  _assert_same(out[0], ref[0])
  _assert_same(out[1], ref[1])


@pytest.mark.parametrize('implementation', ['xla', 'pallas'])
def test_tensor_amax_given_back_gives_the_same_codes(implementation, seed):
  """tensor_amax is the amax quantize_per_tensor computes itself: passed
  back as amax=, the same scale and codes (NaN and Inf included)."""
  for x in (_data((37, 96), seed=seed),
            _data((5, 64), seed=2, nonfinite=True), jnp.zeros((0, 16))):
    amax = tensor_api.tensor_amax(x, implementation=implementation)
    assert amax.shape == () and amax.dtype == jnp.float32
    got = tensor_api.quantize_per_tensor(
        x, 'e5m2', amax=amax, transpose=True, implementation=implementation)
    want = tensor_api.quantize_per_tensor(
        x, 'e5m2', transpose=True, implementation=implementation)
    for a, b in zip(got, want):
      _assert_same(a, b)
  np.testing.assert_array_equal(
      tensor_api.tensor_amax(jnp.array([[-3.0, 2.0]]),
                             implementation=implementation), 3.0)


PARTS_CASES = [  # rows, part widths, dtype
    (48, (64, 16, 40), jnp.bfloat16),  # 64-wide tiles, then 16: one tile
    (37, (24, 40), jnp.float32),  # offsets of 8: 8-wide tiles
    (5, (3,), jnp.bfloat16),  # one part, narrower than a tile
    (130, (256, 32, 33), jnp.bfloat16),  # the last part ends in a partial tile
]


@pytest.mark.parametrize('rows,widths,dtype', PARTS_CASES)
def test_tensor_parts_match_the_concatenation(rows, widths, dtype, seed,
                                              implementation='pallas'):
  """quantize_per_tensor_parts = quantize_per_tensor of the parts side by
  side (the same kernel), bit for bit, each part quantized into its columns
  (with the amax computed, and given as the max of the parts'). The kernel
  itself against the jnp reference: test_tensor_kernel_matches_reference."""
  parts = [_data((rows, w), seed=seed + i).astype(dtype)
           for i, w in enumerate(widths)]
  parts[-1] = parts[-1] * 1e3  # the scale is the last part's
  whole = jnp.concatenate(parts, axis=1)
  for fmt, transpose, given in (('e5m2', True, False), ('e4m3', False, True),
                                ('e5m2', True, True)):
    amax = (jnp.max(jnp.stack([tensor_ref.tensor_amax(x) for x in parts]))
            if given else None)
    out = tensor_api.quantize_per_tensor_parts(
        parts, fmt, amax=amax, transpose=transpose,
        implementation=implementation)
    ref = tensor_api.quantize_per_tensor(
        whole, fmt, amax=amax, transpose=transpose,
        implementation=implementation)
    for a, b, what in zip(out, ref, ('values', 'scale', 'transpose')):
      if b is None:
        assert a is None
      else:
        _assert_same(a, b, what)


def test_tensor_parts_special_values_and_errors():
  parts = [jnp.ones((40, 16)), jnp.ones((40, 8)).at[3, 7].set(jnp.nan)]
  values, scale, values_t = tensor_api.quantize_per_tensor_parts(
      parts, transpose=True, implementation='pallas')
  assert np.isnan(scale) and np.all(np.isnan(np.asarray(
      values_t.astype(jnp.float32))))  # NaN in one part: all NaN, as one
  zeros = tensor_api.quantize_per_tensor_parts(
      [jnp.zeros((4, 8)), jnp.zeros((4, 16))], implementation='pallas')
  assert zeros[1] == 1.0 and zeros[0].shape == (4, 24)
  with pytest.raises(ValueError, match='same rows and dtype'):
    tensor_api.quantize_per_tensor_parts([jnp.ones((4, 8)), jnp.ones((5, 8))])
  with pytest.raises(ValueError, match='same rows and dtype'):
    tensor_api.quantize_per_tensor_parts([jnp.ones((4, 8, 2))])
  with pytest.raises(TypeError, match='floating'):
    tensor_api.quantize_per_tensor_parts([jnp.ones((4, 8), jnp.int32)])


def test_coat_jax_per_tensor_dispatches_to_the_kernel():
  x = _data((31, 77), seed=5)
  for fmt in ('e4m3', 'e5m2'):
    ref = quant.quantize_per_tensor(x, fmt)
    out = quant.quantize_per_tensor(x, fmt, implementation='pallas')
    _assert_same(out.values, ref.values)
    _assert_same(out.scale, ref.scale)


def test_implementation_argument():
  x = _data((4, 32))
  with pytest.raises(ValueError, match='implementation'):
    group_api.quantize_per_group(x, 16, implementation='triton')
  with pytest.raises(ValueError, match='group_size'):
    group_api.quantize_per_group(x, 0)
  with pytest.raises(ValueError, match='FP8'):
    tensor_api.quantize_per_tensor(x, 'int8')
  # 'xla' and the default are the reference; a non-power-of-two group size
  # falls back to it under 'pallas'.
  ref = group_ref.quantize_per_group(x, 24, 'e4m3', True)
  for impl in ('xla', None, 'pallas'):
    out = group_api.quantize_per_group(x, 24, 'e4m3', True,
                                       implementation=impl)
    for a, b in zip(out, ref):
      _assert_same(a, b)


def test_under_jit():
  x = _data((3, 4, 64), seed=6, specials=False)
  f = jax.jit(lambda x: group_api.quantize_per_group(
      x, 16, 'e4m3', True, implementation='pallas'))
  ref = group_ref.quantize_per_group(x, 16, 'e4m3', True)
  for a, b in zip(f(x), ref):
    _assert_same(a, b)


# ---------------------------------------------------------------- GPU ----

GPU_GROUP_CASES = [
    ((1, 1), 128, 'e4m3', True),
    ((37, 1000), 16, 'e4m3', False),
    ((37, 1000), 128, 'e4m3', True),
    ((1024, 4096), 128, 'e4m3', True),
    ((1024, 4096), 128, 'e5m2', False),
    ((4096, 1024), 16, 'e5m2', True),
    ((5000,), 128, 'e4m3', True),
]


@pytest.mark.gpu
@pytest.mark.parametrize('shape,group,fmt,expansion', GPU_GROUP_CASES)
def test_gpu_group_kernel_matches_xla(shape, group, fmt, expansion):
  """Compiled kernels against the reference compiled by XLA: same bits."""
  x = _data(shape, seed=7, nonfinite=True)
  ref = jax.jit(lambda x: group_ref.quantize_per_group(
      x, group, fmt, expansion))(x)
  out = group_api.quantize_per_group(
      x, group, fmt, expansion, implementation='pallas')
  deq_ref = jax.jit(lambda *a: group_ref.dequantize_per_group(*a, group))(
      *ref)
  deq = group_api.dequantize_per_group(*ref, group, implementation='pallas')
  print(f'\n{shape} g{group} {fmt} expansion={expansion}: codes differing'
        f' {(_codes(out[0]) != _codes(ref[0])).sum()} / {x.size},'
        f' dequantized values differing {int((deq != deq_ref).sum())}')
  _assert_same_quantized(out, ref)
  _assert_same(deq, deq_ref, 'dequantize')


@pytest.mark.gpu
@pytest.mark.parametrize('shape,dtype,transpose,given', [
    ((4096, 4096), jnp.bfloat16, True, False),
    ((333, 4099), jnp.float32, True, True),
    ((8192, 1024), jnp.bfloat16, False, False),
])
def test_gpu_tensor_kernel_matches_xla(shape, dtype, transpose, given):
  # float32 input with a given amax: a rare code moves by one step on a
  # Hopper GPU (Triton's x / s vs XLA's); everything else is the same bits.
  test_tensor_kernel_matches_reference(
      shape, dtype, transpose, given,
      max_moved=1e-5 if dtype == jnp.float32 else 0.0)


@pytest.mark.gpu
@pytest.mark.parametrize('rows,widths,dtype', PARTS_CASES + [
    (16384, (2048, 256, 256), jnp.bfloat16)])  # 1b's Q/K/V gradient
def test_gpu_tensor_parts_match_the_concatenation(rows, widths, dtype):
  test_tensor_parts_match_the_concatenation(rows, widths, dtype)


def _tiny_groups(seed=11):
  """(64, 256) float32: groups of 128 whose max |x| lies between 2^-126 and
  fp8_max * 2^-126, where amax / fp8_max is subnormal, beside zeros and a
  normal group."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((64, 256)) * np.exp(
      rng.uniform(-86, -81, (64, 1)))  # ~1e-37 .. 1e-35
  x[:, ::5] = 0.0
  x[0, 128:] = rng.standard_normal(128)
  return jnp.asarray(x.astype(np.float32))


@pytest.mark.parametrize('expansion', [False, True])
def test_group_scales_are_never_subnormal(expansion):
  """A group whose amax / fp8_max is subnormal gets the smallest normal
  scale (or 1 where XLA flushes it to zero first): never a subnormal one,
  which the GPU kernels' division would flush to zero (inf and NaN codes)."""
  x = _tiny_groups()
  q = group_ref.quantize_per_group(x, 128, 'e4m3', expansion)
  scale = np.asarray(q[1], np.float32)
  assert (scale >= np.finfo(np.float32).smallest_normal).all()
  assert np.isfinite(np.asarray(q[0], np.float32)).all()
  deq = group_ref.dequantize_per_group(*q, 128)
  assert np.isfinite(np.asarray(deq)).all()


@pytest.mark.gpu
@pytest.mark.parametrize('expansion', [False, True])
def test_gpu_group_kernel_tiny_groups(expansion):
  """On the GPU, where XLA keeps subnormals: the kernel's codes of groups
  with amax in [2^-126, fp8_max * 2^-126) are finite and the reference's."""
  test_group_scales_are_never_subnormal(expansion)
  x = _tiny_groups()
  ref = jax.jit(lambda x: group_ref.quantize_per_group(
      x, 128, 'e4m3', expansion))(x)
  out = group_api.quantize_per_group(x, 128, 'e4m3', expansion,
                                     implementation='pallas')
  assert np.isfinite(np.asarray(out[0], np.float32)).all()
  _assert_same_quantized(out, ref)
