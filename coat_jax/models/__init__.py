"""Models built from `coat_jax.nn` layers: Llama in three precision modes,
and Hugging Face checkpoints in and out."""

from coat_jax.models.hf import load_hf
from coat_jax.models.hf import save_hf
from coat_jax.models.llama import Attention
from coat_jax.models.llama import DecoderLayer
from coat_jax.models.llama import Llama
from coat_jax.models.llama import LlamaConfig
from coat_jax.models.llama import RopeScaling
from coat_jax.models.llama import lm_loss
from coat_jax.models.loss import chunked_cross_entropy

__all__ = [
    'Attention', 'DecoderLayer', 'Llama', 'LlamaConfig', 'RopeScaling',
    'chunked_cross_entropy', 'lm_loss', 'load_hf', 'save_hf',
]
