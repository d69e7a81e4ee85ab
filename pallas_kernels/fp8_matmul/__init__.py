"""FP8 matmul: out = (A . B^T) * a_scale * b_scale with FP32 accumulation."""

from pallas_kernels.fp8_matmul.api import fp8_matmul
from pallas_kernels.fp8_matmul.api import fp8_matmul_block_scaled
from pallas_kernels.fp8_matmul.reference import fp8_matmul_block_reference
from pallas_kernels.fp8_matmul.reference import fp8_matmul_reference

__all__ = ['fp8_matmul', 'fp8_matmul_block_reference',
           'fp8_matmul_block_scaled', 'fp8_matmul_reference']
