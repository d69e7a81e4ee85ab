"""FP8 RMSNorm forward and backward (COAT's 1x16 residual): public entry.

`rms_norm_fp8_fwd` also returns amax |y| (float32, NaN if y holds NaN):
pass it as `amax=` to the per-tensor quantizer of the GEMM that reads y.
`rms_norm_fp8_bwd` returns amax |dx| likewise, for the quantizer of the
gradient of the GEMM that produced x.

Each direction is one pass of the kernel. XLA takes the row sums, then y
with x's groups and amax |y|, then the group scales forward; and three
passes backward (row sums, dx, dscale's column sums), where the kernel also
adds the residual stream's gradient (`residual_grad`).
"""

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import dispatch
from pallas_kernels.quantize_per_group import reference as group_reference
from pallas_kernels.rms_norm_fp8 import reference

# A whole row is one block: rows wider than this are left to XLA.
MAX_PALLAS_COLS = 16384


def _check(x: jax.Array, scale: jax.Array, group_size: int, what: str):
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f'{what} has dtype {x.dtype}; RMSNorm needs floating'
                    ' inputs.')
  if x.ndim < 1 or scale.shape != x.shape[-1:]:
    raise ValueError(f'scale has shape {scale.shape}; expected'
                     f' ({x.shape[-1] if x.ndim else 1},) to match'
                     f' {what}.shape[-1].')
  if (isinstance(group_size, bool)
      or not isinstance(group_size, int | np.integer) or group_size <= 0):
    raise ValueError(f'group_size={group_size!r} must be a positive integer'
                     ' (16 for COAT).')


def _use_pallas(implementation: str | None, group_size: int,
                shape: tuple[int, ...]):
  impl, interpret = dispatch.resolve_implementation('rms_norm_fp8',
                                                    implementation)
  # Blocks hold whole groups and Triton blocks are powers of two; an empty
  # array has no program to run.
  ok = (group_size & (group_size - 1) == 0 and shape[-1] <= MAX_PALLAS_COLS
        and math.prod(shape) > 0)
  return impl == 'pallas' and ok, interpret


def rms_norm_fp8_fwd(
    x: jax.Array, scale: jax.Array, eps: float = 1e-5, *,
    group_size: int = reference.GROUP_SIZE, scale_dtype: Any = jnp.bfloat16,
    implementation: str | None = None
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
  """RMSNorm of the last axis, x's E4M3 groups and amax |y|, in one pass.

  Args:
    x: (..., H) bfloat16 or float32.
    scale: (H,) gain.
    eps: added to the mean square.
    group_size: elements per group of x's E4M3 copy (16 for COAT).
    scale_dtype: float32, bfloat16 or float8_e8m0fnu, the group
      scales' dtype.
    implementation: None (fastest available), 'xla' or 'pallas'.

  Returns:
    (y (..., H) x.dtype, codes (..., H) float8_e4m3fn, scales (...,
    ceil(H / group_size)) scale_dtype, rstd (..., 1) float32, amax |y| ()
    float32).
  """
  _check(x, scale, group_size, 'x')
  sd = group_reference.check_scale_dtype(scale_dtype)
  use, interpret = _use_pallas(implementation, group_size, x.shape)
  if use:
    from pallas_kernels.rms_norm_fp8 import pallas_triton
    return pallas_triton.rms_norm_fp8_fwd(
        x, scale, float(eps), group_size=group_size, scale_dtype=sd,
        interpret=interpret)
  return reference.rms_norm_fp8_fwd(
      x, scale, eps, group_size=group_size, scale_dtype=sd)


def rms_norm_fp8_bwd(
    codes: jax.Array, scales: jax.Array, rstd: jax.Array, scale: jax.Array,
    g: jax.Array, *, residual_grad: jax.Array | None = None,
    group_size: int = reference.GROUP_SIZE,
    implementation: str | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """dx, dscale and amax |dx| of `rms_norm_fp8_fwd`'s saved groups, one
  pass.

  Args:
    codes, scales, rstd: from `rms_norm_fp8_fwd`.
    scale: (H,) gain.
    g: (..., H) gradient of y.
    residual_grad: None, or (..., H) in g.dtype, added to dx in float32
      (the residual stream's gradient of a pre-norm block).
    group_size: the forward pass's group size.
    implementation: None (fastest available: the Pallas kernel on one
      Hopper GPU), 'xla' or 'pallas'.

  Returns:
    (dx (..., H) g.dtype, dscale (H,) float32, amax |dx| () float32, NaN if
    dx holds NaN).
  """
  _check(g, scale, group_size, 'g')
  ng = -(-g.shape[-1] // group_size)
  if (codes.shape != g.shape or codes.dtype != np.dtype(jnp.float8_e4m3fn)
      or scales.shape != g.shape[:-1] + (ng,)
      or rstd.shape != g.shape[:-1] + (1,)):
    raise ValueError(
        f'codes {codes.shape} {codes.dtype}, scales {scales.shape} and rstd'
        f' {rstd.shape} must be the forward outputs for g {g.shape}: E4M3'
        f' codes of g\'s shape, scales (..., {ng}), rstd (..., 1).')
  if residual_grad is not None and (residual_grad.shape != g.shape
                                    or residual_grad.dtype != g.dtype):
    raise ValueError(
        f'residual_grad has shape {residual_grad.shape} and dtype'
        f' {residual_grad.dtype}; it must match g ({g.shape}, {g.dtype}).')
  use, interpret = _use_pallas(implementation, group_size, g.shape)
  if use:
    from pallas_kernels.rms_norm_fp8 import pallas_triton
    return pallas_triton.rms_norm_fp8_bwd(
        codes, scales, rstd, scale, g, residual_grad=residual_grad,
        group_size=group_size, interpret=interpret)
  return reference.rms_norm_fp8_bwd(
      codes, scales, rstd, scale, g, residual_grad=residual_grad,
      group_size=group_size)
