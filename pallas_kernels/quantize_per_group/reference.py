"""Per-group FP8 quantization along the last axis: the pure-jnp reference.

This module holds the numerics (the 'xla' path and the oracle of the Pallas
kernel); `coat_jax.quant` builds its `QuantizedArray` API on it. The group
math (`encode_groups`, `decode_groups`) takes an `Ops` bundle so that the
Pallas kernels run the very same expressions with correctly rounded division.

Linear: per group, scale = amax / fp8_max (1 for an all-zero group), values =
saturate(x / scale). Dynamic range expansion (COAT): per group, M = max|x|,
mu = min |x| over nonzero x, k = floor(16 log2 U / log2(M / mu)) / 16 bounded
to [1/4, 16] with U = fp8_max^2 / 2, values = saturate(sign(x) fp8_max
2^(k log2(|x| / M))); scale stores M, exponent stores k. Groups holding NaN
or Inf get a NaN scale and dequantize to NaN; all-zero groups get scale 1
(linear) or k = 1 and decode to exact zeros.
"""

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _common

# k is a multiple of 1/EXPANSION_STEPS in [K_MIN, K_MAX]: bounded so that
# constant groups (ratio 1, k -> inf) stay finite and exact, and so that
# dequantizing never underflows float32 in an intermediate. A group spanning
# more than U^4 (1e20 for E4M3) flushes its smallest values to zero, as plain
# FP8 would.
EXPANSION_STEPS = 16
K_MIN = 0.25
K_MAX = 16.0
# XLA rewrites x / c for a constant c into x * (1 / c), and lowers exp2(x) to
# exp(ln2 x): the constants below spell both out, so the same expressions
# round identically under XLA (eager or jit) and in the Pallas kernels.
LOG2_E = np.float32(1) / np.float32(np.log(2.0))
LN_2 = np.float32(np.log(2.0))
SCALE_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16))


def expansion_range(dtype: Any) -> float:
  """U = fp8_max^2 / 2 (100352 for E4M3, the official COAT constant)."""
  return _common.fp8_max(dtype) ** 2 / 2


def log2(x: jax.Array) -> jax.Array:
  """jnp.log2 as XLA computes it under jit: log(x) * (1 / ln 2)."""
  return jnp.log(x) * LOG2_E


def exp2(x: jax.Array) -> jax.Array:
  """jnp.exp2 as jax lowers it: exp(ln 2 * x)."""
  return jnp.exp(LN_2 * x)


def reciprocal(c: float) -> np.float32:
  """1 / c rounded once to float32, as XLA folds a division by a constant."""
  return np.float32(1) / np.float32(c)


def store_scale(
    scale: jax.Array, amax: jax.Array, scale_dtype: Any
) -> jax.Array:
  """Rounds the scale to its storage dtype; 1 where it is 0, NaN if amax is."""
  scale = scale.astype(scale_dtype)
  scale = jnp.where(scale > 0, scale, jnp.ones_like(scale))
  return jnp.where(jnp.isfinite(amax), scale, jnp.full_like(scale, jnp.nan))


def expansion_exponent(
    amax: jax.Array, amin_nonzero: jax.Array, dtype: Any,
    ops: _common.Ops = _common.XLA_OPS
) -> jax.Array:
  """k = floor(16 log2 U / log2 R) / 16, R = amax / amin, in [K_MIN, K_MAX].

  R == 1 (constant group, single nonzero) gives K_MAX; all-zero groups get 1.
  """
  log2_ratio = log2(amax) - log2(amin_nonzero)
  steps = jnp.floor(ops.div(
      EXPANSION_STEPS * math.log2(expansion_range(dtype)), log2_ratio))
  k = _common.clip(steps * reciprocal(EXPANSION_STEPS), K_MIN, K_MAX)
  return jnp.where(amax > 0, k, 1.0).astype(jnp.float32)


def encode_groups(
    groups: jax.Array, dtype: Any, expansion: bool, scale_dtype: Any,
    ops: _common.Ops = _common.XLA_OPS
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """Quantizes float32 groups (..., g) along the last axis.

  Returns:
    (values (..., g) FP8, scale (...) scale_dtype, exponent (...) float32 or
    None without expansion).
  """
  dt = _common.fp8_dtype(dtype)
  fmax = _common.fp8_max(dt)
  absx = jnp.abs(groups)
  amax = ops.max(absx, -1)
  if not expansion:
    scale = store_scale(amax * reciprocal(fmax), amax, scale_dtype)
    codes = ops.div(groups, scale.astype(jnp.float32)[..., None])
    return _common.saturate(codes, dt), scale, None
  amin = jnp.min(jnp.where(absx > 0, absx, jnp.inf), axis=-1)
  exponent = expansion_exponent(amax, amin, dt, ops)
  scale = store_scale(amax, amax, scale_dtype)
  # (|x| / M)^k in the log domain: no division (a multiply by 1/M would
  # flush to zero for M > 2^126), and exactly 1 at |x| == M.
  log2_ratio = log2(absx) - log2(scale.astype(jnp.float32))[..., None]
  codes = _common.with_sign_of(
      fmax * exp2(exponent[..., None] * log2_ratio), groups)
  return _common.saturate(codes, dt), scale, exponent


def decode_groups(
    groups: jax.Array, scale: jax.Array, exponent: jax.Array | None,
    fp8_max: float, ops: _common.Ops = _common.XLA_OPS
) -> jax.Array:
  """Inverse of `encode_groups` on float32 codes (..., g): float32 values."""
  scale = scale.astype(jnp.float32)[..., None]
  if exponent is None:
    return groups * scale
  # M (|q| / fp8_max)^(1/k) as M 2^(t/2) 2^(t/2): with k >= K_MIN neither
  # factor underflows, and |q| == fp8_max gives M exactly.
  half_t = ops.div(log2(jnp.abs(groups) * reciprocal(fp8_max)),
                   2 * exponent[..., None])
  out = _common.with_sign_of(scale, groups) * exp2(half_t)
  return out * exp2(half_t)


def num_groups(shape: tuple[int, ...], group_size: int) -> int:
  n = shape[-1] if shape else 1
  return max(1, math.ceil(n / group_size))


def scale_shape(shape: tuple[int, ...], group_size: int) -> tuple[int, ...]:
  """Shape of the per-group scale: shape[:-1] + (ceil(n / g),)."""
  return tuple(shape[:-1]) + (num_groups(shape, group_size),)


def _split_last_axis(x: jax.Array, groups: int, group_size: int) -> jax.Array:
  """(..., groups * group_size) -> (..., groups, group_size), sharding kept."""
  new_shape = x.shape[:-1] + (groups, group_size)
  spec = tuple(jax.typeof(x).sharding.spec)
  if any(s is not None for s in spec):  # Explicit sharding must be spelled out.
    spec += (None,) * (x.ndim - len(spec))
    out_sharding = jax.sharding.PartitionSpec(*spec, None)
    return jax.lax.reshape(x, new_shape, out_sharding=out_sharding)
  return x.reshape(new_shape)


def to_groups(x: jax.Array, group_size: int) -> jax.Array:
  """(..., n) -> (..., ceil(n / g), g), zero-padding the last group."""
  if x.ndim == 0:
    x = x.reshape(1)
  n = x.shape[-1]
  groups = max(1, math.ceil(n / group_size))
  pad = groups * group_size - n
  if pad:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
  return _split_last_axis(x, groups, group_size)


def from_groups(y: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Inverse of `to_groups`: (..., groups, g) -> `shape`."""
  n = shape[-1] if shape else 1
  spec = tuple(jax.typeof(y).sharding.spec)
  if any(s is not None for s in spec):
    out = jax.lax.reshape(
        y, y.shape[:-2] + (y.shape[-2] * y.shape[-1],),
        out_sharding=jax.sharding.PartitionSpec(*spec[:-1]))
  else:
    out = y.reshape(y.shape[:-2] + (y.shape[-2] * y.shape[-1],))
  return out[..., :n].reshape(shape)


def quantize_per_group(
    x: jax.Array, group_size: int = 128, dtype: Any = 'e4m3',
    expansion: bool = False, *, scale_dtype: Any = jnp.float32
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """Quantizes groups of `group_size` along the last axis (see module doc).

  Args:
    x: floating array of any shape (a 0-d array is one group).
    group_size: positive int; a partial last group is zero-padded.
    dtype: 'e4m3' or 'e5m2'.
    expansion: COAT's dynamic range expansion.
    scale_dtype: float32 or bfloat16.

  Returns:
    (values: x.shape FP8, scale: scale_shape(x.shape) scale_dtype,
    exponent: like scale, float32, or None without expansion).
  """
  groups = to_groups(jnp.asarray(x).astype(jnp.float32), group_size)
  values, scale, exponent = encode_groups(
      groups, dtype, expansion, scale_dtype)
  return from_groups(values, jnp.shape(x)), scale, exponent


def dequantize_per_group(
    values: jax.Array, scale: jax.Array, exponent: jax.Array | None,
    group_size: int, *, out_dtype: Any = jnp.float32
) -> jax.Array:
  """Inverse of `quantize_per_group`: an array of values.shape, out_dtype."""
  groups = to_groups(values.astype(jnp.float32), group_size)
  out = decode_groups(
      groups, scale, exponent, _common.fp8_max(values.dtype))
  return from_groups(out, values.shape).astype(out_dtype)
