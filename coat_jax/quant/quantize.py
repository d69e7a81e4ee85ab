"""Per-tensor, per-group (with dynamic range expansion) and block-scaled
(1x128 tiles, 128x128 blocks) FP8 quantization.

The numerics are the pure-jnp references in `pallas_kernels` (they are the
oracles of the Pallas kernels too, so there is one copy of the math); this
module returns them as `QuantizedArray`s. `implementation='xla'` (the
default) runs the references; 'pallas' the Pallas kernels (Triton-lowered,
interpreted off GPU; the one-pass block quantizer runs as Mosaic GPU on a
GPU where it can); None the fastest measured on this platform.
"""

from typing import Any

import jax
import jax.numpy as jnp

from coat_jax.quant.quantized_array import QuantizedArray
from pallas_kernels.quantize_blockwise import api as blockwise_api
from pallas_kernels.quantize_blockwise import reference as blockwise_reference
from pallas_kernels.quantize_per_group import api as group_api
from pallas_kernels.quantize_per_group import reference as group_reference
from pallas_kernels.quantize_per_tensor import api as tensor_api

# k is a multiple of 1/EXPANSION_STEPS in [K_MIN, K_MAX]; see the reference.
EXPANSION_STEPS = group_reference.EXPANSION_STEPS
K_MIN = group_reference.K_MIN
K_MAX = group_reference.K_MAX
expansion_range = group_reference.expansion_range


def quantize_per_tensor(
    x: jax.Array, dtype: Any = 'e4m3', *, scale_dtype=jnp.float32,
    implementation: str | None = 'xla',
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
    implementation: 'xla', 'pallas' or None (fastest available).

  Returns:
    QuantizedArray with `scale.shape == ()` and `group_size=None`.
  """
  values, scale, _ = tensor_api.quantize_per_tensor(
      x, dtype, scale_dtype=scale_dtype, implementation=implementation)
  return QuantizedArray(values, scale)


def quantize_per_group(
    x: jax.Array,
    group_size: int = 128,
    dtype: Any = 'e4m3',
    expansion: bool = False,
    *,
    scale_dtype=jnp.float32,
    implementation: str | None = 'xla',
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
    implementation: 'xla', 'pallas' or None (fastest available).

  Returns:
    QuantizedArray; see its docstring for shapes. Groups holding NaN or Inf
    get a NaN scale and dequantize to NaN.
  """
  values, scale, exponent = group_api.quantize_per_group(
      x, group_size, dtype, expansion, scale_dtype=scale_dtype,
      implementation=implementation)
  return QuantizedArray(values, scale, exponent, int(group_size))


def quantize_blockwise(
    x: jax.Array,
    block: tuple[int, int] = (1, 128),
    dtype: Any = 'e4m3',
    *,
    transpose: bool = False,
    pow2_scales: bool = False,
    transpose_block: tuple[int, int] = (1, 128),
    implementation: str | None = 'xla',
) -> QuantizedArray | tuple[QuantizedArray, QuantizedArray]:
  """Quantizes in 1x128 tiles (activations, gradients) or 128x128 blocks.

  Per tile or block: scale = amax / fp8_max (1 for all zeros, NaN if it
  holds NaN or Inf; the other tiles are unaffected), or with `pow2_scales`
  2^ceil(log2(amax / fp8_max)); values = saturating_cast(x / scale).
  Partial tiles at the edges are zero-padded (scales use ceil).

  Args:
    x: floating array. (1, 128): any shape, tiles along the last axis (the
      same bits as `quantize_per_group(x, 128)` without pow2_scales);
      (128, 128): 2-D.
    block: (1, 128) or (128, 128).
    dtype: 'e4m3' or 'e5m2'.
    transpose: (1, 128) only: also return the transposed 2-D view
      (K, prod(shape[:-1])) in 1x128 tiles along its last axis (the tokens),
      quantized in the same pass: what a weight-gradient GEMM reads.
    pow2_scales: power-of-two scales (exact rescaling; a tile's max no
      longer lands on fp8_max, so the error grows and the layers use
      float32 ones: docs/decisions.md#comment-figures).
    transpose_block: with transpose, (1, 128) or (128, 128): the transposed
      view in 128x128 blocks instead.
    implementation: 'xla', 'pallas' or None (fastest available).

  Returns:
    (1, 128): QuantizedArray with group_size 128 (scale x.shape[:-1] +
    (ceil(K / 128),)), and with transpose a pair (q, q_t).
    (128, 128): QuantizedArray with block (128, 128), scale
    (ceil(M / 128), ceil(K / 128)). Leaves keep x's sharding where the
    layout allows (jit propagates it).
  """
  values, scale, values_t, scale_t = blockwise_api.quantize_blockwise(
      x, block, dtype, transpose=transpose, pow2_scales=pow2_scales,
      transpose_block=transpose_block, implementation=implementation)
  if tuple(block) == (128, 128):
    return QuantizedArray(values, scale, block=(128, 128))
  q = QuantizedArray(values, scale, None, 128)
  if not transpose:
    return q
  if tuple(transpose_block) == (128, 128):
    return q, QuantizedArray(values_t, scale_t, block=(128, 128))
  return q, QuantizedArray(values_t, scale_t, None, 128)


def dequantize(q: QuantizedArray, dtype=jnp.float32, *,
               implementation: str | None = 'xla') -> jax.Array:
  """Reconstructs the array: values * scale, or the inverse expansion.

  Args:
    q: a QuantizedArray from `quantize_per_tensor`, `quantize_per_group` or
      `quantize_blockwise`.
    dtype: the floating dtype of the result.
    implementation: 'xla', 'pallas' or None (fastest available).

  Returns:
    Array of shape `q.shape` and dtype `dtype`.
  """
  if not isinstance(q, QuantizedArray):
    raise TypeError(
        f'q must be a QuantizedArray (from quantize_per_tensor or'
        f' quantize_per_group), got {type(q).__name__}.')
  if q.block is not None:
    return blockwise_reference.dequantize_blocks(
        q.values, q.scale, out_dtype=dtype)
  if q.group_size is None:
    values = q.values.astype(jnp.float32)
    return (values * q.scale.astype(jnp.float32)).astype(dtype)
  return group_api.dequantize_per_group(
      q.values, q.scale, q.exponent, q.group_size, out_dtype=dtype,
      implementation=implementation)
