"""The group math of the kernels before issue 5, for A/B timing only.

`old_group_math()` swaps it into the Pallas kernels while tracing: the
expansion codec of per-element log2 / division / exp2 (4 log, 4 exp and 5
divisions per element of the fused step), masked tiles everywhere and the
bias corrections divided per element. Not numerically equal to the current
reference (its results are not checked), only timed.
"""

import contextlib
import dataclasses
import math

import jax
from jax import lax
import jax.numpy as jnp

from pallas_kernels import _common
from pallas_kernels.quantize_per_group import reference as group_reference

LOG2_E = group_reference.reciprocal(group_reference.LN_2)
LN_2 = group_reference.LN_2


def _log2(x):
  return jnp.log(x) * LOG2_E


def _exp2(x):
  return jnp.exp(LN_2 * x)


def _with_sign_of(a, x):
  negative = lax.bitcast_convert_type(x, jnp.int32) < 0
  return jnp.where(negative, -a, a)


def encode_groups(groups, dtype, expansion, scale_dtype,
                  ops=_common.XLA_OPS):
  dt = _common.fp8_dtype(dtype)
  fmax = _common.fp8_max(dt)
  absx = jnp.abs(groups)
  amax = _common.nan_max(absx, -1)
  recip = group_reference.reciprocal
  store_scale = group_reference.store_scale
  if not expansion:
    scale = store_scale(amax * recip(fmax), amax, scale_dtype)
    codes = ops.div(groups, scale.astype(jnp.float32)[..., None])
    return _common.saturate(codes, dt), scale, None
  amin = jnp.min(jnp.where(absx > 0, absx, jnp.inf), axis=-1)
  log2_ratio = _log2(amax) - _log2(amin)
  steps = jnp.floor(ops.div(
      16 * math.log2(group_reference.expansion_range(dt)), log2_ratio))
  k = _common.clip(steps * recip(16), 0.25, 16.0)
  exponent = jnp.where(amax > 0, k, 1.0).astype(jnp.float32)
  scale = store_scale(amax, amax, scale_dtype)
  log2_ratio = _log2(absx) - _log2(scale.astype(jnp.float32))[..., None]
  codes = _with_sign_of(
      fmax * _exp2(exponent[..., None] * log2_ratio), groups)
  return _common.saturate(codes, dt), scale, exponent


def decode_groups(groups, scale, exponent, dtype, ops=_common.XLA_OPS):
  scale = scale.astype(jnp.float32)[..., None]
  if exponent is None:
    return groups * scale
  fmax = _common.fp8_max(dtype)
  half_t = ops.div(_log2(jnp.abs(groups) * group_reference.reciprocal(fmax)),
                   2 * exponent[..., None])
  out = _with_sign_of(scale, groups) * _exp2(half_t)
  return out * _exp2(half_t)


def _masked_group_tile(block, ncb, rows, cols, group_size):
  pid = _common.pl.program_id(0)
  i, j = pid // ncb, pid % ncb
  ng = block[1] // group_size
  mask = _common.tile_mask(i, j, block, (rows, cols))
  gmask = _common.tile_mask(
      i, j, (block[0], ng), (rows, _common.pl.cdiv(cols, group_size)))
  return ng, mask, gmask


@contextlib.contextmanager
def old_group_math():
  """Kernels traced inside use the old group math (caches are cleared)."""
  saved = [(group_reference, 'encode_groups'),
           (group_reference, 'decode_groups'), (_common, 'group_tile'),
           (_common, 'TRITON_OPS')]
  saved = [(m, n, getattr(m, n)) for m, n in saved]
  jax.clear_caches()
  group_reference.encode_groups = encode_groups
  group_reference.decode_groups = decode_groups
  _common.group_tile = _masked_group_tile
  _common.TRITON_OPS = dataclasses.replace(
      _common.TRITON_OPS, div_scalar=lax.div)
  try:
    yield
  finally:
    for module, name, value in saved:
      setattr(module, name, value)
    jax.clear_caches()
