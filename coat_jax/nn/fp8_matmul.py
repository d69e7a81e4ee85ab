"""The FP8 matmul seam of the layers: `pallas_kernels.fp8_matmul`'s API.

`fp8_matmul(a, b, a_scale, b_scale, *, out_dtype, implementation, c)`
computes (a @ b.T) * a_scale * b_scale (+ c, in the GEMM's epilogue where
the kernel has one) for K-major FP8 operands a (M, K) and b (N, K),
M, N and K multiples of 16, with FP32 accumulation: cuBLASLt FP8 on GPU
('xla'), the Mosaic GPU kernel ('pallas'), a Triton-language kernel
through jax_triton ('triton', a benchmark peer), an exact float32 dot on
CPU.
This module re-exports it so the layers have a single matmul to call, and
`fp8_matmul_groups`, whose result comes as FP8 1x16 groups.
"""

from typing import Any

import jax

from coat_jax.quant.quantized_array import QuantizedArray
from pallas_kernels.fp8_matmul import api
from pallas_kernels.fp8_matmul.api import fp8_matmul
from pallas_kernels.fp8_matmul.api import resolve_implementation

__all__ = ['fp8_matmul', 'fp8_matmul_groups', 'resolve_implementation']


def fp8_matmul_groups(a: jax.Array, b: jax.Array, a_scale, b_scale, *,
                      dtype: Any = 'e4m3',
                      implementation: str | None = None) -> QuantizedArray:
  """(a @ b.T) * a_scale * b_scale as `quantize_per_group(y, 16, dtype)`.

  On Hopper the Mosaic GPU kernel quantizes in its epilogue, so the float32
  result never reaches memory (see `pallas_kernels.fp8_matmul.api`).

  Returns:
    QuantizedArray with values (M, N) FP8, float32 scales (M, N // 16) and
    group_size 16.
  """
  values, scales = api.fp8_matmul_groups(
      a, b, a_scale, b_scale, dtype=dtype, implementation=implementation)
  return QuantizedArray(values, scales, None, 16)
