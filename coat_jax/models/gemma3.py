"""Gemma 3 text: GeGLU (tanh GELU), RMSNorm gains stored as gain - 1,
norms before and after attention and the MLP, per-head QK RMSNorm, the
embeddings scaled by sqrt(hidden), query_pre_attn_scalar, and every sixth
layer attending fully while the others slide over a window with their own
RoPE base."""

import dataclasses
import math
from typing import ClassVar

from coat_jax.models import decoder
from coat_jax.models import family


@dataclasses.dataclass(frozen=True)
class Gemma3Config(decoder.DecoderConfig):
  """Gemma 3's text architecture; defaults are Gemma-3-1B's."""

  FAMILY: ClassVar[str] = 'gemma3'
  PRESETS: ClassVar[dict] = {
      'gemma3_tiny': dict(vocab_size=256, hidden_size=64,
                          intermediate_size=128, num_layers=6, num_heads=4,
                          num_kv_heads=2, head_dim=32, max_seq_len=256,
                          sliding_window=16, query_scale=32 ** -0.5),
      'gemma3_1b': dict(),
      'gemma3_4b': dict(hidden_size=2560, intermediate_size=10240,
                        num_layers=34, num_heads=8, num_kv_heads=4,
                        sliding_window=1024, max_seq_len=131072,
                        rope_scaling=decoder.RopeScaling(
                            factor=8.0, rope_type='linear')),
  }

  vocab_size: int = 262144
  hidden_size: int = 1152
  intermediate_size: int = 6912
  num_layers: int = 26
  num_heads: int = 4
  num_kv_heads: int = 1
  head_dim: int | None = 256
  max_seq_len: int = 32768
  rope_theta: float = 1_000_000.0
  rms_norm_eps: float = 1e-6
  tie_embeddings: bool = True
  qk_norm: str | None = 'head'
  norm_placement: str = 'sandwich'
  activation: str = 'gelu_tanh'
  norm_scale_offset: float = 1.0
  embed_scale: bool = True
  query_scale: float | None = 256 ** -0.5
  sliding_window: int | None = 512
  sliding_window_pattern: int | None = 6
  rope_local_theta: float | None = 10_000.0


def from_hf(hf: dict) -> dict:
  family.require(hf, 'hidden_activation', ('gelu_pytorch_tanh',),
                 hf.get('hidden_act', 'gelu_pytorch_tanh'))
  for key in ('final_logit_softcapping', 'attn_logit_softcapping',
              'use_bidirectional_attention'):
    if hf.get(key):
      family.unsupported(hf, key, hf[key], 'supported: null or false')
  family.require(hf, 'attention_bias', (False,), False)
  fields = family.shared_from_hf(hf)
  fields['head_dim'] = hf.get('head_dim', 256)  # explicit, always
  # transformers 5 writes RoPE per layer type; older configs give the
  # sliding layers' base as rope_local_base_freq.
  local = (hf.get('rope_parameters') or {}).get('sliding_attention') or {}
  if local.get('rope_type', 'default') != 'default':
    family.unsupported(hf, 'rope_parameters.sliding_attention', local,
                       'supported: default RoPE on sliding layers')
  local_theta = float(local.get('rope_theta',
                                hf.get('rope_local_base_freq', 10_000.0)))
  layer_types = hf.get('layer_types')
  if layer_types is None:
    pattern = hf.get('sliding_window_pattern', 6)
    layer_types = ['full_attention' if (i + 1) % pattern == 0
                   else 'sliding_attention'
                   for i in range(hf['num_hidden_layers'])]
  return dict(
      **fields, qk_norm='head', norm_placement='sandwich',
      activation='gelu_tanh', norm_scale_offset=1.0, embed_scale=True,
      query_scale=float(hf.get('query_pre_attn_scalar', 256)) ** -0.5,
      rope_local_theta=local_theta,
      **family.sliding_from_hf(hf, hf.get('sliding_window', 4096),
                               layer_types))


def to_hf(config: decoder.DecoderConfig) -> dict:
  family.check_matches(
      config, 'Gemma 3', qkv_bias=False, qk_norm='head',
      norm_placement='sandwich', activation='gelu_tanh',
      norm_scale_offset=1.0, embed_scale=True)
  scalar = (config.query_scale or config.head_features ** -0.5) ** -2
  hf = family.shared_to_hf(config, 'gemma3_text', 'Gemma3ForCausalLM')
  del hf['hidden_act']
  return dict(
      **hf, hidden_activation='gelu_pytorch_tanh',
      query_pre_attn_scalar=(round(scalar) if math.isclose(
          scalar, round(scalar)) else scalar),
      rope_local_base_freq=config.rope_local_theta or config.rope_theta,
      attention_bias=False, final_logit_softcapping=None,
      attn_logit_softcapping=None, **family.sliding_to_hf(config))


FAMILY = family.Family(
    name='gemma3', config_class=Gemma3Config, model_types=('gemma3_text',),
    from_hf=from_hf, to_hf=to_hf,
    norm_names={'attn_norm': 'input_layernorm',
                'attn_post_norm': 'post_attention_layernorm',
                'mlp_norm': 'pre_feedforward_layernorm',
                'mlp_post_norm': 'post_feedforward_layernorm'})
