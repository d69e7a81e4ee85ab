"""Qwen2 and Qwen2.5: Llama's layers with biases on the Q/K/V projections,
RoPE base 1e6, tied embeddings in the small models."""

import dataclasses
from typing import ClassVar

from coat_jax.models import decoder
from coat_jax.models import family


@dataclasses.dataclass(frozen=True)
class Qwen2Config(decoder.DecoderConfig):
  """Qwen2's architecture; defaults are Qwen2.5-1.5B's."""

  FAMILY: ClassVar[str] = 'qwen2'
  PRESETS: ClassVar[dict] = {
      'qwen2_tiny': dict(vocab_size=256, hidden_size=64,
                         intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2, max_seq_len=256),
      'qwen2.5_0.5b': dict(hidden_size=896, intermediate_size=4864,
                           num_layers=24, num_heads=14, num_kv_heads=2),
      'qwen2.5_1.5b': dict(),
      'qwen2.5_7b': dict(vocab_size=152064, hidden_size=3584,
                         intermediate_size=18944, num_layers=28,
                         num_heads=28, num_kv_heads=4, tie_embeddings=False),
  }

  vocab_size: int = 151936
  hidden_size: int = 1536
  intermediate_size: int = 8960
  num_layers: int = 28
  num_heads: int = 12
  num_kv_heads: int = 2
  max_seq_len: int = 32768
  rope_theta: float = 1_000_000.0
  rms_norm_eps: float = 1e-6
  tie_embeddings: bool = True
  qkv_bias: bool = True


def from_hf(hf: dict) -> dict:
  family.require(hf, 'hidden_act', ('silu',), 'silu')
  window = hf.get('sliding_window') if hf.get('use_sliding_window') else None
  return dict(**family.shared_from_hf(hf), qkv_bias=True,
              **family.sliding_from_hf(hf, window, hf.get('layer_types')))


def to_hf(config: decoder.DecoderConfig) -> dict:
  family.check_matches(config, 'Qwen2', sliding_window=None,
                       **{**family.LLAMA_LAYERS, 'qkv_bias': True})
  return dict(**family.shared_to_hf(config, 'qwen2', 'Qwen2ForCausalLM'),
              use_sliding_window=False, sliding_window=None)


FAMILY = family.Family(
    name='qwen2', config_class=Qwen2Config, model_types=('qwen2',),
    from_hf=from_hf, to_hf=to_hf)
