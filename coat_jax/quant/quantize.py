"""Per-tensor and per-group FP8 quantization, with dynamic range expansion.

Pure jnp: these functions are the numerics of the library and the references
that the Pallas kernels are tested against. All arithmetic is float32.
"""

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from coat_jax.quant.formats import fp8_dtype
from coat_jax.quant.formats import fp8_max
from coat_jax.quant.formats import saturating_cast
from coat_jax.quant.quantized_array import QuantizedArray

# Dynamic range expansion picks k as a multiple of 1/EXPANSION_STEPS, inside
# [K_MIN, K_MAX]: bounded so that constant groups (ratio 1, k -> inf) stay
# finite and exact, and so that dequantizing never underflows float32 in an
# intermediate. A group spanning more than U^4 (1e20 for E4M3) flushes its
# smallest values to zero, as plain FP8 would.
EXPANSION_STEPS = 16
K_MIN = 0.25
K_MAX = 16.0

_SCALE_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16))


def expansion_range(dtype: Any) -> float:
  """The ratio U = fp8_max^2 / 2 that an expanded group may span.

  For E4M3 this is 448^2 / 2 = 100352, the constant of COAT's official kernel:
  the smallest nonzero element of a group lands at >= fp8_max / U, well above
  the format's smallest subnormal.
  """
  return fp8_max(dtype) ** 2 / 2


def _check_group_size(group_size: Any) -> int:
  if (isinstance(group_size, bool)
      or not isinstance(group_size, int | np.integer) or group_size <= 0):
    raise ValueError(
        f'group_size={group_size!r} must be a positive integer, e.g. 128 for'
        ' optimizer states or 16 for activations.')
  return int(group_size)


def _check_scale_dtype(scale_dtype: Any) -> np.dtype:
  dt = np.dtype(scale_dtype)
  if dt not in _SCALE_DTYPES:
    raise ValueError(
        f'scale_dtype={scale_dtype!r} is not supported: use jnp.float32 or'
        ' jnp.bfloat16.')
  return dt


def _check_input(x: Any) -> jax.Array:
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(
        f'x has dtype {x.dtype}; quantization needs a floating-point array'
        ' (cast integers with x.astype(jnp.float32) first).')
  return x


def _store_scale(scale: jax.Array, amax: jax.Array, scale_dtype) -> jax.Array:
  """Rounds the scale to its storage dtype; 1 where it is 0, NaN if amax is."""
  scale = scale.astype(scale_dtype)
  scale = jnp.where(scale > 0, scale, jnp.ones_like(scale))
  return jnp.where(jnp.isfinite(amax), scale, jnp.full_like(scale, jnp.nan))


def quantize_per_tensor(
    x: jax.Array, dtype: Any = 'e4m3', *, scale_dtype=jnp.float32
) -> QuantizedArray:
  """Quantizes with one current scale for the whole tensor.

  scale = amax(|x|) / fp8_max (1 if x is all zeros); values =
  saturating_cast(x / scale). A NaN or Inf anywhere makes the scale NaN, so
  the whole tensor dequantizes to NaN rather than hiding the fault.

  Args:
    x: floating array of any shape.
    dtype: 'e4m3' or 'e5m2'.
    scale_dtype: float32 or bfloat16. The division uses the stored (rounded)
      scale, so dequantization is consistent with it.

  Returns:
    QuantizedArray with `scale.shape == ()` and `group_size=None`.
  """
  dt = fp8_dtype(dtype)
  scale_dtype = _check_scale_dtype(scale_dtype)
  x = _check_input(x).astype(jnp.float32)
  amax = jnp.max(jnp.abs(x)) if x.size else jnp.float32(0)
  scale = _store_scale(amax / fp8_max(dt), amax, scale_dtype)
  values = saturating_cast(x / scale.astype(jnp.float32), dt)
  return QuantizedArray(values, scale)


def _split_last_axis(x: jax.Array, groups: int, group_size: int) -> jax.Array:
  """(..., groups * group_size) -> (..., groups, group_size), sharding kept."""
  new_shape = x.shape[:-1] + (groups, group_size)
  spec = tuple(jax.typeof(x).sharding.spec)
  if any(s is not None for s in spec):  # Explicit sharding must be spelled out.
    spec += (None,) * (x.ndim - len(spec))
    out_sharding = jax.sharding.PartitionSpec(*spec, None)
    return jax.lax.reshape(x, new_shape, out_sharding=out_sharding)
  return x.reshape(new_shape)


def _to_groups(x: jax.Array, group_size: int) -> jax.Array:
  """(..., n) -> (..., ceil(n / g), g), zero-padding the last group."""
  if x.ndim == 0:
    x = x.reshape(1)
  n = x.shape[-1]
  groups = max(1, math.ceil(n / group_size))
  pad = groups * group_size - n
  if pad:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
  return _split_last_axis(x, groups, group_size)


def _from_groups(y: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Inverse of `_to_groups`: (..., groups, g) -> `shape`."""
  n = shape[-1] if shape else 1
  spec = tuple(jax.typeof(y).sharding.spec)
  if any(s is not None for s in spec):
    out = jax.lax.reshape(
        y, y.shape[:-2] + (y.shape[-2] * y.shape[-1],),
        out_sharding=jax.sharding.PartitionSpec(*spec[:-1]))
  else:
    out = y.reshape(y.shape[:-2] + (y.shape[-2] * y.shape[-1],))
  return out[..., :n].reshape(shape)


def _expansion_exponent(
    amax: jax.Array, amin_nonzero: jax.Array, dtype: np.dtype
) -> jax.Array:
  """k = floor(16 log2 U / log2 R) / 16 in [K_MIN, K_MAX], R = amax / amin.

  R == 1 (constant group, single nonzero) gives K_MAX; all-zero groups get 1.
  """
  log2_ratio = jnp.log2(amax) - jnp.log2(amin_nonzero)
  steps = jnp.floor(
      EXPANSION_STEPS * math.log2(expansion_range(dtype)) / log2_ratio)
  k = jnp.clip(steps / EXPANSION_STEPS, K_MIN, K_MAX)
  return jnp.where(amax > 0, k, 1.0).astype(jnp.float32)


def quantize_per_group(
    x: jax.Array,
    group_size: int = 128,
    dtype: Any = 'e4m3',
    expansion: bool = False,
    *,
    scale_dtype=jnp.float32,
) -> QuantizedArray:
  """Quantizes groups of `group_size` consecutive elements of the last axis.

  Linear (expansion=False): per group, scale = amax / fp8_max (1 for an
  all-zero group) and values = saturating_cast(x / scale).

  Dynamic range expansion (COAT, expansion=True): per group, with M = max|x|
  and mu = min |x| over the nonzero x, R = M / mu, U = fp8_max^2 / 2,
  k = floor(16 log2 U / log2 R) / 16 bounded to [1/4, 16], values =
  saturating_cast(sign(x) fp8_max (|x| / M)^k); `scale` stores M and
  `exponent` stores k. This is COAT's map q = sign(x) (|x|/c)^k / S with
  c = sqrt(M mu) and S = (M/c)^k / fp8_max, written without c (it cancels),
  which makes the group max, constant groups and single nonzeros exact.

  Args:
    x: floating array of any shape; the groups run along the last axis, so a
      quantized parameter keeps its sharding. A last axis that is not a
      multiple of `group_size` gets a zero-padded partial last group (zeros
      change neither the max nor the nonzero min); a 0-d array is one group.
    group_size: positive int.
    dtype: 'e4m3' or 'e5m2'.
    expansion: use dynamic range expansion.
    scale_dtype: float32 or bfloat16, the storage dtype of `scale`.

  Returns:
    QuantizedArray; see its docstring for shapes. Groups holding NaN or Inf
    get a NaN scale and dequantize to NaN.
  """
  group_size = _check_group_size(group_size)
  dt = fp8_dtype(dtype)
  scale_dtype = _check_scale_dtype(scale_dtype)
  x = _check_input(x)
  groups = _to_groups(x.astype(jnp.float32), group_size)
  absx = jnp.abs(groups)
  amax = jnp.max(absx, axis=-1)
  if not expansion:
    scale = _store_scale(amax / fp8_max(dt), amax, scale_dtype)
    codes = groups / scale.astype(jnp.float32)[..., None]
    values = saturating_cast(_from_groups(codes, x.shape), dt)
    return QuantizedArray(values, scale, None, group_size)

  amin = jnp.min(jnp.where(absx > 0, absx, jnp.inf), axis=-1)
  exponent = _expansion_exponent(amax, amin, dt)
  scale = _store_scale(amax, amax, scale_dtype)
  # (|x| / M)^k in the log domain: no division (XLA may turn it into a
  # multiply by 1/M, which flushes to zero for M > 2^126), and exactly 1 at
  # |x| == M.
  log2_ratio = jnp.log2(absx) - jnp.log2(scale.astype(jnp.float32))[..., None]
  codes = (jnp.sign(groups) * fp8_max(dt)
           * jnp.exp2(exponent[..., None] * log2_ratio))
  values = saturating_cast(_from_groups(codes, x.shape), dt)
  return QuantizedArray(values, scale, exponent, group_size)


def dequantize(q: QuantizedArray, dtype=jnp.float32) -> jax.Array:
  """Reconstructs the array: values * scale, or the inverse expansion.

  Args:
    q: a QuantizedArray from `quantize_per_tensor` or `quantize_per_group`.
    dtype: the floating dtype of the result.

  Returns:
    Array of shape `q.shape` and dtype `dtype`.
  """
  if not isinstance(q, QuantizedArray):
    raise TypeError(
        f'q must be a QuantizedArray (from quantize_per_tensor or'
        f' quantize_per_group), got {type(q).__name__}.')
  values = q.values.astype(jnp.float32)
  scale = q.scale.astype(jnp.float32)
  if q.group_size is None:
    return (values * scale).astype(dtype)
  groups = _to_groups(values, q.group_size)
  if q.exponent is None:
    out = groups * scale[..., None]
  else:
    # M (|q| / fp8_max)^(1/k) as M 2^(t/2) 2^(t/2): with k >= K_MIN neither
    # factor underflows, and |q| == fp8_max gives M exactly.
    half_t = (jnp.log2(jnp.abs(groups) / fp8_max(q.dtype))
              / (2 * q.exponent[..., None]))
    out = jnp.sign(groups) * scale[..., None] * jnp.exp2(half_t)
    out = out * jnp.exp2(half_t)
  return _from_groups(out, q.shape).astype(dtype)
