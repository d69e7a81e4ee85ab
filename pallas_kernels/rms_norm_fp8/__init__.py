"""FP8 RMSNorm: forward and backward, each one pass (1x16 E4M3 residual)."""

from pallas_kernels.rms_norm_fp8.api import rms_norm_fp8_bwd
from pallas_kernels.rms_norm_fp8.api import rms_norm_fp8_fwd

__all__ = ['rms_norm_fp8_bwd', 'rms_norm_fp8_fwd']
