"""Quantizers against float64 references: bounds, exact cases, edges."""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from coat_jax import quant

FORMATS = ['e4m3', 'e5m2']
# Half an ulp relative to |x| in the normal range; half the smallest
# subnormal (times the scale) below it.
REL_HALF_ULP = {'e4m3': 2.0**-4, 'e5m2': 2.0**-3}
ABS_HALF_SUBNORMAL = {'e4m3': 2.0**-10, 'e5m2': 2.0**-17}


def _fp8_codes(rng, fmt, shape):
  """Random finite FP8 values of the format, as float32."""
  dt = quant.fp8_dtype(fmt)
  bits = rng.integers(0, 256, size=shape, dtype=np.uint8)
  vals = bits.view(dt).astype(np.float32)
  return np.where(np.isfinite(vals), vals, 1.0).astype(np.float32)


def _check_bound(x, deq, scale_per_elem, fmt):
  x = np.asarray(x, np.float64)
  err = np.abs(np.asarray(deq, np.float64) - x)
  bound = np.maximum(REL_HALF_ULP[fmt] * np.abs(x),
                     ABS_HALF_SUBNORMAL[fmt] * scale_per_elem)
  assert np.all(err <= bound * (1 + 1e-5) + 1e-45), np.max(err - bound)


def _per_elem(scale, shape, group_size):
  s = np.repeat(np.asarray(scale, np.float64), group_size, axis=-1)
  return s[..., :shape[-1]]


@pytest.mark.parametrize('fmt', FORMATS)
def test_saturating_cast(fmt):
  m = quant.fp8_max(fmt)
  x = jnp.array([m * 1.04, -m * 3, jnp.inf, -jnp.inf, jnp.nan, 1.0, 0.0])
  y = np.asarray(quant.saturating_cast(x, fmt).astype(jnp.float32))
  np.testing.assert_array_equal(y[:4], [m, -m, m, -m])
  assert np.isnan(y[4])
  np.testing.assert_array_equal(y[5:], [1.0, 0.0])
  assert {'e4m3': 448.0, 'e5m2': 57344.0}[fmt] == m


@pytest.mark.parametrize('fmt', FORMATS)
def test_saturating_cast_rounds_to_nearest_even_like_ml_dtypes(fmt, seed):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(10_000).astype(np.float32) * 8
  got = np.asarray(quant.saturating_cast(x, fmt)).view(np.uint8)
  want = x.astype(np.float64).astype(quant.fp8_dtype(fmt)).view(np.uint8)
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize('fmt', FORMATS)
def test_per_tensor_exact_on_representable(fmt, seed):
  rng = np.random.default_rng(seed)
  codes = _fp8_codes(rng, fmt, (33, 70))
  codes[5, 7] = -quant.fp8_max(fmt)  # amax is the max code: scale = 2^e.
  for e in (-20, 0, 7):
    x = codes * np.float32(2.0**e)
    q = quant.quantize_per_tensor(x, fmt)
    assert q.scale.shape == () and q.values.dtype == quant.fp8_dtype(fmt)
    np.testing.assert_array_equal(np.asarray(quant.dequantize(q)), x)


@pytest.mark.parametrize('fmt', FORMATS)
@pytest.mark.parametrize('group_size', [16, 128])
def test_per_group_exact_on_representable(fmt, group_size, seed):
  rng = np.random.default_rng(seed)
  codes = _fp8_codes(rng, fmt, (7, 4 * group_size))
  codes[:, ::group_size] = quant.fp8_max(fmt)
  exps = rng.integers(-30, 30, size=(7, 4)).astype(np.float32)
  x = codes * np.repeat(2.0**exps, group_size, axis=-1)
  q = quant.quantize_per_group(x, group_size, fmt)
  np.testing.assert_array_equal(np.asarray(quant.dequantize(q)), x)


@pytest.mark.parametrize('fmt', FORMATS)
@pytest.mark.parametrize('shape,group_size', [
    ((300,), 128), ((5, 300), 128), ((3, 4, 37), 16), ((1, 1), 16),
    ((2, 128), 128), ((129, 1), 16)])
def test_per_group_error_bound_against_float64(fmt, shape, group_size,
                                               seed):
  rng = np.random.default_rng(seed)
  x = (rng.standard_normal(shape) * np.exp(rng.standard_normal(shape) * 2))
  x = x.astype(np.float32)
  q = quant.quantize_per_group(x, group_size, fmt)
  groups = math.ceil(shape[-1] / group_size)
  assert q.scale.shape == shape[:-1] + (groups,)
  assert q.values.shape == shape
  deq = np.asarray(quant.dequantize(q))
  # float64 reference of the same quantizer.
  xp = np.pad(x.astype(np.float64),
              [(0, 0)] * (x.ndim - 1) + [(0, groups * group_size - shape[-1])])
  xg = xp.reshape(shape[:-1] + (groups, group_size))
  ref_scale = np.abs(xg).max(-1) / quant.fp8_max(fmt)
  np.testing.assert_allclose(np.asarray(q.scale), ref_scale, rtol=2e-7)
  scale = _per_elem(ref_scale, shape, group_size)
  _check_bound(x, deq, scale, fmt)
  ref = np.clip(x / scale, -quant.fp8_max(fmt), quant.fp8_max(fmt))
  ref = ref.astype(quant.fp8_dtype(fmt)).astype(np.float32)
  # Float32 vs float64 division can only flip a rounding near a tie.
  assert np.mean(np.asarray(q.values).astype(np.float32) == ref) > 0.99


@pytest.mark.parametrize('fmt', FORMATS)
def test_per_tensor_error_bound_and_bf16_scale(fmt, seed):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((64, 96)).astype(np.float32) * 3
  for scale_dtype in (jnp.float32, jnp.bfloat16):
    q = quant.quantize_per_tensor(x, fmt, scale_dtype=scale_dtype)
    assert q.scale.dtype == scale_dtype
    s = float(q.scale.astype(jnp.float32))
    # A bf16 scale may round down: values saturate, error stays bounded.
    deq = np.asarray(quant.dequantize(q))
    _check_bound(x, deq, s, fmt) if scale_dtype == jnp.float32 else None
    assert np.max(np.abs(deq - x)) <= REL_HALF_ULP[fmt] * 1.01 * np.max(
        np.abs(x)) + 2**-8 * np.max(np.abs(x))


@pytest.mark.parametrize('expansion', [False, True])
@pytest.mark.parametrize('fmt', FORMATS)
def test_zero_constant_and_single_nonzero_groups_are_exact(expansion, fmt):
  x = np.zeros((4, 32), np.float32)
  x[1, :16] = 0.37  # constant group
  x[1, 16:] = -0.37 * np.sign(np.arange(16) - 7.5)  # constant |x|, mixed sign
  x[2, 5] = -1e-30  # one nonzero in a group of zeros
  x[3, 16:] = 3e38  # constant near float32 max
  q = quant.quantize_per_group(x, 16, fmt, expansion=expansion)
  deq = np.asarray(quant.dequantize(q))
  if expansion:  # The group max maps to fp8_max and back exactly.
    np.testing.assert_array_equal(deq, x)
  else:  # fp8_max * (amax / fp8_max): two float32 roundings.
    np.testing.assert_allclose(deq, x, rtol=2**-22)
  assert np.all(np.isfinite(np.asarray(q.scale)))
  if expansion:
    assert np.all(np.isfinite(np.asarray(q.exponent)))


@pytest.mark.parametrize('expansion', [False, True])
def test_all_zero_tensor(expansion):
  for shape in [(0,), (), (3,), (2, 40)]:
    x = jnp.zeros(shape)
    q = quant.quantize_per_group(x, 16, expansion=expansion)
    np.testing.assert_array_equal(np.asarray(quant.dequantize(q)), x)
    np.testing.assert_array_equal(
        np.asarray(quant.dequantize(quant.quantize_per_tensor(x))), x)


@pytest.mark.parametrize('expansion', [False, True])
@pytest.mark.parametrize('fmt', FORMATS)
def test_nan_and_inf_poison_only_their_group(expansion, fmt):
  x = np.ones((3, 32), np.float32)
  x[0, 3] = np.nan
  x[1, 20] = np.inf
  x[2, 0] = -np.inf
  q = quant.quantize_per_group(x, 16, fmt, expansion=expansion)
  deq = np.asarray(quant.dequantize(q))
  assert np.all(np.isnan(deq[0, :16])) and np.all(np.isnan(deq[1, 16:]))
  assert np.all(np.isnan(deq[2, :16]))
  np.testing.assert_array_equal(deq[0, 16:], 1.0)
  np.testing.assert_array_equal(deq[1, :16], 1.0)
  np.testing.assert_array_equal(deq[2, 16:], 1.0)
  qt = quant.quantize_per_tensor(x, fmt)
  assert np.all(np.isnan(np.asarray(quant.dequantize(qt))))


@pytest.mark.parametrize('expansion', [False, True])
def test_float32_subnormals(expansion):
  tiny = np.float32(1.4e-45)  # smallest float32 subnormal
  x = np.array([[tiny * 3, tiny * 100, 0, -tiny * 1000] * 4], np.float32)
  q = quant.quantize_per_group(x, 16, expansion=expansion)
  deq = np.asarray(quant.dequantize(q))
  assert np.all(np.isfinite(deq))
  assert np.max(np.abs(deq - x)) <= 1000 * tiny
  assert np.all(np.sign(deq[deq != 0]) == np.sign(x[deq != 0]))


def test_scalars_and_one_dimensional():
  for x in (jnp.float32(-2.5), jnp.arange(5.0) - 2):
    for expansion in (False, True):
      q = quant.quantize_per_group(x, 128, expansion=expansion)
      assert q.values.shape == x.shape and q.scale.shape == (1,)
      deq = np.asarray(quant.dequantize(q))
      if expansion:  # +-1 map near the E4M3 subnormals (k = 16): ~1%.
        np.testing.assert_allclose(deq, x, rtol=2**-6)
      else:
        np.testing.assert_array_equal(deq, x)


@pytest.mark.parametrize('expansion', [False, True])
def test_bfloat16_input_and_output_dtype(expansion):
  """bf16 input: the codes and scales of the same values in float32;
  dequantized to bf16: the float32 result rounded once."""
  x = jnp.linspace(-3, 3, 64, dtype=jnp.bfloat16)
  q = quant.quantize_per_group(x, 16, expansion=expansion)
  q32 = quant.quantize_per_group(x.astype(jnp.float32), 16,
                                 expansion=expansion)
  for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(q32)):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a, np.float32),
                                  np.asarray(b, np.float32))
  y = quant.dequantize(q, jnp.bfloat16)
  assert y.dtype == jnp.bfloat16
  want = quant.dequantize(q32)
  np.testing.assert_array_equal(y, want.astype(jnp.bfloat16))
  # Within FP8 rounding of x (E4M3: 3 mantissa bits).
  np.testing.assert_allclose(np.asarray(y, np.float32),
                             np.asarray(x, np.float32), rtol=2**-4,
                             atol=1e-3)


# Dynamic range expansion.

def _design_codes(x, fmt='e4m3'):
  """docs/design.md's expansion in float64: k, c, S and the stored code, one
  group."""
  a = np.abs(x.astype(np.float64))
  big, small = a.max(), a[a > 0].min()
  log2_u = math.log2(quant.expansion_range(fmt))
  k = math.floor(16 * log2_u / math.log2(big / small)) / 16
  c = math.sqrt(big) * math.sqrt(small)
  s = (big / c) ** k / quant.fp8_max(fmt)
  codes = np.sign(x) * (a / c) ** k / s
  return k, c, s, codes.astype(quant.fp8_dtype(fmt))


@pytest.mark.parametrize('group,k_expected', [
    ([1, 2, 4, 8], 5.5),  # R=8: floor(16*16.61/3)/16 = 88/16
    ([0.5, -0.25, 0, 1e-3], 1.8125),  # R=500: floor(16*16.61/8.97)/16
    ([3e-4, 1.0, 2.0, -1.5], 1.25),  # R=6667: floor(16*16.61/12.70)/16
])
def test_expansion_matches_hand_computed(group, k_expected):
  x = np.array([group], np.float32)
  k, c, s, want = _design_codes(x[0])
  assert k == k_expected
  q = quant.quantize_per_group(x, 4, 'e4m3', expansion=True)
  assert float(q.exponent[0, 0]) == k
  # The stored max equals the expansion's c (448 S)^(1/k), i.e. M.
  np.testing.assert_allclose(float(q.scale[0, 0]),
                             c * (448 * s) ** (1 / k), rtol=1e-6)
  got = np.asarray(q.values[0]).astype(np.float32)
  want = want.astype(np.float32)
  # Same map up to float32 vs float64 pow: codes agree to one FP8 step.
  np.testing.assert_allclose(got, want, rtol=2**-3)
  assert np.mean(got == want) >= 0.75


def test_expansion_exponent_bounds():
  x = np.array([[1e-30, 1e30, 0, 0], [1.0, 1.0 + 2**-20, 1, 1]], np.float32)
  q = quant.quantize_per_group(x, 4, expansion=True)
  k = np.asarray(q.exponent)[:, 0]
  assert k[0] == quant.K_MIN  # R = 1e60 would want k = 1/16
  assert k[1] == quant.K_MAX  # near-constant group: k bounded, not inf
  deq = np.asarray(quant.dequantize(q))
  assert np.all(np.isfinite(deq))
  np.testing.assert_allclose(deq[1], x[1], rtol=1e-6)
  # Beyond U^4 the smallest values flush to zero; the max stays exact.
  np.testing.assert_array_equal(deq[0], [0, x[0, 1], 0, 0])


def test_expansion_range_far_beyond_u():
  """A group spanning 1e12 keeps its extremes, each to FP8-ish accuracy."""
  x = np.geomspace(1e-6, 1e6, 128).astype(np.float32)[None]
  q = quant.quantize_per_group(x, 128, expansion=True)
  assert float(q.exponent[0, 0]) < 1
  deq = np.asarray(quant.dequantize(q))
  rel = np.abs(deq - x) / x
  assert np.all(np.isfinite(deq)) and rel.max() < 0.6 and deq.min() > 0
  plain = np.asarray(quant.dequantize(quant.quantize_per_group(x, 128)))
  assert np.sum(plain == 0) > 50  # plain FP8 flushes half the group to zero


@pytest.mark.parametrize('fmt', FORMATS)
def test_expansion_reduces_error_on_lognormal(fmt, seed):
  rng = np.random.default_rng(seed)
  x = np.exp(rng.standard_normal((64, 512)) * 2.5).astype(np.float32)
  x *= np.sign(rng.standard_normal(x.shape)).astype(np.float32)
  err = {}
  for e in (False, True):
    deq = np.asarray(quant.dequantize(
        quant.quantize_per_group(x, 128, fmt, expansion=e)))
    err[e] = np.mean(((deq - x) / x) ** 2)
  print(f'{fmt} relative MSE: plain {err[False]:.3e}, expanded {err[True]:.3e}')
  # E5M2 already spans a wide range, so expansion gains less there.
  assert err[True] < err[False] / {'e4m3': 4, 'e5m2': 2}[fmt]


# Pytree, jit, sharding, validation.

def test_pytree_and_jit():
  x = jax.random.normal(jax.random.key(0), (4, 64))
  q = quant.quantize_per_group(x, 16, expansion=True)
  leaves, treedef = jax.tree.flatten(q)
  assert len(leaves) == 3
  assert jax.tree.unflatten(treedef, leaves) == q
  qj = jax.jit(lambda v: quant.quantize_per_group(v, 16, expansion=True))(x)
  for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(qj)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert q.nbytes == 4 * 64 + 2 * 4 * 4 * 4


@pytest.mark.parametrize('axis_type', ['auto', 'explicit'])
@pytest.mark.parametrize('spec', [('x', None), (None, 'x')])
def test_sharding_is_kept(axis_type, spec):
  P = jax.sharding.PartitionSpec
  at = {'auto': jax.sharding.AxisType.Auto,
        'explicit': jax.sharding.AxisType.Explicit}[axis_type]
  mesh = jax.make_mesh((8,), ('x',), axis_types=(at,))
  x = jax.random.normal(jax.random.key(1), (16, 1024))
  xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, P(*spec)))
  f = jax.jit(lambda v: quant.quantize_per_group(v, 128, expansion=True))
  with jax.set_mesh(mesh):
    q = f(xs)
    deq = jax.jit(quant.dequantize)(q)
  assert q.values.sharding.spec == P(*spec)
  assert q.scale.sharding.spec == P(*spec)
  ref = f(x)
  for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(ref)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(np.asarray(deq),
                                np.asarray(jax.jit(quant.dequantize)(ref)))


@pytest.mark.parametrize('jit', [True, False])
@pytest.mark.parametrize('shape', [(16, 176), (16, 1024), (16, 960), (16, 64)])
def test_explicit_sharding_of_fewer_groups_than_shards(shape, jit):
  """Under an Explicit mesh (shardings in the types), eagerly or jitted: a
  last axis split 8 ways keeps its sharding on the values; the scales'
  last axis (2, 8, 8 or 1 groups) keeps it only where 8 divides it."""
  P = jax.sharding.PartitionSpec
  mesh = jax.make_mesh((8,), ('x',),
                       axis_types=(jax.sharding.AxisType.Explicit,))
  x = jax.random.normal(jax.random.key(1), shape)
  quantize = lambda v: quant.quantize_per_group(v, 128, expansion=True)
  maybe_jit = jax.jit if jit else lambda f: f
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, P(None, 'x'))
    q = maybe_jit(quantize)(xs)
    deq = maybe_jit(quant.dequantize)(q)
  groups = -(-shape[-1] // 128)
  assert q.values.sharding.spec == P(None, 'x')
  assert deq.sharding.spec == P(None, 'x')
  scale_spec = P(None, 'x') if groups % 8 == 0 else P(None, None)
  assert q.scale.sharding.spec == scale_spec
  assert q.exponent.sharding.spec == scale_spec
  ref = jax.jit(quantize)(x)
  for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(ref)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(np.asarray(deq),
                                np.asarray(jax.jit(quant.dequantize)(ref)))


@pytest.mark.parametrize('bad', [0, -16, 1.5, True, '16'])
def test_bad_group_size(bad):
  with pytest.raises(ValueError, match='group_size'):
    quant.quantize_per_group(jnp.ones(16), bad)


def test_bad_format_and_input():
  with pytest.raises(ValueError, match="dtype='e3m4'.*e4m3"):
    quant.quantize_per_group(jnp.ones(16), 16, 'e3m4')
  with pytest.raises(ValueError, match='dtype'):
    quant.quantize_per_tensor(jnp.ones(16), jnp.float16)
  with pytest.raises(TypeError, match='floating'):
    quant.quantize_per_tensor(jnp.arange(16))
  with pytest.raises(ValueError, match='scale_dtype'):
    quant.quantize_per_group(jnp.ones(16), 16, scale_dtype=jnp.float16)
  with pytest.raises(TypeError, match='QuantizedArray'):
    quant.dequantize(jnp.ones(3))


def test_ml_dtypes_agrees_on_format_limits():
  assert quant.fp8_max('e4m3') == float(ml_dtypes.finfo(
      ml_dtypes.float8_e4m3fn).max)
  assert quant.expansion_range('e4m3') == 448.0**2 / 2
