"""Hugging Face checkpoints (config.json + safetensors) <-> `Decoder`.

config.json's `model_type` picks the family (`coat_jax.models.families`),
which translates the config and names the layer norms; the rest of the name
map is shared. HF `nn.Linear` weights are (out, in); coat_jax kernels are
(in, out), and the decoder layers are stacked along a leading num_layers
axis. HF's q/k weights are laid out for `rotate_half` (split halves), which
is what `decoder.apply_rope` does, so no head permutation is needed.
Reading needs only `safetensors` and numpy (BF16 through ml_dtypes), never
torch.
"""

from collections.abc import Callable
from collections.abc import Mapping
import contextlib
import glob
import json
import math
import os
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401 (registers numpy's 'bfloat16' for safetensors)
import numpy as np

from coat_jax import conversion
from coat_jax import recipes
from coat_jax.models import decoder
from coat_jax.models import families
from coat_jax.models import vit

CONFIG_FILE = 'config.json'
SINGLE_FILE = 'model.safetensors'
INDEX_FILE = 'model.safetensors.index.json'

# coat_jax param path -> (HF tensor name, transposed), outside the layers.
_TOP = {
    ('embed',): ('model.embed_tokens.weight', False),
    ('norm', 'scale'): ('model.norm.weight', False),
    ('lm_head',): ('lm_head.weight', True),
}
# A decoder layer's modules with projections -> their HF prefix.
_BLOCKS = {'attn': 'self_attn', 'mlp': 'mlp'}


def _safetensors():
  """The `safetensors` package (the 'hf' extra), imported on first use."""
  try:
    import safetensors.numpy  # noqa: PLC0415 (optional dependency)
  except ImportError:
    raise ImportError(
        "Hugging Face checkpoints need the `safetensors` package: pip install"
        " 'coat-jax[hf]' (or pip install safetensors).") from None
  return safetensors


def read_hf_config(path: str | os.PathLike) -> dict:
  """The parsed `config.json` of an HF checkpoint directory."""
  file = os.path.join(os.fspath(path), CONFIG_FILE)
  if not os.path.isfile(file):
    raise FileNotFoundError(
        f'{file}: no such file; pass a Hugging Face checkpoint directory'
        ' (config.json and *.safetensors, e.g. from save_pretrained).')
  return _read_json(file)


def _read_json(file: str) -> dict:
  """A JSON object file; a file that is not one is named as damaged."""
  with open(file) as f:
    try:
      value = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f'{file} is damaged or incomplete (not JSON: {e});'
                       ' download or write it again.') from None
  if not isinstance(value, dict):
    raise ValueError(f'{file} is damaged: it holds a JSON'
                     f' {type(value).__name__}, not an object.')
  return value


def config_from_hf(hf: dict, overrides: dict | None = None, *,
                   prefix: str = '') -> decoder.DecoderConfig:
  """The family config of an HF config.json dict (its `model_type` picks
  the family).

  Args:
    hf: the parsed config.json.
    overrides: config fields to set; those the weights decide
      (`family.FROM_CHECKPOINT`) must agree with the checkpoint.
    prefix: prepended to override names in errors (e.g. 'model.').

  Raises:
    ValueError: an unsupported model_type or option (naming the config.json
      field and what is supported), or an override that conflicts with the
      checkpoint.
  """
  return families.by_model_type(hf.get('model_type')).config_from_hf(
      hf, overrides, prefix=prefix)


def hf_config(config: decoder.DecoderConfig, dtype: str = 'float32') -> dict:
  """The HF config.json dict of a family config (transformers 4 and 5 read
  it)."""
  return dict(**families.of_config(config).to_hf(config), torch_dtype=dtype,
              dtype=dtype)


class _Tensors:
  """Lazy, sliceable access to the tensors of a single-file or sharded
  safetensors checkpoint (only the slices asked for are read)."""

  def __init__(self, path: str):
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
      weight_map = _read_json(index).get('weight_map')
      if not isinstance(weight_map, dict):
        raise ValueError(f'{index} has no "weight_map": it is damaged or'
                         ' incomplete; download the checkpoint again.')
    elif os.path.isfile(os.path.join(path, SINGLE_FILE)):
      weight_map = None
    else:
      raise FileNotFoundError(
          f'{path} has neither {SINGLE_FILE} nor {INDEX_FILE}; coat_jax reads'
          ' safetensors checkpoints only.')
    self._path, self._map, self._files = path, weight_map, {}
    self._keys = {}
    self._stack = contextlib.ExitStack()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.release()

  def release(self) -> None:
    """Closes the open files: their mapped pages stop counting as ours."""
    self._stack.close()
    self._stack = contextlib.ExitStack()
    self._files.clear()

  def _file(self, name: str):
    file = SINGLE_FILE if self._map is None else self._map.get(name)
    if file is None:
      raise ValueError(f'{self._path}/{INDEX_FILE} has no tensor {name!r}.')
    if file not in self._files:
      full = os.path.join(self._path, file)
      if not os.path.isfile(full):
        raise FileNotFoundError(
            f'{full}: missing shard ({INDEX_FILE} puts {name!r} in it);'
            ' download the complete checkpoint.')
      safetensors = _safetensors()
      try:
        handle = safetensors.safe_open(full, framework='np')
      except safetensors.SafetensorError as e:
        raise ValueError(
            f'{full} is damaged or incomplete ({os.path.getsize(full)} bytes;'
            f' safetensors: {e}): download or save the checkpoint again.'
        ) from None
      self._files[file] = self._stack.enter_context(handle)
      self._keys[file] = set(self._files[file].keys())
    if self._map is None and name not in self._keys[file]:
      raise ValueError(f'{self._path}/{SINGLE_FILE} has no tensor {name!r}.')
    return self._files[file]

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._file(name).get_slice(name).get_shape())

  def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
    return self._file(name).get_slice(name)[index]


def _flat(tree: dict) -> dict:
  return {tuple(str(k.key) for k in path): leaf for path, leaf in
          jax.tree_util.tree_leaves_with_path(tree)}


def _unflat(flat: dict) -> dict:
  tree = {}
  for path, leaf in flat.items():
    node = tree
    for k in path[:-1]:
      node = node.setdefault(k, {})
    node[path[-1]] = leaf
  return tree


def _hf_names(path: tuple[str, ...], num_layers: int,
              norm_names: Mapping[str, str]):
  """([HF names], transposed, stacked) of a coat_jax param path."""
  if path in _TOP:
    name, transposed = _TOP[path]
    return [name], transposed, False
  name = None
  if path[0] == 'layers' and len(path) == 3 and path[1] in norm_names:
    name, transposed = f'{norm_names[path[1]]}.weight', False
  elif path[0] == 'layers' and len(path) == 4 and path[1] in _BLOCKS:
    leaf = {'kernel': 'weight', 'scale': 'weight', 'bias': 'bias'}.get(
        path[3])
    if leaf is not None:
      name = f'{_BLOCKS[path[1]]}.{path[2]}.{leaf}'
      transposed = path[3] == 'kernel'
  if name is None:
    raise ValueError(f'no Hugging Face tensor for the param {path}.')
  return ([f'model.layers.{i}.{name}' for i in range(num_layers)],
          transposed, True)


def load_hf_params(path: str | os.PathLike, abstract_params: dict,
                   shardings: dict | None = None, *,
                   norm_names: Mapping[str, str] | None = None) -> dict:
  """Reads a checkpoint's weights into a `Decoder`'s param tree.

  Each HF tensor goes through `jax.make_array_from_callback`: every device
  reads (and transposes, casts) only its own shard of it, and stacked layer
  params are written into place layer by layer, so the host never holds
  more than one tensor.

  Args:
    path: the checkpoint directory.
    abstract_params: `nnx.to_pure_dict` of the model's `nnx.Param` state
      (arrays or ShapeDtypeStructs: shapes and dtypes to produce).
    shardings: the same tree of `jax.sharding.Sharding`s, or None (the
      default device).
    norm_names: the family's layer norm names (`Family.norm_names`), or
      None to read them from the checkpoint's config.json.

  Returns:
    The param tree, each leaf of its abstract dtype on its sharding.

  Raises:
    FileNotFoundError: no safetensors, or a shard of the index is missing.
    ValueError: a tensor is missing or its shape does not match.
  """
  path = os.fspath(path)
  if norm_names is None:
    norm_names = families.by_model_type(
        read_hf_config(path).get('model_type')).norm_names
  with _Tensors(path) as tensors:
    return _read_params(path, tensors, abstract_params, shardings,
                        norm_names)


def _num_layers(flat: dict) -> int:
  return next(a.shape[0] for p, a in flat.items() if p[0] == 'layers')


def _read_params(path: str, tensors: '_Tensors', abstract_params: dict,
                 shardings: dict | None,
                 norm_names: Mapping[str, str]) -> dict:
  flat = _flat(abstract_params)
  flat_shardings = (_flat(shardings) if shardings is not None else {})
  default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  num_layers = _num_layers(flat)
  out = {}
  for p, abstract in flat.items():
    names, transposed, stacked = _hf_names(p, num_layers, norm_names)
    shape = tuple(abstract.shape[1:] if stacked else abstract.shape)
    want = shape[::-1] if transposed else shape
    for name in names:
      got = tensors.shape(name)
      if got != want:
        raise ValueError(
            f'{path}: tensor {name!r} has shape {got}; config.json implies'
            f' {want} (coat_jax param {"/".join(p)} {abstract.shape}).')
    sharding = flat_shardings.get(p, default)
    if stacked:
      out[p] = _stack_layers(tensors, names, transposed, abstract, sharding)
    else:
      out[p] = jax.make_array_from_callback(
          shape, sharding,
          _shard_reader(tensors, names[0], transposed, abstract.dtype))
    tensors.release()
  return _unflat(out)


def _stack_layers(tensors: _Tensors, names: list[str], transposed: bool,
                  abstract: Any, sharding: jax.sharding.Sharding):
  """A stacked (num_layers, ...) param, written into place one layer at a
  time, so the host holds one layer's shard, not the whole stack."""
  shape, dtype = tuple(abstract.shape), abstract.dtype
  layer_sharding = sharding
  if isinstance(sharding, jax.sharding.NamedSharding):
    layer_sharding = jax.sharding.NamedSharding(
        sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec[1:]))
  stack = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()
  put = jax.jit(
      lambda stack, layer, i: jax.lax.dynamic_update_index_in_dim(
          stack, layer, i, 0),
      out_shardings=sharding, donate_argnums=0)
  for i, name in enumerate(names):
    layer = jax.make_array_from_callback(
        shape[1:], layer_sharding,
        _shard_reader(tensors, name, transposed, dtype))
    stack = put(stack, layer, i)
    tensors.release()
  return stack


def _shard_reader(tensors: _Tensors, name: str, transposed: bool,
                  dtype: Any) -> Callable:
  """index -> that slice of the coat_jax-layout tensor `name`, as dtype."""
  cache = {}

  def read(index):
    key = tuple((s.start, s.stop, s.step) for s in index)
    if key not in cache:  # Replicated shards read once.
      x = tensors.read(name, tuple(index[::-1]) if transposed else index)
      cache.clear()
      cache[key] = np.asarray(x.T if transposed else x, dtype=dtype)
    return cache[key]

  return read


def load_hf(path: str | os.PathLike,
            recipe: recipes.Recipe | str | None = None, *,
            shardings: dict | None = None, dtype: Any = jnp.bfloat16,
            param_dtype: Any = jnp.float32,
            implementation: str | None = None,
            precision: str | None = None,
            **config_overrides: Any) -> nnx.Module:
  """A `Decoder` with the weights of an HF checkpoint directory of any
  supported family (config.json's model_type: llama, mistral, qwen2,
  qwen3, olmo2, gemma3_text), or a SigLIP vision tower ('siglip_vision_model'
  or 'siglip', `load_siglip`) as a `vit.ViT` converted with the recipe
  (`coat_jax.convert`; its `conversion` is the report).

  Args:
    path: directory with config.json and model.safetensors (or sharded
      model-*.safetensors with model.safetensors.index.json).
    recipe: a `coat_jax.Recipe` or a preset name (default
      `recipes.COAT`).
    shardings: a tree of Shardings shaped like
      `nnx.to_pure_dict(nnx.state(model, nnx.Param))` (e.g. the params'
      part of `coat_jax.training.build(...).state_shardings`); None: the
      default device.
    dtype: activation dtype (bfloat16; float32 for exact comparisons).
    param_dtype: parameter dtype (float32 master weights).
    implementation: `fp8_matmul` implementation.
    precision: the older name of `recipe` (a preset name).
    **config_overrides: other config fields (max_seq_len, scan_layers,
      remat); the weights' dimensions cannot be changed.

  Returns:
    The model, params placed per `shardings`.
  """
  hf = read_hf_config(path)
  if hf.get('model_type') in SIGLIP_MODEL_TYPES:
    return _load_siglip(path, recipes.from_arguments(recipe, precision),
                        shardings=shardings, dtype=dtype,
                        param_dtype=param_dtype, overrides=config_overrides)
  family = families.by_model_type(hf.get('model_type'))
  config = family.config_from_hf(hf, config_overrides)
  recipe = recipes.from_arguments(recipe, precision)

  def make():
    with nnx.use_eager_sharding(False):
      return family.model(config, recipe=recipe, dtype=dtype,
                          param_dtype=param_dtype,
                          implementation=implementation, rngs=nnx.Rngs(0))

  graphdef, abstract, rest = nnx.split(nnx.eval_shape(make), nnx.Param, ...)
  params = load_hf_params(path, nnx.to_pure_dict(abstract), shardings,
                          norm_names=family.norm_names)
  nnx.replace_by_pure_dict(abstract, params)
  return nnx.merge(graphdef, abstract, rest)


# config.json model_types of SigLIP checkpoints whose vision tower load_hf
# reads.
SIGLIP_MODEL_TYPES = ('siglip_vision_model', 'siglip')


def _load_siglip(path, recipe, *, shardings, dtype, param_dtype,
                 overrides) -> nnx.Module:
  """`load_hf` of a SigLIP checkpoint: its vision tower, converted."""
  if shardings is not None or overrides:
    raise ValueError(
        f'load_hf({path}): a SigLIP vision tower loads onto the default'
        ' device with its checkpoint\'s config; drop '
        + ('shardings (place it afterwards with jax.device_put)'
           if shardings is not None else f'{sorted(overrides)}') + '.')
  group = (recipe.activation_group_size if recipe.fp8_activations
           else None)
  tower = load_siglip(path, dtype=dtype, param_dtype=param_dtype,
                          activation_group_size=group)
  tower.conversion = conversion.convert(tower, recipe)
  return tower


def _host(x: jax.Array) -> np.ndarray:
  if not x.is_fully_addressable:
    from jax.experimental import multihost_utils  # noqa: PLC0415
    x = multihost_utils.process_allgather(x, tiled=True)
  return np.asarray(jax.device_get(x))


def save_hf(model: decoder.Decoder, path: str | os.PathLike, *,
            dtype: str = 'float32', max_shard_size: int = 5 * 2**30,
            extra_config: Mapping[str, Any] | None = None) -> None:
  """Writes `model` as an HF checkpoint of its family that
  `transformers.AutoModelForCausalLM.from_pretrained(path)` loads.

  Args:
    model: a `Decoder` whose config is a family's (`LlamaConfig`,
      `Qwen3Config`, ...).
    path: output directory (created; existing files of the same names are
      replaced).
    dtype: 'float32' or 'bfloat16' for the saved weights.
    max_shard_size: bytes per safetensors file; larger models are sharded
      with a model.safetensors.index.json.
    extra_config: more config.json fields that the architecture does not
      set, e.g. the bos_token_id, eos_token_id and pad_token_id of the
      checkpoint the model was trained from.

  In a multi-process run every process calls it (sharded params are
  gathered one tensor at a time) and process 0 writes the files.
  """
  if dtype not in ('float32', 'bfloat16'):
    raise ValueError(f"dtype={dtype!r} must be 'float32' or 'bfloat16'.")
  if max_shard_size <= 0:
    raise ValueError(f'max_shard_size={max_shard_size} must be positive.')
  np_dtype = np.dtype(dtype)
  config = model.config
  family = families.of_config(config)
  hf = hf_config(config, dtype)  # before writing: refuses what HF lacks
  clash = sorted(set(extra_config or {}) & set(hf))
  if clash:
    raise ValueError(f'extra_config sets {clash}, which the architecture'
                     ' sets: leave them out.')
  hf.update(extra_config or {})
  params = _flat(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  # (HF name, param path, layer or None, HF shape), in the HF order.
  entries = []
  for p, x in params.items():
    names, transposed, stacked = _hf_names(p, config.num_layers,
                                           family.norm_names)
    shape = tuple(x.shape[1:] if stacked else x.shape)
    shape = shape[::-1] if transposed else shape
    for i, name in enumerate(names):
      entries.append((name, p, i if stacked else None, shape, transposed))
  entries.sort(key=lambda e: e[0])
  shards, size = [[]], 0
  for e in entries:
    nbytes = math.prod(e[3]) * np_dtype.itemsize
    if shards[-1] and size + nbytes > max_shard_size:
      shards.append([])
      size = 0
    shards[-1].append(e)
    size += nbytes
  path = os.fspath(path)
  # Every process joins the gathers of sharded params; process 0 writes.
  lead = jax.process_index() == 0
  if lead:
    os.makedirs(path, exist_ok=True)
    for stale in (glob.glob(os.path.join(path, 'model-*-of-*.safetensors'))
                  + [os.path.join(path, SINGLE_FILE),
                     os.path.join(path, INDEX_FILE)]):
      if os.path.exists(stale):
        os.remove(stale)
  weight_map = {}
  for n, shard in enumerate(shards):
    file = (SINGLE_FILE if len(shards) == 1 else
            f'model-{n + 1:05d}-of-{len(shards):05d}.safetensors')
    tensors = {}
    for name, p, layer, _, transposed in shard:
      x = params[p] if layer is None else params[p][layer]
      x = _host(x).astype(np_dtype)
      tensors[name] = np.ascontiguousarray(x.T if transposed else x)
      weight_map[name] = file
    if lead:
      _safetensors().numpy.save_file(tensors, os.path.join(path, file),
                                     metadata={'format': 'pt'})
  if not lead:
    return
  if len(shards) > 1:
    total = sum(math.prod(e[3]) for e in entries) * np_dtype.itemsize
    with open(os.path.join(path, INDEX_FILE), 'w') as f:
      json.dump({'metadata': {'total_size': total},
                 'weight_map': weight_map}, f, indent=2)
  with open(os.path.join(path, CONFIG_FILE), 'w') as f:
    json.dump(hf, f, indent=2)


# --- SigLIP checkpoints -----------------------------------------------------

# SiglipVisionConfig's defaults: a full 'siglip' config.json may list only
# the fields that differ from them.
_SIGLIP_DEFAULTS = dict(
    image_size=224, patch_size=16, num_channels=3, hidden_size=768,
    intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
    layer_norm_eps=1e-6, hidden_act='gelu_pytorch_tanh')
_SIGLIP_ACTIVATIONS = {'gelu_pytorch_tanh': 'gelu_tanh',
                       'gelu_new': 'gelu_tanh', 'gelu': 'gelu'}
# Where a checkpoint keeps the vision tower: a full SigLIP model and
# transformers 4's SiglipVisionModel under 'vision_model.', transformers
# 5's SiglipVisionModel at the top.
_PREFIXES = {'siglip': ('vision_model.',),
             'siglip_vision_model': ('vision_model.', '')}
_PROBE = 'embeddings.patch_embedding.weight'


def config_from_siglip(hf_config: dict) -> vit.ViTConfig:
  """The ViTConfig of a SigLIP config.json dict: model_type
  'siglip_vision_model' (a `SiglipVisionModel`), or 'siglip' (its
  `vision_config`).

  Raises:
    ValueError: another model_type, or an activation the ViT lacks (naming
      the config.json field).
  """
  model_type = hf_config.get('model_type')
  if model_type not in _PREFIXES:
    raise ValueError(
        f'config.json: model_type={model_type!r} is not a SigLIP vision'
        f' tower; load_siglip reads {sorted(_PREFIXES)}.')
  field = 'vision_config.' if model_type == 'siglip' else ''
  vision = hf_config.get('vision_config') or {}
  hf_vision = {**_SIGLIP_DEFAULTS,
               **(vision if model_type == 'siglip' else hf_config)}
  act = hf_vision['hidden_act']
  if act not in _SIGLIP_ACTIVATIONS:
    raise ValueError(
        f'config.json: {field}hidden_act={act!r} is not supported; the ViT'
        f' runs {sorted(_SIGLIP_ACTIVATIONS)}.')
  return vit.ViTConfig(
      image_size=hf_vision['image_size'], patch_size=hf_vision['patch_size'],
      num_channels=hf_vision['num_channels'],
      hidden_size=hf_vision['hidden_size'],
      intermediate_size=hf_vision['intermediate_size'],
      num_layers=hf_vision['num_hidden_layers'],
      num_heads=hf_vision['num_attention_heads'],
      layer_norm_eps=hf_vision['layer_norm_eps'],
      activation=_SIGLIP_ACTIVATIONS[act])


def _siglip_tensor(path: tuple[str | int, ...]) -> tuple[str, Callable]:
  """(SigLIP tensor name without the prefix, numpy transform to the ViT's
  layout) of a ViT param path."""
  if path == ('patch_embedding', 'kernel'):
    # Conv2d (D, C, p, p) -> Linear over (row, column, channel) patches.
    return ('embeddings.patch_embedding.weight',
            lambda w: w.transpose(2, 3, 1, 0).reshape(-1, w.shape[0]))
  if path == ('patch_embedding', 'bias'):
    return 'embeddings.patch_embedding.bias', lambda w: w
  if path == ('position_embedding',):
    return 'embeddings.position_embedding.weight', lambda w: w
  leaf = {'kernel': 'weight', 'scale': 'weight', 'bias': 'bias'}[path[-1]]
  module = '.'.join(map(str, path[:-1]))
  if path[0] == 'layers':
    module = f'encoder.{module}'
  if path[-1] == 'kernel':  # nn.Linear (out, in) -> (in, out)
    return f'{module}.{leaf}', lambda w: w.T
  return f'{module}.{leaf}', lambda w: w


def load_siglip(path: str | os.PathLike, *, dtype: Any = jnp.bfloat16,
                param_dtype: Any = jnp.float32,
                activation_group_size: int | None = None) -> vit.ViT:
  """A `vit.ViT` with the weights of a SigLIP vision tower.

  Reads a transformers `SiglipVisionModel` checkpoint (config.json
  model_type 'siglip_vision_model') or a full `SiglipModel` one
  ('siglip': its vision_config and `vision_model.*` tensors); the pooling
  head (`vision_use_head`) and the text tower are not read. Its
  `last_hidden_state` is the ViT's output.

  Args:
    path: directory with config.json and model.safetensors (or sharded
      files with model.safetensors.index.json).
    dtype: activation dtype (float32 for exact comparisons).
    param_dtype: parameter dtype.
    activation_group_size: see `vit.ViT`.

  Returns:
    The ViT, params on the default device.

  Raises:
    FileNotFoundError: no config.json or safetensors.
    ValueError: not a SigLIP checkpoint, a missing tensor, or a tensor whose
      shape config.json does not imply.
  """
  path = os.fspath(path)
  hf_config = read_hf_config(path)
  config = config_from_siglip(hf_config)

  def make():
    with nnx.use_eager_sharding(False):
      return vit.ViT(config, dtype=dtype, param_dtype=param_dtype,
                 activation_group_size=activation_group_size,
                 rngs=nnx.Rngs(0))

  graphdef, abstract, rest = nnx.split(nnx.eval_shape(make), nnx.Param, ...)
  with _Tensors(path) as tensors:
    prefix = _tensor_prefix(tensors, hf_config['model_type'], path)

    def read(key_path, leaf):
      p = tuple(k.key for k in key_path)
      name, transform = _siglip_tensor(p)
      name = prefix + name
      shape = tensors.shape(name)
      w = transform(tensors.read(name, tuple(slice(None) for _ in shape)))
      if w.shape != leaf.shape:
        raise ValueError(
            f'{path}: tensor {name!r} has shape {shape}; config.json implies'
            f' the ViT param {"/".join(map(str, p))} {leaf.shape}.')
      return jnp.asarray(np.asarray(w, np.float32), leaf.dtype)

    params = jax.tree_util.tree_map_with_path(read,
                                              nnx.to_pure_dict(abstract))
  nnx.replace_by_pure_dict(abstract, params)
  return nnx.merge(graphdef, abstract, rest)


def _tensor_prefix(tensors: '_Tensors', model_type: str,
                   path: str) -> str:
  """The prefix of the vision tower's tensor names in this checkpoint."""
  for prefix in _PREFIXES[model_type]:
    try:
      tensors.shape(prefix + _PROBE)
    except ValueError:
      continue
    return prefix
  raise ValueError(
      f'{path}: no SigLIP vision tower: none of'
      f' {[p + _PROBE for p in _PREFIXES[model_type]]} is in the'
      ' checkpoint.')
