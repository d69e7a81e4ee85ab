"""The group math with expansion in the log2 domain: the optimizer kernels'.

The contract of `reference.encode_groups` / `decode_groups` with expansion
(M = max |x| as stored, k the exponent, fmax the FP8 max), rearranged so that
per element there is one log2 and one exp2 each way, with a multiply-add
(encode) or a subtraction and a multiply (decode), and a multiply by s or M:

  encode: q = sign(x) exp2(k log2(s |x|) + c),
          c = log2 fmax - k log2(s M)                        (per group)
  decode: x = sign(q) M exp2((log2 |q| - log2 fmax) r),
          r = 1 / k                                          (per group)

Everything else (the exponent, c, r) is computed once per group. s = 2^24
(1 for M >= 2^104) lifts float32 subnormals so that a log2 that flushes them
(the GPU's lg2.approx.ftz) still sees them; it cannot overflow. The group
min over nonzero |x| is an unsigned min over the bits of |x| minus one (a
zero wraps to the largest value), the max a signed max over the bits, as
`_common.abs_max`.

`ops.log2` and `ops.exp2` are base-2 log and exp (on the GPU the approximate
instructions, `_common.approx_log2`, `_common.approx_exp2`; jnp's to test it
elsewhere). Not the reference's rounding chain: held to its tolerances (codes
within a step or two in rare elements, exponents within one step of 1/16,
scales exact). With exp2 flushing subnormal results, a decoded factor
below 2^-126 (E5M2 codes below 2^-15 in groups with k = 1/4, worth less than
M 2^-126) decodes to zero.
"""

from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _common
from pallas_kernels.quantize_per_group import reference

_LIFT = 24  # log2 s: subnormals (>= 2^-149) become normal
_LIFT_BELOW = np.float32(2.0**104)  # M < this: s |x| stays finite


def _log2_group(x: jax.Array, ops: _common.Ops) -> jax.Array:
  """log2 of per-group values > 0 (subnormals, +inf and NaN included), with
  `ops.log2`: lifted by 2^24 below 2^-100."""
  tiny = x < np.float32(2.0**-100)
  lifted = jnp.where(tiny, x * np.float32(2.0**_LIFT), x)
  return ops.log2(lifted) - jnp.where(tiny, np.float32(_LIFT), 0.0)


def encode_groups(
    groups: jax.Array, dtype: Any, scale_dtype: Any, ops: _common.Ops
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`reference.encode_groups` with expansion, on float32 groups (..., g).

  Returns:
    (values (..., g) FP8, scale (...) scale_dtype, exponent (...) float32).
  """
  dt = _common.fp8_dtype(dtype)
  fmax = _common.fp8_max(dt)
  absx = jnp.abs(groups)
  bits = lax.bitcast_convert_type(absx, jnp.int32)
  amax = lax.bitcast_convert_type(jnp.max(bits, -1), jnp.float32)
  low = jnp.min(lax.bitcast_convert_type(bits, jnp.uint32) - np.uint32(1), -1)
  amin = jnp.where(low == np.uint32(2**32 - 1), jnp.inf,
                   lax.bitcast_convert_type(low + np.uint32(1), jnp.float32))
  scale = reference.store_scale(amax, amax, scale_dtype)
  m = scale.astype(jnp.float32)
  log2_m = _log2_group(m, ops)
  # ln R as the reference takes it (all-zero groups: M = 1, min = inf).
  exponent = reference.expansion_exponent(
      (log2_m - _log2_group(amin, ops)) * reference.LN_2, dt, ops)
  lift = m < _LIFT_BELOW
  s = jnp.where(lift, np.float32(2.0**_LIFT), np.float32(1))
  c = np.float32(np.log2(fmax)) - exponent * (
      log2_m + jnp.where(lift, np.float32(_LIFT), np.float32(0)))
  codes = ops.exp2(ops.log2(absx * s[..., None]) * exponent[..., None]
                   + c[..., None])
  if np.dtype(scale_dtype) != np.float32:  # see reference.encode_groups
    codes = ops.clip(codes, 0.0, fmax)
  return _common.with_sign_of(codes, groups).astype(dt), scale, exponent


def decode_groups(
    groups: jax.Array, scale: jax.Array, exponent: jax.Array, dtype: Any,
    ops: _common.Ops
) -> jax.Array:
  """`reference.decode_groups` with expansion: float32 codes (..., g) of FP8
  `dtype`, scale and exponent (...) -> float32 (..., g)."""
  r = ops.div(np.float32(1), exponent)
  # M exp2(.) rather than exp2(. + log2 M): the argument stays small (its
  # rounding is relative 1e-6, not 1e-5 at M ~ 2^-90) and <= 0; |q| = fmax
  # gives exp2(0 * r) = 1 (fmax's log2 by the same instruction), so M
  # exactly, as in the reference.
  log2_fmax = ops.log2(jnp.full(
      (1,) * groups.ndim, _common.fp8_max(dtype), jnp.float32))
  code_log2 = ops.log2(jnp.abs(groups)) - log2_fmax
  factor = ops.exp2(code_log2 * r[..., None])
  out = scale.astype(jnp.float32)[..., None] * factor
  return _common.with_sign_of(out, groups)
