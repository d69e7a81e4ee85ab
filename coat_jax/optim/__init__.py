"""Optimizers: COAT AdamW with FP8 moments."""

from coat_jax.optim.coat_adam import ScaleByCoatAdamState
from coat_jax.optim.coat_adam import coat_adamw
from coat_jax.optim.coat_adam import scale_by_coat_adam

__all__ = ['ScaleByCoatAdamState', 'coat_adamw', 'scale_by_coat_adam']
