"""Llama 2 and Llama 3.x: the decoder's defaults (pre-norm RMSNorm, RoPE,
GQA, SwiGLU), Llama 3's RoPE scaling, untied or tied embeddings.

`Llama` is the shared `Decoder`; `LlamaConfig` its config with Llama's
presets.
"""

import dataclasses
from typing import ClassVar

from coat_jax.models import decoder
from coat_jax.models import family

Llama = decoder.Decoder


@dataclasses.dataclass(frozen=True)
class LlamaConfig(decoder.DecoderConfig):
  """Llama's architecture (`decoder.DecoderConfig`, whose defaults are
  Llama-2-7B's)."""

  FAMILY: ClassVar[str] = 'llama'
  PRESETS: ClassVar[dict] = {
      'tiny': dict(vocab_size=256, hidden_size=64, intermediate_size=176,
                   num_layers=2, num_heads=4, num_kv_heads=2,
                   max_seq_len=256),
      '125m': dict(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                   num_layers=12, num_heads=12, num_kv_heads=12,
                   max_seq_len=2048, tie_embeddings=True),
      '1b': dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                 num_layers=22, num_heads=32, num_kv_heads=4,
                 max_seq_len=2048),
      'llama2_7b': dict(vocab_size=32000, hidden_size=4096,
                        intermediate_size=11008, num_layers=32, num_heads=32,
                        num_kv_heads=32, max_seq_len=4096),
      'llama2_13b': dict(vocab_size=32000, hidden_size=5120,
                         intermediate_size=13824, num_layers=40,
                         num_heads=40, num_kv_heads=40, max_seq_len=4096),
      # LLaMA-1 33B (the "30B" of the LLaMA paper): 32.5B params.
      'llama_33b': dict(vocab_size=32000, hidden_size=6656,
                        intermediate_size=17920, num_layers=60, num_heads=52,
                        num_kv_heads=52, max_seq_len=2048),
      'llama3_8b': dict(vocab_size=128256, hidden_size=4096,
                        intermediate_size=14336, num_layers=32, num_heads=32,
                        num_kv_heads=8, max_seq_len=8192,
                        rope_theta=500000.0, rms_norm_eps=1e-5),
  }


def from_hf(hf: dict) -> dict:
  for key in ('attention_bias', 'mlp_bias'):
    if hf.get(key):
      family.unsupported(hf, key, True, 'coat_jax Llama layers have no'
                         ' biases')
  family.require(hf, 'hidden_act', ('silu',), 'silu')
  return family.shared_from_hf(hf)


def to_hf(config: decoder.DecoderConfig) -> dict:
  family.check_matches(config, 'Llama', sliding_window=None,
                       **family.LLAMA_LAYERS)
  return dict(**family.shared_to_hf(config, 'llama', 'LlamaForCausalLM'),
              attention_bias=False, mlp_bias=False)


FAMILY = family.Family(
    name='llama', config_class=LlamaConfig, model_types=('llama',),
    from_hf=from_hf, to_hf=to_hf)
