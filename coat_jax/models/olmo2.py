"""OLMo 2: norms after attention and after the MLP (x + norm(f(x)), no
pre-norm), and an RMSNorm over all heads' queries and keys before RoPE.
COAT's paper pretrains OLMo."""

import dataclasses
from typing import ClassVar

from coat_jax.models import decoder
from coat_jax.models import family


@dataclasses.dataclass(frozen=True)
class Olmo2Config(decoder.DecoderConfig):
  """OLMo 2's architecture; defaults are OLMo-2-0425-1B's."""

  FAMILY: ClassVar[str] = 'olmo2'
  PRESETS: ClassVar[dict] = {
      'olmo2_tiny': dict(vocab_size=256, hidden_size=64,
                         intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=4, max_seq_len=256),
      'olmo2_1b': dict(),
      'olmo2_7b': dict(hidden_size=4096, intermediate_size=11008,
                       num_layers=32, num_heads=32, num_kv_heads=32),
  }

  vocab_size: int = 100352
  hidden_size: int = 2048
  intermediate_size: int = 8192
  num_layers: int = 16
  num_heads: int = 16
  num_kv_heads: int = 16
  max_seq_len: int = 4096
  rope_theta: float = 500_000.0
  rms_norm_eps: float = 1e-6
  qk_norm: str | None = 'full'
  norm_placement: str = 'post'


def from_hf(hf: dict) -> dict:
  family.require(hf, 'hidden_act', ('silu',), 'silu')
  family.require(hf, 'attention_bias', (False,), False)
  return dict(**family.shared_from_hf(hf), qk_norm='full',
              norm_placement='post')


def to_hf(config: decoder.DecoderConfig) -> dict:
  family.check_matches(config, 'OLMo 2', sliding_window=None, **{
      **family.LLAMA_LAYERS, 'qk_norm': 'full', 'norm_placement': 'post'})
  return dict(**family.shared_to_hf(config, 'olmo2', 'Olmo2ForCausalLM'),
              attention_bias=False)


FAMILY = family.Family(
    name='olmo2', config_class=Olmo2Config, model_types=('olmo2',),
    from_hf=from_hf, to_hf=to_hf,
    norm_names={'attn_post_norm': 'post_attention_layernorm',
                'mlp_post_norm': 'post_feedforward_layernorm'})
