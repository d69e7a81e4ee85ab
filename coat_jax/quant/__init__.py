"""FP8 quantization: formats, saturating casts, per-tensor and per-group
scaling with COAT's dynamic range expansion, and block scaling (1x128
tiles, 128x128 blocks). Pure jnp."""

from coat_jax.quant.formats import E4M3
from coat_jax.quant.formats import E5M2
from coat_jax.quant.formats import FORMATS
from coat_jax.quant.formats import fp8_dtype
from coat_jax.quant.formats import fp8_max
from coat_jax.quant.formats import saturating_cast
from coat_jax.quant.quantize import K_MAX
from coat_jax.quant.quantize import K_MIN
from coat_jax.quant.quantize import dequantize
from coat_jax.quant.quantize import expansion_range
from coat_jax.quant.quantize import quantize_blockwise
from coat_jax.quant.quantize import quantize_per_group
from coat_jax.quant.quantize import quantize_per_tensor
from coat_jax.quant.quantized_array import QuantizedArray

__all__ = [
    'E4M3', 'E5M2', 'FORMATS', 'K_MAX', 'K_MIN', 'QuantizedArray',
    'dequantize', 'expansion_range', 'fp8_dtype', 'fp8_max',
    'quantize_blockwise', 'quantize_per_group', 'quantize_per_tensor',
    'saturating_cast',
]
