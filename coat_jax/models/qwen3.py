"""Qwen3 (dense): Llama's layers with an RMSNorm over each head of the
queries and keys before RoPE, and an explicit head_dim (128)."""

import dataclasses
from typing import ClassVar

from coat_jax.models import decoder
from coat_jax.models import family


@dataclasses.dataclass(frozen=True)
class Qwen3Config(decoder.DecoderConfig):
  """Qwen3's architecture; defaults are Qwen3-1.7B's."""

  FAMILY: ClassVar[str] = 'qwen3'
  PRESETS: ClassVar[dict] = {
      'qwen3_tiny': dict(vocab_size=256, hidden_size=64,
                         intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=32, max_seq_len=256),
      'qwen3_0.6b': dict(hidden_size=1024, intermediate_size=3072,
                         num_heads=16, num_kv_heads=8),
      'qwen3_1.7b': dict(),
      'qwen3_4b': dict(hidden_size=2560, intermediate_size=9728,
                       num_layers=36, num_heads=32, num_kv_heads=8),
      'qwen3_8b': dict(hidden_size=4096, intermediate_size=12288,
                       num_layers=36, num_heads=32, num_kv_heads=8,
                       tie_embeddings=False),
  }

  vocab_size: int = 151936
  hidden_size: int = 2048
  intermediate_size: int = 6144
  num_layers: int = 28
  num_heads: int = 16
  num_kv_heads: int = 8
  head_dim: int | None = 128
  max_seq_len: int = 40960
  rope_theta: float = 1_000_000.0
  rms_norm_eps: float = 1e-6
  tie_embeddings: bool = True
  qk_norm: str | None = 'head'


def from_hf(hf: dict) -> dict:
  family.require(hf, 'hidden_act', ('silu',), 'silu')
  family.require(hf, 'attention_bias', (False,), False)
  fields = family.shared_from_hf(hf)
  fields['head_dim'] = hf.get('head_dim', 128)  # explicit, always
  window = hf.get('sliding_window') if hf.get('use_sliding_window') else None
  return dict(**fields, qk_norm='head',
              **family.sliding_from_hf(hf, window, hf.get('layer_types')))


def to_hf(config: decoder.DecoderConfig) -> dict:
  family.check_matches(config, 'Qwen3', sliding_window=None,
                       **{**family.LLAMA_LAYERS, 'qk_norm': 'head'})
  return dict(**family.shared_to_hf(config, 'qwen3', 'Qwen3ForCausalLM'),
              attention_bias=False, use_sliding_window=False,
              sliding_window=None)


FAMILY = family.Family(
    name='qwen3', config_class=Qwen3Config, model_types=('qwen3',),
    from_hf=from_hf, to_hf=to_hf)
