"""Block-scaled FP8 quantization: 1x128 tiles (with the transposed copy in
the same pass) and 128x128 blocks."""

from pallas_kernels.quantize_blockwise.api import quantize_blockwise

__all__ = ['quantize_blockwise']
