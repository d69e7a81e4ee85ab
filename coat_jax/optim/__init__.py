"""Optimizers: COAT AdamW with FP8 moments, FP8 states for other optax ones."""

from coat_jax.optim.coat_adam import ScaleByCoatAdamState
from coat_jax.optim.coat_adam import coat_adamw
from coat_jax.optim.coat_adam import scale_by_coat_adam
from coat_jax.optim.fused import clip_scale
from coat_jax.optim.fused import fused_coat_adamw
from coat_jax.optim.nnx_optimizer import FusedCoatAdamW
from coat_jax.optim.quantized_states import fp8_states

__all__ = ['FusedCoatAdamW', 'ScaleByCoatAdamState', 'clip_scale',
           'coat_adamw', 'fp8_states', 'fused_coat_adamw',
           'scale_by_coat_adam']
