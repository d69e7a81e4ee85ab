"""Per-group FP8 quantize / dequantize (1x16, 1x128, with expansion)."""

from pallas_kernels.quantize_per_group.api import dequantize_per_group
from pallas_kernels.quantize_per_group.api import quantize_per_group

__all__ = ['dequantize_per_group', 'quantize_per_group']
