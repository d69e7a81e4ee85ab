"""The registry of model families: a name, a config.json `model_type` or a
preset name -> its `Family` (`coat_jax.models.family`)."""

from coat_jax.models import decoder
from coat_jax.models import gemma3
from coat_jax.models import llama
from coat_jax.models import mistral
from coat_jax.models import olmo2
from coat_jax.models import qwen2
from coat_jax.models import qwen3
from coat_jax.models.family import Family

FAMILIES: dict[str, Family] = {f.name: f for f in (
    llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY, olmo2.FAMILY,
    gemma3.FAMILY)}


def by_model_type(model_type: str | None) -> Family:
  """The family that reads config.json's `model_type`.

  Raises:
    ValueError: naming the model_type and the supported ones.
  """
  for f in FAMILIES.values():
    if model_type in f.model_types:
      return f
  supported = sorted(t for f in FAMILIES.values() for t in f.model_types)
  hint = (" (a Gemma 3 with vision: load its text model, model_type"
          " 'gemma3_text')" if model_type == 'gemma3' else '')
  raise ValueError(f'config.json: model_type={model_type!r} is not'
                   f' supported{hint}; supported: {supported}.')


def of_config(config: decoder.DecoderConfig) -> Family:
  """The family whose config class `config` is.

  Raises:
    ValueError: a config that is no family's (e.g. a bare DecoderConfig).
  """
  name = getattr(type(config), 'FAMILY', None)
  if name not in FAMILIES:
    raise ValueError(
        f'{type(config).__name__} is no model family\'s config: use one of'
        f' {[f.config_class.__name__ for f in FAMILIES.values()]}.')
  return FAMILIES[name]


def presets() -> dict[str, Family]:
  """Every preset name -> its family."""
  return {name: f for f in FAMILIES.values()
          for name in f.config_class.PRESETS}


def preset(name: str, **overrides) -> decoder.DecoderConfig:
  """The config of a preset of any family ('1b', 'qwen3_1.7b', ...), with
  field overrides.

  Raises:
    ValueError: an unknown preset, naming the known ones.
  """
  by_name = presets()
  if name not in by_name:
    raise ValueError(f'preset {name!r} is unknown: use one of'
                     f' {sorted(by_name)}.')
  return by_name[name].config_class.preset(name, **overrides)
