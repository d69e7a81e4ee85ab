"""Models built from `coat_jax.nn` layers: Llama in three precision modes."""

from coat_jax.models.llama import Attention
from coat_jax.models.llama import DecoderLayer
from coat_jax.models.llama import Llama
from coat_jax.models.llama import LlamaConfig
from coat_jax.models.llama import lm_loss
from coat_jax.models.loss import chunked_cross_entropy

__all__ = [
    'Attention', 'DecoderLayer', 'Llama', 'LlamaConfig',
    'chunked_cross_entropy', 'lm_loss',
]
