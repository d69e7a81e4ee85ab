"""What a model family is: its config class, its Hugging Face config and
parameter names, its model and loss (`Family`), and the Hugging Face config
fields every decoder family shares.

A family module (llama.py, qwen3.py, ...) defines a `DecoderConfig`
subclass with its defaults and presets, and a `Family` whose `from_hf` and
`to_hf` translate config.json; `coat_jax.models.families` registers them.
"""

from collections.abc import Callable
from collections.abc import Mapping
import dataclasses
import json
from typing import Any

from coat_jax.models import decoder

# Where each decoder-layer norm of ours sits in a Hugging Face checkpoint,
# for the families whose norms come before attention and the MLP.
PRE_NORM_NAMES = {'attn_norm': 'input_layernorm',
                  'mlp_norm': 'post_attention_layernorm'}

# The config fields whose Llama values (the decoder's defaults) a family's
# checkpoints are limited to, for families with Llama's layers.
LLAMA_LAYERS = dict(
    qkv_bias=False, qk_norm=None, norm_placement='pre', activation='silu',
    norm_scale_offset=0.0, embed_scale=False, query_scale=None,
    sliding_window_pattern=None, rope_local_theta=None)

# config.json's layer_types values.
_HF_LAYER_TYPES = {'full_attention': decoder.FULL,
                   'sliding_attention': decoder.SLIDING}


@dataclasses.dataclass(frozen=True)
class Family:
  """A model family.

  Attributes:
    name: the family's name ('llama', 'qwen3', ...).
    config_class: its `DecoderConfig` subclass (defaults and PRESETS).
    model_types: the config.json `model_type` values it reads.
    from_hf: config.json dict -> the config class's fields; raises
      ValueError naming the config.json field it cannot take.
    to_hf: config -> config.json dict (transformers reads it).
    norm_names: each decoder-layer norm module's Hugging Face name
      (`PRE_NORM_NAMES` for pre-norm families).
    model: the model class (`decoder.Decoder`).
    loss: (model, tokens, targets, **kwargs) -> scalar loss.
  """

  name: str
  config_class: type
  model_types: tuple[str, ...]
  from_hf: Callable[[dict], dict]
  to_hf: Callable[[Any], dict]
  norm_names: Mapping[str, str] = dataclasses.field(
      default_factory=lambda: dict(PRE_NORM_NAMES))
  model: type = decoder.Decoder
  loss: Callable[..., Any] = decoder.lm_loss

  def config_from_hf(self, hf: dict, overrides: dict | None = None, *,
                     prefix: str = '') -> decoder.DecoderConfig:
    """The config of a config.json dict, with `overrides` of fields that
    the weights do not decide (`FROM_CHECKPOINT` ones must agree).

    Raises:
      ValueError: an unsupported config.json field, or an override that
        conflicts with the checkpoint (named with `prefix`).
    """
    fields = self.from_hf(hf)
    for name, value in (overrides or {}).items():
      if name in FROM_CHECKPOINT and value != fields.get(name):
        raise ValueError(
            f'{prefix}{name}={value!r} conflicts with the checkpoint'
            f' (config.json {FROM_CHECKPOINT[name]}={fields.get(name)!r}):'
            ' its weights decide the model dimensions; drop the override.')
      fields[name] = value
    return self.config_class(**fields)


# Config fields the checkpoint decides (its weights' shapes), by the
# config.json key they come from.
FROM_CHECKPOINT = {
    'vocab_size': 'vocab_size', 'hidden_size': 'hidden_size',
    'intermediate_size': 'intermediate_size',
    'num_layers': 'num_hidden_layers', 'num_heads': 'num_attention_heads',
    'num_kv_heads': 'num_key_value_heads', 'head_dim': 'head_dim',
    'tie_embeddings': 'tie_word_embeddings', 'qkv_bias': 'attention_bias',
}


def unsupported(hf: dict, key: str, value: Any, supported: str) -> None:
  """Raises ValueError naming config.json's `key`, its `value` (as JSON
  spells it) and what is supported."""
  raise ValueError(f'config.json: {key}={json.dumps(value)} is not'
                   f" supported (model_type {hf.get('model_type')!r});"
                   f' {supported}.')


def require(hf: dict, key: str, allowed: tuple, default: Any = None) -> Any:
  """config.json's `key` (default if absent); raises unless in `allowed`."""
  value = hf.get(key, default)
  if value not in allowed:
    unsupported(hf, key, value, f'supported: {allowed}')
  return value


def shared_from_hf(hf: dict) -> dict:
  """The DecoderConfig fields every family reads the same way:
  dimensions, head_dim, max_position_embeddings, rms_norm_eps, tied
  embeddings and the (full-attention layers') RoPE."""
  heads = hf['num_attention_heads']
  fields = dict(
      vocab_size=hf['vocab_size'], hidden_size=hf['hidden_size'],
      intermediate_size=hf['intermediate_size'],
      num_layers=hf['num_hidden_layers'], num_heads=heads,
      num_kv_heads=hf.get('num_key_value_heads') or heads,
      max_seq_len=hf.get('max_position_embeddings', 4096),
      rms_norm_eps=float(hf.get('rms_norm_eps', 1e-6)),
      tie_embeddings=bool(hf.get('tie_word_embeddings', False)))
  head_dim = hf.get('head_dim')
  if head_dim is not None and head_dim * heads != hf['hidden_size']:
    fields['head_dim'] = head_dim
  theta, scaling = rope_from_hf(hf, *rope_parameters(hf, 'full_attention'))
  fields.update(rope_theta=theta, rope_scaling=scaling)
  return fields


def rope_parameters(hf: dict, layer_type: str) -> tuple[str, dict]:
  """(config.json key, the RoPE parameters) of one layer type from
  transformers 5's rope_parameters (flat, or per layer type as Gemma 3
  writes them) or the older rope_scaling; {} if none."""
  params = hf.get('rope_parameters')
  if params and layer_type in params:
    return f'rope_parameters.{layer_type}', params[layer_type] or {}
  if params:
    return 'rope_parameters', params
  return 'rope_scaling', hf.get('rope_scaling') or {}


def rope_from_hf(hf: dict, key: str, params: dict,
                 default_theta: float = 10000.0
                 ) -> tuple[float, decoder.RopeScaling | None]:
  """(rope_theta, scaling) of the RoPE parameters under config.json's `key`
  (`rope_parameters`)."""
  theta = float(params.get('rope_theta', hf.get('rope_theta', default_theta)))
  kind = params.get('rope_type', params.get('type'))
  if kind in (None, 'default'):
    return theta, None
  try:
    if kind == 'linear':
      return theta, decoder.RopeScaling(factor=float(params['factor']),
                                        rope_type='linear')
    if kind == 'llama3':
      return theta, decoder.RopeScaling(
          factor=float(params['factor']),
          low_freq_factor=float(params['low_freq_factor']),
          high_freq_factor=float(params['high_freq_factor']),
          original_max_position_embeddings=int(
              params['original_max_position_embeddings']))
  except KeyError as e:
    raise ValueError(f'config.json: {key} of rope_type {kind!r} lacks'
                     f' {e.args[0]!r}.') from None
  unsupported(hf, f'{key}.rope_type', kind,
              "supported: null, 'default', 'linear', 'llama3'")


def rope_scaling_to_hf(scaling: decoder.RopeScaling | None) -> dict | None:
  """config.json's rope_scaling (which transformers 4 and 5 both read)."""
  if scaling is None:
    return None
  if scaling.rope_type == 'linear':
    return dict(rope_type='linear', factor=scaling.factor)
  return dict(rope_type='llama3', factor=scaling.factor,
              low_freq_factor=scaling.low_freq_factor,
              high_freq_factor=scaling.high_freq_factor,
              original_max_position_embeddings=(
                  scaling.original_max_position_embeddings))


def sliding_from_hf(hf: dict, window: int | None,
                    layer_types: list[str] | None) -> dict:
  """sliding_window and sliding_window_pattern of config.json's window and
  per-layer types (None: every layer slides where a window is set)."""
  if window is None:
    kinds = set(layer_types or ['full_attention'])
    if kinds - {'full_attention'}:
      unsupported(hf, 'layer_types', sorted(kinds),
                  'sliding layers need sliding_window')
    return dict(sliding_window=None, sliding_window_pattern=None)
  if layer_types is None:
    return dict(sliding_window=window, sliding_window_pattern=None)
  for t in layer_types:
    if t not in _HF_LAYER_TYPES:
      unsupported(hf, 'layer_types', t, f'supported: {list(_HF_LAYER_TYPES)}')
  kinds = [_HF_LAYER_TYPES[t] for t in layer_types]
  if all(k == decoder.FULL for k in kinds):
    return dict(sliding_window=None, sliding_window_pattern=None)
  if all(k == decoder.SLIDING for k in kinds):
    return dict(sliding_window=window, sliding_window_pattern=None)
  first_full = kinds.index(decoder.FULL) + 1
  config = dict(sliding_window=window, sliding_window_pattern=first_full)
  expected = [decoder.FULL if (i + 1) % first_full == 0 else decoder.SLIDING
              for i in range(len(kinds))]
  if kinds != expected:
    unsupported(hf, 'layer_types', layer_types,
                'supported: all layers alike, or every p-th layer full'
                ' attention and the others sliding')
  return config


def sliding_to_hf(config: decoder.DecoderConfig) -> dict:
  """config.json's sliding_window and layer_types."""
  hf_name = {v: k for k, v in _HF_LAYER_TYPES.items()}
  return dict(sliding_window=config.sliding_window,
              layer_types=[hf_name[k] for k in config.layer_types])


def shared_to_hf(config: decoder.DecoderConfig, model_type: str,
                 architecture: str) -> dict:
  """The config.json fields every family writes the same way."""
  return dict(
      architectures=[architecture], model_type=model_type,
      vocab_size=config.vocab_size, hidden_size=config.hidden_size,
      intermediate_size=config.intermediate_size,
      num_hidden_layers=config.num_layers,
      num_attention_heads=config.num_heads,
      num_key_value_heads=config.num_kv_heads,
      head_dim=config.head_features,
      max_position_embeddings=config.max_seq_len,
      rope_theta=config.rope_theta,
      rope_scaling=rope_scaling_to_hf(config.rope_scaling),
      rms_norm_eps=config.rms_norm_eps,
      tie_word_embeddings=config.tie_embeddings, hidden_act='silu')


def check_matches(config: decoder.DecoderConfig, family: str,
                  **expected: Any) -> None:
  """Raises ValueError where `config` has a field value that `family`'s
  checkpoints cannot express (fields not named keep any value)."""
  for name, value in expected.items():
    got = getattr(config, name)
    if got != value:
      raise ValueError(
          f'{type(config).__name__}.{name}={got!r}: {family} checkpoints'
          f' have {name}={value!r}; save it as another family.')
