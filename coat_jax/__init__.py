"""coat-jax: memory-efficient FP8 training for JAX (COAT, ICLR 2025)."""

from coat_jax import models
from coat_jax import nn
from coat_jax import optim
from coat_jax import quant
from coat_jax import recipes
from coat_jax.conversion import ConversionReport
from coat_jax.conversion import convert
from coat_jax.optim import ScaleByCoatAdamState
from coat_jax.optim import coat_adamw
from coat_jax.optim import fp8_states
from coat_jax.optim import scale_by_coat_adam
from coat_jax.quant import QuantizedArray
from coat_jax.quant import dequantize
from coat_jax.quant import quantize_per_group
from coat_jax.quant import quantize_per_tensor
from coat_jax.recipes import Recipe

__version__ = '0.1.0'

__all__ = [
    'ConversionReport', 'QuantizedArray', 'Recipe', 'ScaleByCoatAdamState',
    'coat_adamw', 'convert', 'dequantize', 'fp8_states', 'models', 'nn',
    'optim', 'quant', 'quantize_per_group', 'quantize_per_tensor', 'recipes',
    'scale_by_coat_adam',
]
