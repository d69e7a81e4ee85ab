"""The FP8 matmul seam of the layers: `pallas_kernels.fp8_matmul`'s API.

`fp8_matmul(a, b, a_scale, b_scale, *, out_dtype, implementation, c)`
computes (a @ b.T) * a_scale * b_scale (+ c, in the GEMM's epilogue where
the kernel has one) for K-major FP8 operands a (M, K) and b (N, K),
M, N and K multiples of 16, with FP32 accumulation: cuBLASLt FP8 on GPU
('xla'), the Mosaic GPU kernel ('pallas'), an exact float32 dot on CPU.
This module re-exports it so the layers have a single matmul to call.
"""

from pallas_kernels.fp8_matmul.api import fp8_matmul

__all__ = ['fp8_matmul']
