"""FP8 RMSNorm (COAT): the pure-jnp reference of the forward and backward.

The math of `coat_jax.nn.norm.fp8_rms_norm`, unchanged (it is the
specification of the kernels): y = x * rsqrt(mean(x^2) + eps) * scale in
float32, cast to x.dtype; the backward pass gets x back from its 1x16 E4M3
groups (bfloat16 scales) and rstd. Besides, the forward pass returns
amax |y| (float32; NaN if y holds NaN): the per-tensor scale of the FP8 GEMM
that reads y, so that its quantizer needs no amax pass of its own; the
backward pass returns amax |dx| likewise, for the FP8 GEMM whose output x
was (`coat_jax.nn.norm`'s grad_amax_slot).
"""

from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import _common
from pallas_kernels.quantize_per_group import reference as group_reference

GROUP_SIZE = 16
FP8 = 'e4m3'


def rms_norm_fp8_fwd(
    x: jax.Array, scale: jax.Array, eps: float, *,
    group_size: int = GROUP_SIZE, scale_dtype: Any = jnp.bfloat16
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
  """RMSNorm of the last axis and x's FP8 groups.

  Args:
    x: (..., H) floating input.
    scale: (H,) gain.
    eps: added to the mean square.
    group_size: elements per group of x's E4M3 copy.
    scale_dtype: dtype of the group scales.

  Returns:
    (y (..., H) x.dtype, codes (..., H) float8_e4m3fn, scales (...,
    ceil(H / group_size)) scale_dtype, rstd (..., 1) float32, amax |y| ()
    float32).
  """
  xf = x.astype(jnp.float32)
  rstd = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  y = (xf * rstd * scale.astype(jnp.float32)).astype(x.dtype)
  codes, scales, _ = group_reference.quantize_per_group(
      x, group_size, FP8, scale_dtype=scale_dtype)
  return y, codes, scales, rstd, _common.tensor_abs_max(y)


def rms_norm_fp8_bwd(
    codes: jax.Array, scales: jax.Array, rstd: jax.Array, scale: jax.Array,
    g: jax.Array, *, residual_grad: jax.Array | None = None,
    group_size: int = GROUP_SIZE
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Gradients of `rms_norm_fp8_fwd`'s y from its saved FP8 groups.

  Args:
    codes, scales: x's groups from the forward pass.
    rstd: (..., 1) float32 from the forward pass.
    scale: (H,) gain.
    g: (..., H) gradient of y.
    residual_grad: None, or (..., H) in g.dtype: the gradient that reaches x
      by another path (a pre-norm block's residual stream), added to dx in
      float32 before dx is rounded to g.dtype.
    group_size: the group size of the forward pass.

  Returns:
    (dx (..., H) g.dtype, dscale (H,) float32, amax |dx| () float32 of dx
    as returned, NaN if dx holds NaN).
  """
  x = group_reference.dequantize_per_group(codes, scales, None, group_size)
  x_hat = x * rstd
  gf = g.astype(jnp.float32)
  g_hat = gf * scale.astype(jnp.float32)
  dx = rstd * (g_hat - x_hat * jnp.mean(g_hat * x_hat, axis=-1, keepdims=True))
  if residual_grad is not None:
    dx = dx + residual_grad.astype(jnp.float32)
  dscale = jnp.sum((gf * x_hat).reshape(-1, x_hat.shape[-1]), axis=0)
  dx = dx.astype(g.dtype)
  return dx, dscale, _common.tensor_abs_max(dx)
