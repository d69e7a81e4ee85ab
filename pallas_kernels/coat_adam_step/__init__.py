"""The fused COAT AdamW step: one pass over param, grad and FP8 moments."""

from pallas_kernels.coat_adam_step.api import coat_adam_step
from pallas_kernels.coat_adam_step.reference import Moment

__all__ = ['Moment', 'coat_adam_step']
