"""The FP8 matmul seam of the layers: `pallas_kernels.fp8_matmul`'s API.

`fp8_matmul(a, b, a_scale, b_scale, *, out_dtype, implementation, c)`
computes (a @ b.T) * a_scale * b_scale (+ c, in the GEMM's epilogue where
the kernel has one) for K-major FP8 operands a (M, K) and b (N, K),
M, N and K multiples of 16, with FP32 accumulation: cuBLASLt FP8 on GPU
('xla'), the Mosaic GPU kernel ('pallas'), an exact float32 dot on CPU.
This module re-exports it so the layers have a single matmul to call, and
`fp8_matmul_groups`, whose result comes as FP8 1x16 groups.
"""

from typing import Any

import jax
import jax.numpy as jnp

from coat_jax.quant import quantize
from coat_jax.quant.quantized_array import QuantizedArray
from pallas_kernels.fp8_matmul.api import fp8_matmul

__all__ = ['fp8_matmul', 'fp8_matmul_groups']


def fp8_matmul_groups(a: jax.Array, b: jax.Array, a_scale, b_scale, *,
                      dtype: Any = 'e4m3',
                      implementation: str | None = None) -> QuantizedArray:
  """(a @ b.T) * a_scale * b_scale as `quantize_per_group(y, 16, dtype)`.

  The float32 product of `fp8_matmul`, quantized in groups of 16 along its
  rows; `implementation` chooses both ops' (see `fp8_matmul`).

  Returns:
    QuantizedArray with values (M, N) FP8, float32 scales (M, N // 16) and
    group_size 16.
  """
  y = fp8_matmul(a, b, a_scale, b_scale, out_dtype=jnp.float32,
                 implementation=implementation)
  return quantize.quantize_per_group(y, 16, dtype,
                                     implementation=implementation)
