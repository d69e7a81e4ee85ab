"""The log2-domain group math (the optimizer kernels' with `approx`) against
the reference group math, and the Adam kernels running it.

On the GPU it runs on lg2.approx.ftz / ex2.approx.ftz; here on jnp's log2
and exp2 with float32 subnormals flushed like those (`FTZ_OPS`), so that the
lift of subnormals is tested too. Tolerances: codes within one
step in a small fraction of the elements, scales exact, exponents within one
step of 1/16, decoded values within 5e-6 relative of the reference's.
"""

import dataclasses
import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _common
from pallas_kernels.coat_adam_step import api as step_api
from pallas_kernels.coat_adam_step import pallas_triton as adam_pallas
from pallas_kernels.coat_adam_step import reference as adam_reference
from pallas_kernels.coat_adam_update import api as update_api
from pallas_kernels.quantize_per_group import log2_math
from pallas_kernels.quantize_per_group import reference

_TINY = np.float32(2.0**-126)


def _flush(x):
  return jnp.where(jnp.abs(x) < _TINY, jnp.zeros_like(x), x)


# The barrier keeps XLA from folding the log2 of a constant (fmax) on the
# host, which may round unlike its log2 of an array; the GPU's lg2 is one
# instruction either way.
FTZ_OPS = dataclasses.replace(
    _common.INTERPRET_OPS,
    log2=lambda x: jnp.log2(_flush(jax.lax.optimization_barrier(x))),
    exp2=lambda x: _flush(jnp.exp2(x)))


def _codes(a):
  return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8)).astype(int)


def _groups(seed, n_groups=512, g=128, specials=True, subnormals=False):
  """float32 groups (n_groups, g) spanning 1 to 1e13 within a group, at
  magnitudes from 1e-37 to 1e23, with edge groups first.

  Float32 subnormals only with `subnormals`: XLA on the CPU flushes them in
  arithmetic and comparisons (not in integer ops), so the references there
  do not see them as the GPU does.
  """
  rng = np.random.default_rng(seed)
  center = rng.uniform(-70, 40, (n_groups, 1))
  span = rng.uniform(0, 30, (n_groups, 1))
  x = rng.choice([-1.0, 1.0], (n_groups, g)) * np.exp(
      center + span * rng.uniform(-0.5, 0.5, (n_groups, g)))
  x[:, ::7] = 0.0
  if specials:
    x[0] = 0.0  # all zero
    x[1] = -3.0  # constant
    x[2] = 0.0
    x[2, 5] = 1e-3  # a single nonzero
    x[3, :64] = 2.0**-140 if subnormals else 2.0**-120
    x[4] = 2.0**-130 if subnormals else 2.0**-125
    x[4, 0] = 0.0
    x[5, 3] = np.nan
    x[6, 9] = -np.inf
    x[7] = np.linspace(-3e38, 3e38, g)  # near float32's max
  return jnp.asarray(x.astype(np.float32))


def _assert_close(got, want, max_frac=2e-3, scale_rtol=0.0):
  values, scale, exponent = got
  ref_values, ref_scale, ref_exponent = want
  np.testing.assert_allclose(
      np.asarray(scale, np.float32), np.asarray(ref_scale, np.float32),
      rtol=scale_rtol, atol=0)
  finite = np.isfinite(np.asarray(ref_scale, np.float32))
  step = np.abs(np.asarray(exponent) - np.asarray(ref_exponent))[finite]
  assert step.max(initial=0) <= 1 / 16 + 1e-6
  assert (step > 0).mean() <= 0.01
  if finite.ndim < np.ndim(ref_values):  # groups (..., g), scale (...)
    finite = finite[..., None]
  else:  # a moment: scale (..., ceil(n / 128))
    finite = np.repeat(finite, 128, -1)[..., :np.shape(ref_values)[-1]]
  nan = ~finite | np.isnan(np.asarray(ref_values, np.float32))
  diff = np.abs(_codes(values) - _codes(ref_values))
  diff[np.broadcast_to(nan, diff.shape)] = 0
  assert diff.max(initial=0) <= 1, diff.max()
  assert (diff > 0).mean() <= max_frac, (diff > 0).mean()
  np.testing.assert_array_equal(
      np.isnan(np.asarray(values, np.float32)),
      np.isnan(np.asarray(ref_values, np.float32)))


@pytest.mark.parametrize('dtype,scale_dtype', [
    ('e4m3', jnp.float32), ('e5m2', jnp.float32), ('e4m3', jnp.bfloat16)])
def test_encode_matches_reference(dtype, scale_dtype):
  x = _groups(0)
  got = jax.jit(lambda x: log2_math.encode_groups(
      x, dtype, scale_dtype, FTZ_OPS))(x)
  want = jax.jit(lambda x: reference.encode_groups(
      x, dtype, True, scale_dtype))(x)
  _assert_close(got, want)
  # Where the exponents agree, codes move by a step only near a rounding
  # tie: the largest |x| of each finite group is exactly fmax.
  codes = np.asarray(got[0], np.float32)
  finite = np.isfinite(np.asarray(got[1], np.float32))
  top = np.abs(codes).max(-1)[finite & (np.asarray(want[1]) != 1)]
  if scale_dtype == jnp.float32:
    np.testing.assert_array_equal(top, _common.fp8_max(dtype))


@pytest.mark.parametrize('dtype', ['e4m3', 'e5m2'])
def test_decode_matches_reference(dtype):
  x = _groups(1)
  values, scale, exponent = reference.encode_groups(x, dtype, True,
                                                    jnp.float32)
  codes = values.astype(jnp.float32)
  got = np.asarray(jax.jit(lambda *a: log2_math.decode_groups(
      *a, dtype, FTZ_OPS))(codes, scale, exponent))
  want = np.asarray(jax.jit(lambda *a: reference.decode_groups(
      *a, dtype))(codes, scale, exponent))
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
  np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
  # Relative 5e-6 (the rounding of an exp2 argument up to ~70), or flushed
  # below float32's normal range.
  ok = (np.abs(got - want) <= 5e-6 * np.abs(want)) | (
      (got == 0) & (np.abs(want) < _TINY)) | np.isnan(want)
  assert ok.all(), np.argwhere(~ok)[:5]
  assert np.isfinite(got[7]).all()


def test_roundtrip_matches_reference():
  """decode then encode (an Adam step with b = 1, g = 0) as the reference."""
  values, scale, exponent = reference.encode_groups(
      _groups(2), 'e4m3', True, jnp.float32)
  codes = values.astype(jnp.float32)
  got = jax.jit(lambda *a: log2_math.encode_groups(log2_math.decode_groups(
      *a, 'e4m3', FTZ_OPS), 'e4m3', jnp.float32, FTZ_OPS))(
          codes, scale, exponent)
  want = jax.jit(lambda *a: reference.encode_groups(reference.decode_groups(
      *a, 'e4m3'), 'e4m3', True, jnp.float32))(codes, scale, exponent)
  _assert_close(got, want)


# The Adam kernels, interpreted with the log2 formulation.

@pytest.fixture
def log2_kernels():
  """The interpreted Adam kernels with the log2 formulation's ops (`FTZ_OPS`
  in place of the interpreted reference ops)."""
  with mock.patch.object(adam_pallas, 'kernel_ops',
                         lambda interpret, approx: FTZ_OPS):
    jax.clear_caches()
    yield
  jax.clear_caches()


def _moment(x, dtype):
  return adam_reference.Moment(*reference.quantize_per_group(
      jnp.asarray(x, jnp.float32), 128, dtype, True))


def _adam_inputs(shape, seed, dtypes):
  rng = np.random.default_rng(seed)
  g = rng.standard_normal(shape) * np.exp(rng.uniform(-12, 2, shape))
  m = rng.standard_normal(shape) * np.exp(rng.uniform(-10, 0, shape))
  v = m**2 * rng.uniform(1, 4, shape)
  m[1], v[1], g[1] = 0.0, 0.0, 0.0  # all-zero groups
  p = rng.standard_normal(shape)
  return (jnp.asarray(p, jnp.float32), jnp.asarray(g, jnp.float32),
          _moment(m, dtypes[0]), _moment(v, dtypes[1]))


@pytest.mark.parametrize('shape,dtypes', [
    ((5, 300), ('e4m3', 'e4m3')), ((4, 256), ('e4m3', 'e5m2'))])
def test_step_kernel_matches_reference(log2_kernels, shape, dtypes):
  p, g, mu, nu = _adam_inputs(shape, 3, dtypes)
  run = lambda impl: jax.jit(functools.partial(
      step_api.coat_adam_step, learning_rate=1e-2, weight_decay=0.1,
      implementation=impl))(p, g, mu, nu, jnp.int32(4))
  got, want = run('pallas'), run('xla')
  # params within 4 ulp + 1e-4 of the update (the decoded moments' error).
  tol = 4 * np.spacing(np.abs(np.asarray(want[0]))) + 1e-4 * np.abs(
      np.asarray(want[0] - p))
  assert np.all(np.abs(np.asarray(got[0] - want[0])) <= tol)
  for new, ref in zip(got[1:], want[1:]):
    _assert_close(new, ref, max_frac=1e-2, scale_rtol=1e-6)


def test_update_kernel_matches_reference(log2_kernels):
  _, g, mu, nu = _adam_inputs((37, 300), 4, ('e4m3', 'e4m3'))
  run = lambda impl: jax.jit(functools.partial(
      update_api.coat_adam_update, implementation=impl))(
          g, mu, nu, jnp.int32(5))
  got, want = run('pallas'), run('xla')
  np.testing.assert_allclose(got[0], want[0], rtol=2e-5, atol=1e-6)
  for new, ref in zip(got[1:], want[1:]):
    _assert_close(new, ref, max_frac=1e-2, scale_rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize('dtypes', [('e4m3', 'e4m3'), ('e5m2', 'e5m2')])
def test_gpu_kernel_roundtrip_of_edge_groups(dtypes):
  """The compiled update kernel (lg2/ex2.approx.ftz) with b1 = b2 = 1 and a
  zero gradient decodes and re-encodes the moments: as the reference does,
  float32 subnormals, all-zero, constant, NaN and huge groups included."""
  x = _groups(5, subnormals=True)
  mu, nu = _moment(x, dtypes[0]), _moment(jnp.abs(x), dtypes[1])
  run = lambda impl: jax.jit(functools.partial(
      update_api.coat_adam_update, b1=1.0, b2=1.0, implementation=impl))(
          jnp.zeros_like(x), mu, nu, jnp.int32(1))
  got, want = run('pallas'), run('xla')
  for new, ref in zip(got[1:], want[1:]):
    _assert_close(new, ref, max_frac=1e-2, scale_rtol=1e-6)
