"""FP8 SwiGLU (COAT): forward and backward, each one pass."""

from pallas_kernels.swiglu_fp8.api import swiglu_fp8_bwd
from pallas_kernels.swiglu_fp8.api import swiglu_fp8_fwd

__all__ = ['swiglu_fp8_bwd', 'swiglu_fp8_fwd']
