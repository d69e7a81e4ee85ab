"""Decoder-only language models on one shared stack, one config class per
family (Llama, Mistral, Qwen2, Qwen3, OLMo 2, Gemma 3 text), and Hugging
Face checkpoints in and out; a ViT encoder (SigLIP's vision tower) and a
vision-language model of a ViT, a projector and a decoder."""

from coat_jax.models.decoder import Attention
from coat_jax.models.decoder import Decoder
from coat_jax.models.decoder import DecoderConfig
from coat_jax.models.decoder import DecoderLayer
from coat_jax.models.decoder import RopeScaling
from coat_jax.models.decoder import lm_loss
from coat_jax.models.families import FAMILIES
from coat_jax.models.families import preset
from coat_jax.models.gemma3 import Gemma3Config
from coat_jax.models.hf import load_hf
from coat_jax.models.hf import load_siglip
from coat_jax.models.hf import save_hf
from coat_jax.models.llama import Llama
from coat_jax.models.llama import LlamaConfig
from coat_jax.models.loss import chunked_cross_entropy
from coat_jax.models.mistral import MistralConfig
from coat_jax.models.olmo2 import Olmo2Config
from coat_jax.models.qwen2 import Qwen2Config
from coat_jax.models.qwen3 import Qwen3Config
from coat_jax.models.vit import ViT
from coat_jax.models.vit import ViTConfig
from coat_jax.models.vlm import VLM
from coat_jax.models.vlm import VLMConfig
from coat_jax.models.vlm import vlm_loss

__all__ = [
    'FAMILIES', 'Attention', 'Decoder', 'DecoderConfig', 'DecoderLayer',
    'Gemma3Config', 'Llama', 'LlamaConfig', 'MistralConfig', 'Olmo2Config',
    'Qwen2Config', 'Qwen3Config', 'RopeScaling', 'VLM', 'VLMConfig', 'ViT',
    'ViTConfig', 'chunked_cross_entropy', 'lm_loss', 'load_hf',
    'load_siglip', 'preset', 'save_hf', 'vlm_loss',
]
