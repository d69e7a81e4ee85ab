"""Operands the Pallas-Triton kernels would index past 32-bit offsets.

Pallas-Triton switches to 64-bit offsets only for operands of more than
2^32 bytes, so a 1-byte (FP8) operand of 2^31 to 2^32 elements wraps
(`_common.offsets_overflow`). The kernels' entries run such operands in parts
along the leading axis. On the CPU the limits are lowered so that small
arrays take that path; the interpreted kernels must give the same bits as
one call. The `gpu` tests run real operands past 2^31 elements.
"""

import contextlib
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _common
from pallas_kernels.coat_adam_step import api as step_api
from pallas_kernels.coat_adam_step import pallas_triton
from pallas_kernels.coat_adam_step.reference import Moment
from pallas_kernels.coat_adam_update import api as update_api
from pallas_kernels.quantize_per_group import api as group_api
from pallas_kernels.quantize_per_group import reference as group_reference


@contextlib.contextmanager
def _small_limits(limit=1000, part=2048):
  with mock.patch.object(_common, 'INT32_OFFSET_LIMIT', limit), \
       mock.patch.object(_common, 'PART_ELEMENTS', part):
    yield


def _assert_same(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert x.shape == y.shape and x.dtype == y.dtype
    np.testing.assert_array_equal(np.asarray(x, np.float32),
                                  np.asarray(y, np.float32))


def _leaf(seed, shape):
  rng = np.random.default_rng(seed)
  p = jnp.asarray(rng.standard_normal(shape), jnp.float32)
  g = jnp.asarray(rng.standard_normal(shape), jnp.float32)
  m = Moment(*group_reference.quantize_per_group(0.1 * g, 128, 'e4m3', True))
  v = Moment(*group_reference.quantize_per_group(0.05 * g * g, 128, 'e4m3',
                                                 True))
  return p, g, m, v


def test_overflow_predicate():
  s = jax.ShapeDtypeStruct
  assert _common.offsets_overflow(s((2**31,), jnp.float8_e4m3fn))
  assert _common.offsets_overflow(s((3, 2**30), jnp.uint8))
  assert not _common.offsets_overflow(s((2**31 - 1,), jnp.float8_e4m3fn))
  # More than 2^32 bytes: Pallas uses 64-bit offsets.
  assert not _common.offsets_overflow(s((2**32 + 16,), jnp.float8_e4m3fn))
  assert not _common.offsets_overflow(s((2**31,), jnp.float32))
  assert not _common.offsets_overflow(None, s((4, 4), jnp.uint8))
  # The 13B model's stacked MLP moments: 40 x 5120 x 13824 codes.
  assert _common.offsets_overflow(s((40, 5120, 13824), jnp.float8_e4m3fn))


def test_leading_parts_cover_the_axis():
  assert _common.leading_parts((10, 4, 8), limit=96) == [
      (0, 3), (3, 6), (6, 9), (9, 10)]
  assert _common.leading_parts((3, 1000), limit=10) == [(0, 1), (1, 2),
                                                        (2, 3)]
  with pytest.raises(ValueError, match='leading axis'):
    _common.leading_parts((2**31,))


@pytest.mark.parametrize('shape', [(6, 8, 256), (37, 384)])
def test_step_in_parts_is_one_call(shape, seed):
  p, g, m, v = _leaf(seed, shape)
  step = lambda: step_api.coat_adam_step(
      p, g, m, v, jnp.int32(3), learning_rate=1e-2, weight_decay=0.1,
      implementation='pallas')
  whole = step()
  calls = []
  real = pallas_triton.coat_adam_step
  with _small_limits(), mock.patch.object(
      pallas_triton, 'coat_adam_step',
      lambda *a, **k: calls.append(a[0].shape) or real(*a, **k)):
    parts = step()
  assert len(calls) > 1 and sum(c[0] for c in calls) == shape[0]
  assert all(np.prod(c) <= 2048 or c[0] == 1 for c in calls)
  _assert_same(whole, parts)


def test_one_layer_of_a_stack_in_parts(seed):
  p, g, m, v = _leaf(seed, (5, 16, 256))
  step = lambda: step_api.coat_adam_step(
      p, g[3], m, v, jnp.int32(2), learning_rate=1e-2, weight_decay=0.1,
      implementation='pallas', layer=3)
  whole = step()
  with _small_limits(part=1024):
    parts = step()
  _assert_same(whole, parts)
  # The other layers are untouched.
  np.testing.assert_array_equal(parts[0][:3], p[:3])
  np.testing.assert_array_equal(parts[0][4:], p[4:])


def test_update_in_parts_is_one_call(seed):
  _, g, m, v = _leaf(seed, (9, 4, 384))
  update = lambda: update_api.coat_adam_update(
      g, m, v, jnp.int32(2), implementation='pallas')
  whole = update()
  with _small_limits():
    parts = update()
  _assert_same(whole, parts)


@pytest.mark.parametrize('expansion', [False, True])
def test_group_quantize_in_parts_is_one_call(expansion, seed):
  x = jnp.asarray(np.random.default_rng(seed).standard_normal((7, 3, 256)),
                  jnp.float32)
  quantize = lambda: group_api.quantize_per_group(
      x, 128, 'e4m3', expansion, implementation='pallas')
  whole = quantize()
  with _small_limits():
    parts = quantize()
    deq_parts = group_api.dequantize_per_group(*parts, 128,
                                               implementation='pallas')
  _assert_same(whole, parts)
  _assert_same(group_api.dequantize_per_group(*whole, 128,
                                              implementation='pallas'),
               deq_parts)


@pytest.mark.gpu
def test_gpu_step_past_2_31_elements():
  """A stack of 2^31 + 2^25 elements (FP8 moments of 2.2 GB): the last
  layer steps like the XLA reference on that layer alone."""
  shape = (33, 8192, 8192)  # 2.21e9 elements
  key = jax.random.key(0)
  p = jax.random.normal(key, shape, jnp.float32)
  g = 1e-2 * jax.random.normal(jax.random.key(1), shape, jnp.float32)
  zeros = lambda: Moment(*group_api.quantize_per_group(
      jnp.zeros(shape[1:], jnp.float32), 128, 'e4m3', True))
  stack = lambda q: jax.tree.map(lambda a: jnp.broadcast_to(a, shape[:1]
                                                            + a.shape), q)
  m, v = stack(zeros()), stack(zeros())
  kw = dict(learning_rate=1e-3, weight_decay=0.1)
  new_p, new_m, _ = jax.jit(lambda p, g, m, v: step_api.coat_adam_step(
      p, g, m, v, jnp.int32(1), implementation='pallas', **kw),
                            donate_argnums=(0, 2, 3))(p, g, m, v)
  last = lambda a: a[-1]
  ref_p, ref_m, _ = step_api.coat_adam_step(
      jax.random.normal(key, shape, jnp.float32)[-1], g[-1], zeros(),
      zeros(), jnp.int32(1), implementation='xla', **kw)
  assert np.isfinite(np.asarray(last(new_p))).all()
  np.testing.assert_allclose(last(new_p), ref_p, rtol=0, atol=2e-6)
  codes = lambda q: np.asarray(q.values.astype(jnp.float32))
  assert (np.abs(codes(jax.tree.map(last, new_m)) - codes(ref_m)) > 0
          ).mean() < 1e-2
