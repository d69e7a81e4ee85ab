"""Typed training configuration, config files and command-line overrides.

A config file is a Python file with `get_config() -> Config`. Overrides are
`section.field=value` strings, parsed by the field's declared type.
"""

import dataclasses
import importlib.util
import json
import math
import os
import types
import typing
from typing import Any

from coat_jax import recipes
from coat_jax.models import decoder
from coat_jax.models import families
from coat_jax.models import hf
from coat_jax.models import remat as remat_lib
from coat_jax.models import vlm
from coat_jax.optim.coat_adam import MOMENT_DTYPES
from coat_jax.training import in_backward


def _architecture_fields() -> list[tuple[str, Any, Any]]:
  """ModelConfig's overrides of the architecture: every `DecoderConfig`
  field of a plain type, as an optional field (None: the preset's or the
  checkpoint's value)."""
  hints = typing.get_type_hints(decoder.DecoderConfig)
  fields = []
  for f in dataclasses.fields(decoder.DecoderConfig):
    inner = [a for a in typing.get_args(hints[f.name]) if a is not type(None)]
    kind = inner[0] if len(inner) == 1 else hints[f.name]
    if kind in (int, float, bool, str):
      fields.append((f.name, kind | None, dataclasses.field(default=None)))
  return fields


ModelConfig = dataclasses.make_dataclass(
    'ModelConfig',
    [('preset', str, dataclasses.field(default='tiny')),
     ('recipe', recipes.Recipe | str,
      dataclasses.field(default=recipes.DEFAULT)),
     ('init_from', str | None, dataclasses.field(default=None)),
     ('vision_init_from', str | None, dataclasses.field(default=None)),
     *_architecture_fields()],
    namespace={'__doc__': """The model: a preset with field overrides, or a
  Hugging Face checkpoint, and the recipe it trains with.

  preset: a preset of any family (`coat_jax.models.preset`: 'tiny', '1b',
    'llama2_7b', 'qwen3_1.7b', 'gemma3_1b', ...), or of a vision-language
    model (`coat_jax.models.vlm.PRESETS`: 'vlm_tiny', 'vlm_1b'), which
    trains on data.source=shapes; the other fields then set its decoder's.
  recipe: a `coat_jax.Recipe` or a preset name ('bf16', 'fp8_linear',
    'coat', 'coat_block'); on the command line `model.recipe=coat_block`,
    and a field of it `model.recipe.scaling=block`.
  init_from: a Hugging Face checkpoint directory (config.json +
    safetensors) of a supported family: the first run starts from its
    weights, its config.json sets the architecture (the preset is ignored)
    and data.source=text uses its tokenizer.json.
  vision_init_from: a SigLIP checkpoint directory
    (`coat_jax.models.load_siglip`): a VLM preset's first run starts its
    vision tower from its weights (their config must match the preset's
    ViT; the projector and the decoder start random).
  Every other field overrides the `DecoderConfig` field of its name (None:
  the preset's or the checkpoint's value), e.g. model.num_layers=4,
  model.scan_layers=true, model.remat=full (see `coat_jax.models.remat`).
"""})

# The older names of the recipe and its fields (config files and run
# directories written before recipes): name -> the recipe field it sets
# (None: the recipe itself, by preset name).
LEGACY_RECIPE_FIELDS = {'precision': None, 'scaling': 'scaling',
                        'fuse_qkv': 'fuse_qkv',
                        'fp8_weight_gather': 'fp8_weight_gather'}


def architecture(model: Any) -> decoder.DecoderConfig:
  """The family config `model` (a ModelConfig) describes: its preset's or
  its init_from checkpoint's, with its overrides."""
  overrides = {name: getattr(model, name)
               for name, _, _ in _architecture_fields()
               if getattr(model, name) is not None}
  if model.init_from is not None:
    return hf.config_from_hf(hf.read_hf_config(model.init_from), overrides,
                             prefix='model.')
  if model.preset in vlm.PRESETS:
    return dataclasses.replace(vlm.PRESETS[model.preset].decoder,
                               **overrides)
  return families.preset(model.preset, **overrides)


def vlm_architecture(model: Any) -> vlm.VLMConfig | None:
  """The VLMConfig `model` (a ModelConfig) describes, its decoder
  `architecture(model)`; None for a language model's preset."""
  if model.init_from is not None or model.preset not in vlm.PRESETS:
    return None
  return dataclasses.replace(vlm.PRESETS[model.preset],
                             decoder=architecture(model))


def recipe(model: Any) -> recipes.Recipe:
  """model.recipe as a `Recipe` (a preset name resolved)."""
  return recipes.get(model.recipe, 'model.recipe')


@dataclasses.dataclass
class OptimConfig:
  """AdamW (COAT FP8 moments or plain optax) with warmup + cosine decay."""

  name: str = 'coat_adamw'  # or 'adamw' (optax, float32 moments)
  learning_rate: float = 3e-3
  warmup_steps: int = 20
  end_learning_rate_ratio: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.1
  clip_norm: float = 1.0
  group_size: int = 128
  moment_dtypes: tuple[str, ...] = ('e4m3', 'e4m3')
  expansion: bool = True
  # One fused pass per leaf (coat_adamw with FP8 moments; the Pallas kernel
  # on one Hopper GPU). None: fused whenever the optimizer allows it.
  fused: bool | None = None
  # Each decoder layer's fused step taken inside backward, as soon as its
  # gradient exists, so the layers' gradients are never all live at once
  # (`coat_jax.training.in_backward`, docs/in_backward.md): the fused
  # optimizer, unrolled layers, one microbatch, one device.
  apply_in_backward: bool = False
  # How that step clips, since it cannot know the step's global norm
  # before the first layer steps: 'previous' (by the last finite step's
  # norm, against clip_norm) or 'none'.
  in_backward_clip: str = 'previous'


@dataclasses.dataclass
class DataConfig:
  """Where tokens come from.

  source: 'stdlib' (the running interpreter's standard library .py files,
  byte-level), 'text' (files or globs in `paths`; bytes, or `tokenizer` =
  a Hugging Face tokenizer.json), 'tokens' (pre-tokenized `.npy` or `.bin`
  files of `token_dtype`, memory-mapped) or 'shapes' (images of coloured
  shapes with questions and answers, drawn on the host from train.seed:
  `coat_jax.training.shapes`; for the vision-language presets, whose
  questions fix the text length, so seq_len and val_fraction are unused).
  """

  source: str = 'stdlib'
  paths: tuple[str, ...] = ()
  tokenizer: str | None = None
  token_dtype: str = 'uint16'
  seq_len: int = 128
  val_fraction: float = 0.05


SOURCES = ('stdlib', 'text', 'tokens', 'shapes')


@dataclasses.dataclass
class MeshConfig:
  """Device mesh sizes; -1 means all devices not used by the other axes."""

  data: int = -1
  fsdp: int = 1
  tensor: int = 1


@dataclasses.dataclass
class TrainConfig:
  """The loop: steps, batch, evaluation, checkpoints, faults."""

  steps: int = 250
  batch_size: int = 16
  microbatches: int = 1
  seed: int = 0
  log_every: int = 10
  eval_every: int = 50
  eval_batches: int = 4
  # Saves every checkpoint_every steps (0: no periodic saves); the last step,
  # Ctrl-C and SIGTERM save too.
  checkpoint_every: int = 100
  keep_checkpoints: int = 2
  # false: no checkpoint at all, not even the final state (for runs that
  # only measure; a warning at the start says so).
  save_checkpoints: bool = True
  # A checkpoint that cannot be read (a file missing, cut short or
  # overwritten): 'fallback' reports it and resumes from the newest one
  # before it that restores, moving the damaged ones to
  # run_dir/damaged_checkpoints; 'stop' raises naming its step and file.
  on_damaged_checkpoint: str = 'fallback'
  run_dir: str = 'runs/default'
  on_nonfinite: str = 'skip'  # or 'stop'
  progress_bar: bool = True
  # Also write the metrics as TensorBoard scalars under run_dir/tensorboard
  # (needs tensorboardX).
  tensorboard: bool = False
  # A greedy sample of this many tokens continuing sample_prompt ends a run
  # that trained (0: none); byte-level or data.tokenizer text only.
  sample_tokens: int = 64
  sample_prompt: str = 'def '
  # jax's persistent compilation cache: a rerun of the same step (a resumed
  # run, the same config again) loads XLA's executable instead of compiling
  # it. '' leaves it off; a directory jax already has
  # (JAX_COMPILATION_CACHE_DIR) wins. Past compilation_cache_max_gib the
  # least recently used entries are deleted (0: no bound).
  compilation_cache_dir: str = '~/.cache/coat_jax/compilation'
  compilation_cache_max_gib: float = 10.0
  # 'optimizer': the optimizer state lives in pinned host memory and comes
  # to the device only for the optimizer's step, after backward
  # (docs/design.md#offload), or with optim.apply_in_backward a layer's
  # moments for that layer's step inside backward (docs/in_backward.md);
  # 'none' keeps it on the device.
  offload: str = 'none'


@dataclasses.dataclass
class Config:
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)


def load_config(path: str | os.PathLike | None) -> Config:
  """Runs `get_config()` of a config file; None gives the default `Config()`."""
  if path is None:
    return Config()
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(
        f'--config {path}: no such file (see configs/ for examples).')
  spec = importlib.util.spec_from_file_location('_coat_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, 'get_config'):
    raise ValueError(f'--config {path} must define get_config() -> Config.')
  config = module.get_config()
  if not isinstance(config, Config):
    raise TypeError(f'get_config() in {path} returned {type(config).__name__};'
                    ' it must return coat_jax.training.Config.')
  return config


def _parse(text: str, annotation: Any, name: str) -> Any:
  """Parses `text` as a value of the type `annotation`."""
  if annotation == recipes.Recipe | str:
    return recipes.get(text, name)
  origin = typing.get_origin(annotation)
  if origin in (typing.Union, types.UnionType):
    args = typing.get_args(annotation)
    if text.lower() == 'none' and type(None) in args:
      return None
    (inner,) = [a for a in args if a is not type(None)]
    return _parse(text, inner, name)
  if origin is tuple:
    (inner, _) = typing.get_args(annotation)
    return tuple(_parse(t, inner, name) for t in text.split(',') if t)
  if annotation is bool:
    if text.lower() in ('true', '1', 'yes'):
      return True
    if text.lower() in ('false', '0', 'no'):
      return False
    raise ValueError(f'{name}={text!r}: expected true or false.')
  try:
    return annotation(text)
  except ValueError:
    raise ValueError(
        f'{name}={text!r}: expected a value of type {annotation.__name__}.'
    ) from None


def apply_overrides(config: Config, overrides: list[str]) -> Config:
  """Returns a copy of `config` with `section.field=value` overrides applied
  (`model.recipe.field=value` sets a field of the recipe; the older
  `model.precision`, `model.scaling`, `model.fuse_qkv` and
  `model.fp8_weight_gather` set the recipe and its fields).

  Raises:
    ValueError: malformed override, unknown field or unparsable value.
  """
  config = _deep_copy(config)
  for item in overrides:
    if '=' not in item:
      raise ValueError(f'override {item!r} must look like section.field=value'
                       ' (e.g. train.batch_size=16).')
    dotted, text = item.split('=', 1)
    *parents, field = _legacy_name(dotted).split('.')
    if parents == ['model', 'recipe']:
      _set_recipe_field(config.model, field, text, dotted)
      continue
    target = config
    for part in parents:
      if not dataclasses.is_dataclass(target) or not hasattr(target, part):
        raise ValueError(f'override {dotted!r}: unknown section {part!r};'
                         f' sections are {_field_names(Config)}.')
      target = getattr(target, part)
    if not dataclasses.is_dataclass(target) or field not in _field_names(
        type(target)):
      known = _field_names(type(target)) if dataclasses.is_dataclass(
          target) else []
      raise ValueError(f'override {dotted!r}: unknown field {field!r}; known'
                       f' fields here: {known}.')
    hints = typing.get_type_hints(type(target))
    setattr(target, field, _parse(text, hints[field], dotted))
  return config


def _legacy_name(dotted: str) -> str:
  """model.precision -> model.recipe, model.scaling -> model.recipe.scaling
  (`LEGACY_RECIPE_FIELDS`); other names unchanged."""
  section, _, field = dotted.partition('.')
  if section != 'model' or field not in LEGACY_RECIPE_FIELDS:
    return dotted
  inner = LEGACY_RECIPE_FIELDS[field]
  return 'model.recipe' + (f'.{inner}' if inner else '')


def _set_recipe_field(model: Any, field: str, text: str, name: str) -> None:
  """model.recipe with one field replaced, parsed by its declared type."""
  hints = typing.get_type_hints(recipes.Recipe)
  if field not in hints:
    raise ValueError(f'override {name!r}: Recipe has no field {field!r};'
                     f' its fields: {_field_names(recipes.Recipe)}.')
  current = recipes.get(model.recipe, 'model.recipe')
  try:
    model.recipe = dataclasses.replace(
        current, **{field: _parse(text, hints[field], name)})
  except (TypeError, ValueError) as e:
    raise ValueError(f'{name}={text!r}: {e}') from None


def can_fuse(o: OptimConfig) -> bool:
  """Whether `fused_coat_adamw` can run this optimizer."""
  return o.name == 'coat_adamw' and 'float32' not in o.moment_dtypes


def uses_fused_optimizer(o: OptimConfig) -> bool:
  """optim.fused resolved: None means fused where it can run."""
  return can_fuse(o) if o.fused is None else o.fused


def _field_names(cls) -> list[str]:
  return [f.name for f in dataclasses.fields(cls)]


def _deep_copy(config: Config) -> Config:
  return dataclasses.replace(config, **{
      f.name: dataclasses.replace(getattr(config, f.name))
      for f in dataclasses.fields(config)})


@dataclasses.dataclass(frozen=True)
class Range:
  """An interval of allowed values; `str` gives it as the errors say it."""

  low: float
  high: float = math.inf
  include_low: bool = True
  include_high: bool = False
  note: str = ''

  def __contains__(self, value: float) -> bool:
    above = value >= self.low if self.include_low else value > self.low
    below = value <= self.high if self.include_high else value < self.high
    return above and below

  def __str__(self) -> str:
    if self.high != math.inf:
      text = (f'in {"[" if self.include_low else "("}{self.low},'
              f' {self.high}{"]" if self.include_high else ")"}')
    elif self.include_low:
      text = f'>= {self.low}'
    else:
      text = 'positive' if self.low == 0 else f'> {self.low}'
    return text + (f' ({self.note})' if self.note else '')


POSITIVE = Range(0, include_low=False)
NON_NEGATIVE = Range(0)

# The allowed values of every numeric field (unset model fields, None, are
# skipped); every float must also be finite. The architecture's sizes are
# those `decoder.DecoderConfig` requires, named by their config field.
RANGES = {
    'model.vocab_size': POSITIVE,
    'model.hidden_size': POSITIVE,
    'model.intermediate_size': POSITIVE,
    'model.num_layers': POSITIVE,
    'model.num_heads': POSITIVE,
    'model.num_kv_heads': POSITIVE,
    'model.max_seq_len': POSITIVE,
    'model.head_dim': POSITIVE,
    'model.sliding_window': POSITIVE,
    'model.sliding_window_pattern': POSITIVE,
    'model.rope_theta': POSITIVE,
    'model.rope_local_theta': POSITIVE,
    'model.rms_norm_eps': POSITIVE,
    'model.init_std': POSITIVE,
    'model.query_scale': POSITIVE,
    'optim.learning_rate': Range(0, include_low=False,
                                 note='the peak of the schedule'),
    'optim.warmup_steps': NON_NEGATIVE,
    'optim.end_learning_rate_ratio': Range(
        0, 1, include_high=True,
        note='the final learning rate over the peak'),
    'optim.b1': Range(0, 1, note="the first moment's decay"),
    'optim.b2': Range(0, 1, note="the second moment's decay"),
    'optim.eps': POSITIVE,
    'optim.weight_decay': Range(0, note='0: none'),
    'optim.clip_norm': Range(0, include_low=False,
                             note='the largest global gradient norm'),
    'optim.group_size': POSITIVE,
    'data.seq_len': POSITIVE,
    'data.val_fraction': Range(0, 1, include_low=False),
    'train.steps': POSITIVE,
    'train.batch_size': POSITIVE,
    'train.microbatches': POSITIVE,
    'train.seed': NON_NEGATIVE,
    'train.log_every': POSITIVE,
    'train.eval_every': POSITIVE,
    'train.eval_batches': POSITIVE,
    'train.checkpoint_every': Range(0, note='0: no periodic saves'),
    'train.keep_checkpoints': POSITIVE,
    'train.sample_tokens': Range(0, note='0: no sample'),
    'train.compilation_cache_max_gib': Range(0, note='0: no bound'),
}


# Where train.offload may keep state in host memory.
OFFLOADS = ('none', 'optimizer')


def validate(config: Config, num_devices: int) -> None:
  """Checks values and their combinations; raises ValueError naming the field.

  Args:
    config: the resolved configuration.
    num_devices: how many devices the mesh must cover.
  """
  for section in dataclasses.fields(config):
    sub = getattr(config, section.name)
    _check_no_unknown_attributes(section.name, sub)
    hints = typing.get_type_hints(type(sub))
    for f in dataclasses.fields(sub):
      value = getattr(sub, f.name)
      name = f'{section.name}.{f.name}'
      if not _is_instance(value, hints[f.name]):
        raise ValueError(f'{name}={value!r} has type {type(value).__name__};'
                         f' expected {hints[f.name]}.')
      if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f'{name} must be a finite number, got {value!r}.')
  m, o, d, t = config.model, config.optim, config.data, config.train
  recipe(m)  # a Recipe, or a preset's name
  known = sorted(families.presets()) + sorted(vlm.PRESETS)
  if m.init_from is None and m.preset not in known:
    raise ValueError(f'model.preset={m.preset!r} is unknown: use one of'
                     f' {known}.')
  _check_task(m, d)
  if m.vision_init_from is not None and vlm_architecture(m) is None:
    raise ValueError(
        f'model.vision_init_from={m.vision_init_from} loads a VLM\'s vision'
        f' tower, but model.preset={m.preset!r} has none: set model.preset'
        f' to one of {sorted(vlm.PRESETS)} (or drop the field).')
  if m.remat is not None:
    remat_lib.check_policy(m.remat, 'model.remat')
  _one_of('optim.name', o.name, ('coat_adamw', 'adamw'))
  _one_of('optim.in_backward_clip', o.in_backward_clip, in_backward.CLIPS)
  _one_of('data.source', d.source, SOURCES)
  _one_of('data.token_dtype', d.token_dtype, ('uint16', 'uint32'))
  _one_of('train.on_nonfinite', t.on_nonfinite, ('skip', 'stop'))
  _one_of('train.on_damaged_checkpoint', t.on_damaged_checkpoint,
          ('fallback', 'stop'))
  _one_of('train.offload', t.offload, OFFLOADS)
  for name, allowed in RANGES.items():
    section, field = name.split('.')
    value = getattr(getattr(config, section), field)
    if value is not None and value not in allowed:
      raise ValueError(f'{name} must be {allowed}, got {value!r}.')
  if len(o.moment_dtypes) != 2 or not set(o.moment_dtypes) <= set(
      MOMENT_DTYPES):
    raise ValueError(f'optim.moment_dtypes={",".join(o.moment_dtypes)!r}'
                     ' must be two formats (first moment, second moment) of'
                     f' {MOMENT_DTYPES}, e.g. e4m3,e4m3.')
  _check_run_dir(t.run_dir)
  if t.sample_tokens and not t.sample_prompt:
    raise ValueError('train.sample_prompt is empty: give some text to'
                     ' continue, or set train.sample_tokens=0.')
  if o.fused and not can_fuse(o):
    raise ValueError('optim.fused=true needs optim.name=coat_adamw with FP8'
                     f' moments (got {o.name}, {o.moment_dtypes}).')
  if o.apply_in_backward:
    in_backward.check_supported(
        fused_optimizer=uses_fused_optimizer(o),
        scan_layers=architecture(m).scan_layers,
        microbatches=t.microbatches, num_devices=num_devices)
  if d.source in ('text', 'tokens') and not d.paths:
    raise ValueError(f'data.source={d.source!r} needs data.paths (files or'
                     ' globs, comma-separated).')
  sizes = mesh_shape(config.mesh, num_devices)
  data_shards = sizes[0] * sizes[1]
  if t.batch_size % t.microbatches:
    raise ValueError(f'train.batch_size={t.batch_size} must be a multiple of'
                     f' train.microbatches={t.microbatches}.')
  micro = t.batch_size // t.microbatches
  if micro % data_shards:
    raise ValueError(
        f'the microbatch ({t.batch_size} / {t.microbatches} = {micro}) must be'
        f' divisible by mesh.data x mesh.fsdp = {data_shards}: change'
        ' train.batch_size, train.microbatches or the mesh.')


def _check_task(model: Any, data: DataConfig) -> None:
  """Raises ValueError unless the model and the data are of one task: a
  vision-language preset on data.source=shapes, a language model on text."""
  is_vlm = model.init_from is None and model.preset in vlm.PRESETS
  if is_vlm and data.source != 'shapes':
    raise ValueError(
        f'model.preset={model.preset!r} is a vision-language model; it'
        ' trains on images: set data.source=shapes (got'
        f' {data.source!r}).')
  if data.source == 'shapes' and not is_vlm:
    what = ('model.init_from (a language model)' if model.init_from
            else f'model.preset={model.preset!r}')
    raise ValueError(
        f'data.source=shapes trains a vision-language model, not {what}:'
        f' set model.preset to one of {sorted(vlm.PRESETS)}.')


def _check_run_dir(run_dir: str) -> None:
  """Raises ValueError unless `run_dir` is, or can be made, a directory."""
  if not run_dir:
    raise ValueError('train.run_dir is empty: name the directory for the'
                     ' run\'s checkpoints and metrics.')
  existing = run_dir
  while existing and not os.path.exists(existing):
    existing = os.path.dirname(existing.rstrip(os.sep))
  if existing and not os.path.isdir(existing):
    where = ('is a file' if existing == run_dir else
             f'cannot be made: {existing} is a file')
    raise ValueError(
        f'train.run_dir={run_dir} {where}; it must be a directory (where the'
        ' run keeps its checkpoints and metrics): choose another'
        ' train.run_dir.')


def _check_no_unknown_attributes(section: str, sub: Any) -> None:
  """Raises ValueError for an attribute a config file set that is no field
  of its section (it would be ignored), naming the field to use."""
  for name in sorted(set(vars(sub)) - set(_field_names(type(sub)))):
    if section == 'model' and name in LEGACY_RECIPE_FIELDS:
      inner = LEGACY_RECIPE_FIELDS[name]
      use = ('model.recipe = ...' if inner is None else
             f'model.recipe = dataclasses.replace(recipe, {inner}=...)')
      raise ValueError(f'model.{name} is the older name of a recipe setting'
                       f' and is not read: set {use} (a preset name or a'
                       ' coat_jax.Recipe).')
    raise ValueError(f'{section}.{name} is no field of {section} and would'
                     f' be ignored; its fields: {_field_names(type(sub))}.')


def _one_of(name: str, value: Any, allowed: tuple) -> None:
  if value not in allowed:
    raise ValueError(f'{name}={value!r} must be one of {allowed}.')


def _is_instance(value: Any, annotation: Any) -> bool:
  origin = typing.get_origin(annotation)
  if origin in (typing.Union, types.UnionType):
    return any(_is_instance(value, a) for a in typing.get_args(annotation))
  if annotation is type(None):
    return value is None
  if origin is tuple:
    (inner, _) = typing.get_args(annotation)
    return isinstance(value, tuple) and all(
        _is_instance(v, inner) for v in value)
  if annotation is float:
    return isinstance(value, int | float) and not isinstance(value, bool)
  if annotation is int:
    return isinstance(value, int) and not isinstance(value, bool)
  return isinstance(value, annotation)


def mesh_shape(mesh: MeshConfig, num_devices: int) -> tuple[int, int, int]:
  """(data, fsdp, tensor) sizes, filling the one -1 with what is left."""
  sizes = [mesh.data, mesh.fsdp, mesh.tensor]
  names = ('mesh.data', 'mesh.fsdp', 'mesh.tensor')
  for name, size in zip(names, sizes):
    if size == 0 or size < -1:
      raise ValueError(f'{name}={size} must be positive or -1 (fill).')
  if sizes.count(-1) > 1:
    raise ValueError('at most one of mesh.data, mesh.fsdp, mesh.tensor may be'
                     ' -1.')
  known = 1
  for s in sizes:
    known *= s if s != -1 else 1
  if -1 in sizes:
    if num_devices % known:
      raise ValueError(
          f'the mesh axes given multiply to {known}, which does not divide'
          f' the {num_devices} devices.')
    sizes[sizes.index(-1)] = num_devices // known
  if sizes[0] * sizes[1] * sizes[2] != num_devices:
    raise ValueError(
        f'mesh data={sizes[0]} x fsdp={sizes[1]} x tensor={sizes[2]} ='
        f' {sizes[0] * sizes[1] * sizes[2]} devices, but there are'
        f' {num_devices}: set the sizes to multiply to {num_devices}'
        ' (one may be -1 to fill).')
  return tuple(sizes)


def to_dict(config: Config) -> dict:
  """A JSON-ready dict of the config."""
  return dataclasses.asdict(config)


def from_dict(values: dict) -> Config:
  """The Config of `to_dict` output (e.g. a run's config.json); fields it
  lacks (written by an older version) keep their defaults, and the older
  names of the recipe (`LEGACY_RECIPE_FIELDS`) set it.

  Raises:
    ValueError: an unknown section or field.
  """
  sections = {}
  for section in dataclasses.fields(Config):
    cls = section.default_factory
    given = dict(values.get(section.name, {}))
    if section.name == 'model':
      given = _model_from_dict(given)
    unknown = set(given) - set(_field_names(cls))
    if unknown:
      raise ValueError(f'{section.name}: unknown fields {sorted(unknown)}.')
    hints = typing.get_type_hints(cls)
    for name, value in given.items():
      if isinstance(value, list) and _is_tuple(hints[name]):
        given[name] = tuple(value)
    sections[section.name] = cls(**given)
  unknown = set(values) - set(sections)
  if unknown:
    raise ValueError(f'unknown config sections {sorted(unknown)}.')
  return Config(**sections)


def read_run_config(run_dir: str | os.PathLike) -> Config:
  """The Config that train.py saved in RUN_DIR/config.json.

  Raises:
    FileNotFoundError: `run_dir` has no config.json.
  """
  path = os.path.join(run_dir, 'config.json')
  if not os.path.isfile(path):
    raise FileNotFoundError(f'{run_dir}: no config.json; give a run directory'
                            ' that train.py wrote (train.run_dir).')
  with open(path) as f:
    return from_dict(json.load(f))


def _model_from_dict(given: dict) -> dict:
  """The model section's dict with its recipe a `Recipe` (from a dict or a
  preset name, or from the older precision/scaling/fuse_qkv/
  fp8_weight_gather keys)."""
  given = dict(given)
  legacy = {k: given.pop(k) for k in list(given) if k in LEGACY_RECIPE_FIELDS}
  recipe_value = given.get('recipe', legacy.pop('precision', None))
  if isinstance(recipe_value, dict):
    recipe_value = recipes.Recipe(**recipe_value)
  recipe_value = recipes.get(recipe_value if recipe_value is not None
                             else recipes.DEFAULT, 'model.recipe')
  fields = {LEGACY_RECIPE_FIELDS[k]: v for k, v in legacy.items()}
  given['recipe'] = dataclasses.replace(recipe_value, **fields)
  return given


def _is_tuple(annotation: Any) -> bool:
  return typing.get_origin(annotation) is tuple
