"""coat-jax: memory-efficient FP8 training for JAX (COAT, ICLR 2025)."""

import importlib

from coat_jax import models
from coat_jax import nn
from coat_jax import optim
from coat_jax import quant
from coat_jax import recipes
from coat_jax.conversion import ConversionReport
from coat_jax.conversion import convert
from coat_jax.optim import FusedCoatAdamW
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

# Submodules imported on first use (`coat_jax.checkpoint.save(...)` after a
# plain `import coat_jax`), so that importing coat_jax does not import orbax
# and the training loop's dependencies.
_LAZY_SUBMODULES = ('checkpoint', 'export', 'generate', 'plot', 'training')


def __getattr__(name: str):
  if name in _LAZY_SUBMODULES:
    return importlib.import_module(f'{__name__}.{name}')
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')

__all__ = [
    'ConversionReport', 'FusedCoatAdamW', 'QuantizedArray', 'Recipe',
    'ScaleByCoatAdamState',
    'checkpoint', 'coat_adamw', 'convert', 'dequantize', 'fp8_states',
    'models', 'nn', 'optim', 'quant', 'quantize_per_group',
    'quantize_per_tensor', 'recipes', 'scale_by_coat_adam', 'training',
]
