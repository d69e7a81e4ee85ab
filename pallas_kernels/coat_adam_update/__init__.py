"""The COAT Adam update (optax path): one pass over grad and FP8 moments."""

from pallas_kernels.coat_adam_update.api import coat_adam_update

__all__ = ['coat_adam_update']
