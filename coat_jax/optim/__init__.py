"""Optimizers: COAT AdamW with FP8 moments."""

from coat_jax.optim.coat_adam import ScaleByCoatAdamState
from coat_jax.optim.coat_adam import coat_adamw
from coat_jax.optim.coat_adam import scale_by_coat_adam
from coat_jax.optim.fused import fused_coat_adamw

__all__ = ['ScaleByCoatAdamState', 'coat_adamw', 'fused_coat_adamw',
           'scale_by_coat_adam']
