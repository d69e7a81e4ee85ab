"""FP8 formats and the saturating cast every quantizer goes through.

XLA's and ml_dtypes' casts do not saturate (465 -> NaN in E4M3), so every
quantizer clips to +-max before casting (round to nearest even; NaN stays
NaN, +-Inf becomes +-max). The definitions live with the kernels, which
share them.
"""

from pallas_kernels._common import FORMATS
from pallas_kernels._common import fp8_dtype
from pallas_kernels._common import fp8_max
from pallas_kernels._common import saturate as saturating_cast

E4M3 = FORMATS['e4m3']
E5M2 = FORMATS['e5m2']

__all__ = ['E4M3', 'E5M2', 'FORMATS', 'fp8_dtype', 'fp8_max',
           'saturating_cast']
