"""Per-group FP8 quantization along the last axis: the pure-jnp reference.

This module holds the numerics (the 'xla' path and the oracle of the Pallas
kernel); `coat_jax.quant` builds its `QuantizedArray` API on it. The group
math (`encode_groups`, `decode_groups`) takes an `Ops` bundle so that the
Pallas kernels run the very same expressions, with the division that rounds
like XLA's.

Linear: per group, scale = amax / fp8_max (1 for an all-zero group), values =
saturate(x / scale). Dynamic range expansion (COAT): per group, M = max|x|
(as stored in the scale dtype), mu = min |x| over nonzero x,
k = floor(16 log2 U / log2(M / mu)) / 16 bounded to [1/4, 16] with
U = fp8_max^2 / 2, values = saturate(sign(x) fp8_max (|x| / M)^k); scale
stores M, exponent stores k; decoding is sign(q) M (|q| / fp8_max)^(1/k).
Groups holding NaN or Inf get a NaN scale (and k = 1) and dequantize to NaN;
all-zero groups get scale 1 (linear) or k = 1 and decode to exact zeros.

Cost: expansion makes the optimizer step compute-bound on the GPU, so the
expressions are chosen for few instructions per element: encoding takes one
log and one exp per element (two logs and a division per group), decoding
one exp (log2 |q| comes from the code's bits, 1/k is divided once per
group). None of them is a multiply-add, which XLA and Triton could contract
into FMAs differently.
"""

import math
from typing import Any

import jax
from jax import lax
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
LN_2 = np.float32(np.log(2.0))
# Power-of-two scales in one byte (MX's E8M0): exact rescaling.
E8M0 = np.dtype(jnp.float8_e8m0fnu)
SCALE_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), E8M0)
# Inside the Pallas kernels E8M0 scales travel as their bits (Triton has
# no E8M0 type): the biased exponent byte, 0xFF for NaN.
E8M0_BITS = np.dtype(np.uint8)


def check_scale_dtype(scale_dtype: Any, expansion: bool = False) -> np.dtype:
  """`scale_dtype` as a numpy dtype; ValueError unless float32, bfloat16 or
  float8_e8m0fnu (linear quantization only: expansion stores M itself)."""
  sd = np.dtype(scale_dtype)
  if sd not in SCALE_DTYPES:
    raise ValueError(
        f'scale_dtype={scale_dtype!r} is not supported: use jnp.float32,'
        ' jnp.bfloat16 or jnp.float8_e8m0fnu (powers of two).')
  if expansion and sd == E8M0:
    raise ValueError(
        'scale_dtype=float8_e8m0fnu rounds scales to powers of two, but'
        ' dynamic range expansion stores each group\'s max itself: use'
        ' jnp.float32 or jnp.bfloat16 with expansion=True.')
  return sd


def expansion_range(dtype: Any) -> float:
  """U = fp8_max^2 / 2 (100352 for E4M3, the official COAT constant)."""
  return _common.fp8_max(dtype) ** 2 / 2


def reciprocal(c: float) -> np.float32:
  """1 / c rounded once to float32, as XLA folds a division by a constant.

  The group math multiplies by such constants itself (and uses exp and log,
  never exp2 and log2, which jax and Triton lower differently), so that the
  same expressions round identically under XLA (eager or jit) and in the
  Pallas kernels.
  """
  return np.float32(1) / np.float32(c)


def pow2_ceil(s: jax.Array) -> jax.Array:
  """The power of two at or above float32 s >= 0, at least 2^-126; 0 and
  inf stay (NaN gives 0 or inf: `store_scale` restores it). Bit arithmetic:
  a nonzero mantissa carries into the exponent."""
  bits = lax.bitcast_convert_type(s, jnp.int32)
  return lax.bitcast_convert_type(
      (bits + np.int32(0x7FFFFF)) & np.int32(0x7F800000), jnp.float32)


def e8m0_bits(scale: jax.Array) -> jax.Array:
  """The E8M0 byte (uint8) of a float32 power of two >= 2^-126, or of NaN
  (0xFF): the biased exponent, as `scale.astype(float8_e8m0fnu)` stores it."""
  bits = lax.bitcast_convert_type(scale, jnp.int32)
  return (lax.shift_right_logical(bits, 23) & 0xFF).astype(jnp.uint8)


def scale_as_float32(scale: jax.Array) -> jax.Array:
  """A stored scale as float32; `E8M0_BITS` bytes decoded as E8M0 (0xFF is
  NaN, 0x00 is 2^-127)."""
  if scale.dtype != E8M0_BITS:
    return scale.astype(jnp.float32)
  b = scale.astype(jnp.int32)
  f = lax.bitcast_convert_type(lax.shift_left(b, 23), jnp.float32)
  f = jnp.where(b == 0, np.float32(2.0**-127), f)
  return jnp.where(b == 0xFF, np.float32(np.nan), f)


def store_scale(
    scale: jax.Array, amax: jax.Array, scale_dtype: Any
) -> jax.Array:
  """Rounds the scale to its storage dtype (E8M0: up to a power of two, so
  no code passes fp8_max; `E8M0_BITS`: the same, as bytes); 1 where it is
  0, NaN if amax is not finite, and never subnormal: a subnormal scale
  (amax below fp8_max * 2^-126) becomes 2^-126. The GPU kernels divide by
  the scale with div.full.f32, which flushes a subnormal divisor to zero
  and would turn the group into inf and NaN codes.

  Exact additions instead of `jnp.where(..., 1.0, ...)`, whose broadcast
  constants jax would hoist out of a scanned layer (see `_common.clamp`):
  scale >= 0 gains 1 only where it is 0, and amax - amax is 0 for a finite
  amax and NaN otherwise.
  """
  if np.dtype(scale_dtype) in (E8M0, E8M0_BITS):  # no zero: add in float32
    scale = pow2_ceil(scale)
    scale = scale + (scale == 0).astype(scale.dtype)
    scale = scale + (amax - amax)
    return (scale.astype(E8M0) if np.dtype(scale_dtype) == E8M0
            else e8m0_bits(scale))
  scale = scale.astype(scale_dtype)
  scale = scale + (scale == 0).astype(scale.dtype)
  scale = jnp.maximum(scale, np.asarray(jnp.finfo(scale_dtype).smallest_normal,
                                        scale.dtype))
  return scale + (amax - amax).astype(scale.dtype)


def expansion_exponent(
    log_ratio: jax.Array, dtype: Any, ops: _common.Ops = _common.XLA_OPS
) -> jax.Array:
  """k = floor(16 log2 U / log2 R) / 16 in [K_MIN, K_MAX], from ln R.

  ln R = ln M - ln mu. R == 1 (constant group, single nonzero) gives K_MAX; a
  negative or NaN ln R (all-zero and non-finite groups) gives 1.
  """
  steps = jnp.floor(ops.div(
      EXPANSION_STEPS * math.log(expansion_range(dtype)), log_ratio))
  k = ops.clip(steps * reciprocal(EXPANSION_STEPS), K_MIN, K_MAX)
  return jnp.where(log_ratio >= 0, k, 1.0).astype(jnp.float32)


def _code_format(dtype: Any) -> tuple[int, int]:
  """(mantissa bits, e) of an FP8 format whose max is 1.75 * 2^e."""
  dt = _common.fp8_dtype(dtype)
  e_max = math.log2(_common.fp8_max(dt) / 1.75)
  assert e_max == int(e_max), dt
  return int(jnp.finfo(dt).nmant), int(e_max)


def _select_by_bits(
    bits: jax.Array, lowest: int, table: np.ndarray
) -> jax.Array:
  """table[j] for j the n bits of int32 `bits` from `lowest` (2^n = len)."""
  values = list(np.asarray(table, np.float32))
  bit = lowest
  while len(values) > 1:
    on = (bits & (1 << bit)) != 0
    values = [jnp.where(on, hi, lo)
              for lo, hi in zip(values[::2], values[1::2])]
    bit += 1
  return values[0]


def code_log2(codes: jax.Array, dtype: Any) -> jax.Array:
  """log2(|q| / fp8_max) of FP8 codes q given as float32; -inf at q == 0.

  |q| = 2^e (1 + j / 2^n) in float32 (FP8 subnormals included) with n = 3
  (E4M3) or 2 (E5M2) mantissa bits, and fp8_max = 1.75 * 2^e_max, so the
  result is (e - e_max) + (log2(1 + j / 2^n) - log2 1.75): integer ops, a
  table lookup by selects and one rounded addition, no log (and no libm, so
  XLA and Triton agree bit for bit). Codes are finite: NaN codes only occur
  in groups whose scale is NaN.
  """
  mant_bits, e_max = _code_format(dtype)
  bits = lax.bitcast_convert_type(codes, jnp.int32)
  biased = lax.shift_right_logical(bits, 23) & 0xFF
  j = np.arange(2**mant_bits)
  table = np.log2(1 + j / 2**mant_bits) - np.log2(1.75)
  frac = _select_by_bits(bits, 23 - mant_bits, table)
  # (biased - 127 - e_max) as float32 without an int -> float convert (those
  # run at quarter rate on the GPU): 2^23 + biased, then an exact subtraction.
  whole = (lax.bitcast_convert_type(biased | 0x4B000000, jnp.float32)
           - np.float32(2**23 + 127 + e_max))
  return jnp.where(codes == 0, -jnp.inf, whole + frac)


def _decode_factors(dtype: Any) -> int:
  """n such that M 2^t = M (2^(t/n))^n keeps 2^(t/n) a normal float32.

  t = log2(|q| / fp8_max) / k >= log2(smallest code / fp8_max) / K_MIN:
  -71 for E4M3 (n = 1), -127 for E5M2 (n = 2).
  """
  dt = _common.fp8_dtype(dtype)
  smallest = float(jnp.finfo(dt).smallest_subnormal)
  t_min = math.log2(smallest / _common.fp8_max(dt)) / K_MIN
  return math.ceil(t_min / -125)


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
  amax = _common.abs_max(absx, -1)
  if not expansion:
    scale = store_scale(amax * reciprocal(fmax), amax, scale_dtype)
    codes = ops.div(groups, scale_as_float32(scale)[..., None])
    return _common.saturate(codes, dt, ops), scale, None
  # (|x| / M)^k = exp(k (ln|x| - ln M)), M as stored: no division (a
  # multiply by 1/M would flush for M > 2^126), and |x| == M gives exactly
  # fp8_max. ln M is 0 for all-zero groups (M = 1), NaN for non-finite ones.
  scale = store_scale(amax, amax, scale_dtype)
  log_scale = jnp.log(scale.astype(jnp.float32))
  amin = jnp.min(jnp.where(absx > 0, absx, jnp.inf), -1)
  exponent = expansion_exponent(log_scale - jnp.log(amin), dt, ops)
  codes = fmax * jnp.exp(
      (jnp.log(absx) - log_scale[..., None]) * exponent[..., None])
  if np.dtype(scale_dtype) != np.float32:
    # Saturate: a bf16 scale rounded below max |x| takes codes past fp8_max.
    # With M = max |x| itself, codes <= fp8_max (an exp rounded up to 1 + ulp
    # still casts to fp8_max), so no clip is needed.
    codes = ops.clip(codes, 0.0, fmax)
  return _common.with_sign_of(codes, groups).astype(dt), scale, exponent


def decode_groups(
    groups: jax.Array, scale: jax.Array, exponent: jax.Array | None,
    dtype: Any, ops: _common.Ops = _common.XLA_OPS
) -> jax.Array:
  """Inverse of `encode_groups` on float32 codes (..., g) of FP8 `dtype`."""
  scale = scale_as_float32(scale)[..., None]
  if exponent is None:
    return groups * scale
  # M (|q| / fp8_max)^(1/k) = M exp(log2(|q| / fp8_max) ln2 / k), as
  # M f^n with f = exp(. / n) so that f never underflows (n: _decode_factors).
  # |q| == fp8_max gives f = 1, hence M exactly.
  n = _decode_factors(dtype)
  rate = ops.div(float(LN_2 / n), exponent)[..., None]
  factor = jnp.exp(code_log2(groups, dtype) * rate)
  out = scale * factor
  for _ in range(n - 1):
    out = out * factor
  return _common.with_sign_of(out, groups)


def num_groups(shape: tuple[int, ...], group_size: int) -> int:
  n = shape[-1] if shape else 1
  return max(1, math.ceil(n / group_size))


def scale_shape(shape: tuple[int, ...], group_size: int) -> tuple[int, ...]:
  """Shape of the per-group scale: shape[:-1] + (ceil(n / g),)."""
  return tuple(shape[:-1]) + (num_groups(shape, group_size),)


def _split_last_axis(x: jax.Array, groups: int, group_size: int) -> jax.Array:
  """(..., groups * group_size) -> (..., groups, group_size), sharding kept."""
  new_shape = x.shape[:-1] + (groups, group_size)
  spec = _common.explicit_spec(x)
  if spec is not None:  # Explicit sharding must be spelled out.
    out_sharding = jax.sharding.PartitionSpec(*spec, None)
    return jax.lax.reshape(x, new_shape, out_sharding=out_sharding)
  return x.reshape(new_shape)


def to_groups(x: jax.Array, group_size: int) -> jax.Array:
  """(..., n) -> (..., ceil(n / g), g), zero-padding the last group.

  With explicit sharding the groups axis takes the last axis's sharding
  where it divides the number of groups; otherwise that axis is gathered
  first (a group spans shards), so the scales' last axis is replicated.
  """
  if x.ndim == 0:
    x = x.reshape(1)
  n = x.shape[-1]
  groups = max(1, math.ceil(n / group_size))
  spec = _common.explicit_spec(x)
  if spec is not None and groups % _common.mesh_size(x, spec[-1]):
    x = _common.with_spec(x, spec[:-1] + (None,))
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
  # Not out[..., :n]: outside jit, jnp indexing of an explicitly sharded
  # array is a gather that cannot infer its output sharding.
  return lax.slice_in_dim(out, 0, n, axis=-1).reshape(shape)


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
    scale_dtype: float32, bfloat16 or float8_e8m0fnu (without expansion).

  Returns:
    (values: x.shape FP8, scale: scale_shape(x.shape) scale_dtype,
    exponent: like scale, float32, or None without expansion).
  """
  check_scale_dtype(scale_dtype, expansion)
  groups = to_groups(jnp.asarray(x).astype(jnp.float32), group_size)
  values, scale, exponent = encode_groups(
      groups, dtype, expansion, scale_dtype)
  values = _common.with_spec(from_groups(values, jnp.shape(x)),
                             _common.explicit_spec(x))
  return values, scale, exponent


def dequantize_per_group(
    values: jax.Array, scale: jax.Array, exponent: jax.Array | None,
    group_size: int, *, out_dtype: Any = jnp.float32
) -> jax.Array:
  """Inverse of `quantize_per_group`: an array of values.shape, out_dtype."""
  groups = to_groups(values.astype(jnp.float32), group_size)
  out = decode_groups(groups, scale, exponent, values.dtype)
  out = _common.with_spec(from_groups(out, values.shape),
                          _common.explicit_spec(values))
  return out.astype(out_dtype)
