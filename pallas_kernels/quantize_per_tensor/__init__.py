"""Per-tensor FP8 quantization with the amax found in the same kernel family,
optionally writing the transposed FP8 copy in the same pass."""

from pallas_kernels.quantize_per_tensor.api import quantize_per_tensor

__all__ = ['quantize_per_tensor']
