"""Mistral (7B v0.1-v0.3, Nemo): Llama's layers with sliding-window
attention in every layer where the checkpoint sets a window, and an
explicit head_dim (Nemo)."""

import dataclasses
from typing import ClassVar

from coat_jax.models import decoder
from coat_jax.models import family


@dataclasses.dataclass(frozen=True)
class MistralConfig(decoder.DecoderConfig):
  """Mistral's architecture; defaults are Mistral-7B-v0.3's."""

  FAMILY: ClassVar[str] = 'mistral'
  PRESETS: ClassVar[dict] = {
      'mistral_tiny': dict(vocab_size=256, hidden_size=64,
                           intermediate_size=128, num_layers=2, num_heads=4,
                           num_kv_heads=2, max_seq_len=256,
                           sliding_window=16),
      'mistral_7b': dict(),
  }

  vocab_size: int = 32768
  hidden_size: int = 4096
  intermediate_size: int = 14336
  num_layers: int = 32
  num_heads: int = 32
  num_kv_heads: int = 8
  max_seq_len: int = 32768
  rope_theta: float = 1_000_000.0


def from_hf(hf: dict) -> dict:
  family.require(hf, 'hidden_act', ('silu',), 'silu')
  return dict(**family.shared_from_hf(hf),
              sliding_window=hf.get('sliding_window'))


def to_hf(config: decoder.DecoderConfig) -> dict:
  family.check_matches(config, 'Mistral', **family.LLAMA_LAYERS)
  return dict(**family.shared_to_hf(config, 'mistral', 'MistralForCausalLM'),
              sliding_window=config.sliding_window)


FAMILY = family.Family(
    name='mistral', config_class=MistralConfig, model_types=('mistral',),
    from_hf=from_hf, to_hf=to_hf)
