"""`convert`: COAT's FP8 layers in an existing Flax NNX model, in place.

  model = MyTransformer(config, rngs=nnx.Rngs(0))
  print(coat_jax.convert(model))  # what was converted, what was skipped
  optimizer = nnx.Optimizer(model, coat_jax.coat_adamw(3e-4), wrt=nnx.Param)

Every `nnx.Linear` becomes a `CoatLinear`, every `nnx.RMSNorm` a
`CoatRMSNorm` and every `nnx.LayerNorm` a `CoatLayerNorm`, wherever it sits
(attributes, `nnx.List`, `nnx.Dict`, lists and dicts, nested modules; a
layer held in several places is replaced in each, or, where one is a tuple,
in none). A new layer holds the old layer's `nnx.Param` objects
themselves: values, dtypes and sharding metadata stay as they were, nothing
is copied, and the state keeps its paths (`nnx.state(model)` before and
after have the same tree), so an optimizer state or a checkpoint made
before still lines up.
Activations in a model's own `__call__` are the model's code: switch them
to `coat_jax.nn.swiglu` / `geglu` / `silu` / `gelu` by hand.

A layer the FP8 path cannot take stays as it is, with the reason in the
report: a feature size that is not a multiple of 16 (`Recipe.check_size`);
a dtype other than bfloat16 or float32 (the compute dtype, else the
params'); on an nnx.Linear a custom `dot_general`, `promote_dtype`,
`precision` or `preferred_element_type`; on a norm statistics over other
axes than the last, an `axis_name`, a custom `promote_dtype`, or an
RMSNorm without a scale; a subclass of one of the three (its own code would
be lost); a recipe without the FP8 part the layer would use (FP8 matmuls
for the linear layers, FP8 activations for the norms: the layer would run
as before); the model itself (it has no parent to be replaced in); a layer
held in a tuple. Layers that are COAT layers already (converted before, or
built so) are left as they are, whatever `recipe` says: the project's
models hold their recipe in their blocks too (fused QKV, a BF16 final
norm), which a recipe rewritten layer by layer would contradict. So
converting twice is a no-op, and a converted model's recipe is changed by
converting the unconverted model again.
"""

from collections.abc import Callable
import dataclasses
import inspect
from typing import Any
from typing import NamedTuple

from flax import nnx
import jax.numpy as jnp
import numpy as np

from coat_jax import recipes
from coat_jax.nn.layer_norm import CoatLayerNorm
from coat_jax.nn.linear import CoatLinear
from coat_jax.nn.norm import CoatRMSNorm

Path = tuple[str | int, ...]
Filter = Callable[[Path, nnx.Module], bool]

_COAT_LAYERS = (CoatLinear, CoatRMSNorm, CoatLayerNorm)
_FP8_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
# Shown in the report's table; the full lists are in its fields.
_MAX_ROWS = 20


class Converted(NamedTuple):
  """A layer `convert` replaced: its path, its old and its new type."""
  path: Path
  from_type: type
  to_type: type


class Skipped(NamedTuple):
  """A layer `convert` left as it is, and why."""
  path: Path
  type: type
  reason: str


def _path_str(path: Path) -> str:
  return '.'.join(map(str, path)) or '(the model)'


@dataclasses.dataclass(frozen=True)
class ConversionReport:
  """What `convert` did to a model.

  Attributes:
    recipe: the recipe of the converted layers.
    converted: the replaced layers, in the model's order.
    skipped: the layers of the three types (and their subclasses and COAT
      layers) left as they are, each with its reason.
  """

  recipe: recipes.Recipe
  converted: tuple[Converted, ...]
  skipped: tuple[Skipped, ...]

  def __str__(self) -> str:
    """A short table: the conversions counted by type, each skip with its
    path and reason (the first 20)."""
    name = recipes.name_of(self.recipe) or str(self.recipe)
    lines = [f'coat_jax.convert (recipe {name}):'
             f' {len(self.converted)} converted,'
             f' {len(self.skipped)} skipped']
    counts: dict[str, int] = {}
    for row in self.converted:
      key = f'{row.from_type.__name__} -> {row.to_type.__name__}'
      counts[key] = counts.get(key, 0) + 1
    width = len(str(max(counts.values(), default=0)))
    lines += [f'  {"converted" if i == 0 else "":9}  {n:>{width}} {key}'
              for i, (key, n) in enumerate(counts.items())]
    rows = [(_path_str(s.path), s.type.__name__, s.reason)
            for s in self.skipped[:_MAX_ROWS]]
    if rows:
      path_w, type_w = (max(len(r[i]) for r in rows) for i in (0, 1))
      lines += [f'  {"skipped" if i == 0 else "":9}  {p:<{path_w}}'
                f'  {t:<{type_w}}  {reason}'
                for i, (p, t, reason) in enumerate(rows)]
    if len(self.skipped) > _MAX_ROWS:
      lines.append(f'  {"":9}  ... {len(self.skipped) - _MAX_ROWS} more'
                   ' (report.skipped lists all)')
    return '\n'.join(lines)


def convert(
    model: nnx.Module, recipe: recipes.Recipe | str = recipes.COAT, *,
    filter: Filter | None = None,
) -> ConversionReport:
  """Replaces a model's linear and norm layers by COAT's, in place.

  Args:
    model: any `nnx.Module` (concrete, or abstract from `nnx.eval_shape`).
    recipe: the `coat_jax.Recipe` (or preset name) the new layers run.
    filter: None (every layer), or `filter(path, module) -> bool` called
      with each nnx.Linear / RMSNorm / LayerNorm's path in the model (as
      `nnx.iter_modules` gives it, e.g. ('layers', 0, 'mlp', 'up_proj')) and
      the module: False leaves the layer as it is.

  Returns:
    A `ConversionReport` (print it for a table).

  Raises:
    TypeError: model is not an nnx.Module, or filter is not callable.
    ValueError: recipe is neither a Recipe nor a preset name.
  """
  if not isinstance(model, nnx.Module):
    raise TypeError(f'model must be an nnx.Module; got'
                    f' {type(model).__name__}.')
  recipe = recipes.get(recipe)
  if filter is not None and not callable(filter):
    raise TypeError(f'filter must be None or a callable filter(path, module)'
                    f' -> bool; got {type(filter).__name__}.')
  places = _places(model)
  converted, skipped = [], []
  for path, module in list(nnx.iter_modules(model)):
    if not isinstance(module, tuple(_BUILDERS) + _COAT_LAYERS):
      continue
    if isinstance(module, _COAT_LAYERS):
      reason = ('already a COAT layer (recipe'
                f' {recipes.name_of(module.recipe) or module.recipe})')
    elif filter is not None and not filter(path, module):
      reason = 'left out by the filter'
    else:
      reason = (_problem(module, recipe)
                or _place_problem(path, places.get(id(module), [])))
    if reason:
      skipped.append(Skipped(path, type(module), reason))
      continue
    new = _BUILDERS[type(module)](module, recipe)
    for _, parent, key in places[id(module)]:
      if isinstance(parent, (list, dict, nnx.List, nnx.Dict)):
        parent[key] = new
      else:
        setattr(parent, key, new)
    converted.append(Converted(path, type(module), type(new)))
  return ConversionReport(recipe, tuple(converted), tuple(skipped))


def _places(model: nnx.Module) -> dict[int, list[tuple[Path, Any, Any]]]:
  """id(module) -> (path, parent, key) of every place in the model that
  holds it: a module held twice (a shared layer) has two, where
  `nnx.iter_modules` lists it once. Parents: modules (attributes, nnx.List,
  nnx.Dict), lists, dicts and tuples."""
  places = {}
  for path, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Module):
      children = nnx.iter_children(node)
    elif isinstance(node, (list, tuple)):
      children = enumerate(node)
    elif isinstance(node, dict):
      children = node.items()
    else:
      continue
    for key, child in children:
      if isinstance(child, nnx.Module):
        places.setdefault(id(child), []).append((path + (key,), node, key))
  return places


def _place_problem(path: Path,
                   places: list[tuple[Path, Any, Any]]) -> str | None:
  """Why the module first found at `path` and held at `places` cannot be
  replaced at each of them, or None: a layer is replaced everywhere it is
  held, or nowhere."""
  if not path:
    return 'the model itself: convert a module that holds it'
  if path not in [p for p, _, _ in places]:
    return 'held in a container convert cannot change in place'
  for where, parent, _ in places:
    if not isinstance(parent, (nnx.Module, list, dict)):
      held = ('held in a' if where == path
              else f'also at {_path_str(where)}, in a')
      return (f'{held} {type(parent).__name__}, which cannot be changed in'
              ' place (an nnx.List can)')
  return None


def _adopt(build: Callable[[], nnx.Module],
           params: dict[str, nnx.Variable | None]) -> nnx.Module:
  """`build()` traced abstractly (`nnx.eval_shape`: no param allocated),
  then given `params`, the old layer's Variables themselves."""
  new = nnx.eval_shape(build)
  for name, param in params.items():
    if param is not None:
      setattr(new, name, param)
  return new


def _axes(kernel: nnx.Variable) -> tuple[Any, ...] | None:
  """A kernel's axis names (its `out_sharding` metadata), or None."""
  axes = kernel.get_metadata().get('out_sharding')
  return tuple(axes) if axes is not None and len(axes) == 2 else None


def _dtype_problem(dtype: Any, param_dtype: Any) -> str | None:
  """Why FP8 layers cannot compute in `dtype` (the layer's; None: promoted
  from the input and params of `param_dtype`), or None."""
  for name, d in (('dtype', dtype), ('param dtype', param_dtype)):
    if d is not None and not jnp.issubdtype(d, jnp.floating):
      return f'{name} {jnp.dtype(d).name} is not floating'
  compute = param_dtype if dtype is None else dtype
  if jnp.dtype(compute) not in _FP8_DTYPES:
    return (f'computes in {jnp.dtype(compute).name}; FP8 layers compute in'
            ' bfloat16 or float32')
  return None


def _size_problem(recipe: recipes.Recipe, part: str,
                  sizes: dict[str, int]) -> str | None:
  for name, size in sizes.items():
    try:
      recipe.check_size(name, size, part=part)
    except ValueError:
      return f'{name}={size} is not a multiple of {recipes.FP8_MULTIPLE}'
  return None


def _custom_problem(module: nnx.Module, names: tuple[str, ...]
                    ) -> str | None:
  """A setting among `names` that is not its constructor's default."""
  for name in names:
    value = getattr(module, name)
    default = inspect.signature(type(module).__init__).parameters[
        name].default
    if value is default or value == default:
      continue
    if callable(value) and not isinstance(value, type):
      return f'a custom {name} ({getattr(value, "__name__", value)!s})'
    return f'{name}={getattr(value, "__name__", value)!s}'
  return None


def _problem(m: nnx.Module, recipe: recipes.Recipe) -> str | None:
  """Why the FP8 path cannot take nnx layer m, or None."""
  if type(m) not in _BUILDERS:
    base = next(base for base in _BUILDERS if isinstance(m, base))
    return (f'a subclass of nnx.{base.__name__}: its own code would be'
            ' lost')
  if isinstance(m, nnx.Linear):
    if not recipe.fp8_matmuls:
      return 'the recipe has no FP8 matmuls'
    in_features, out_features = m.kernel.shape
    return (_custom_problem(m, ('dot_general', 'promote_dtype', 'precision',
                                'preferred_element_type'))
            or _dtype_problem(m.dtype, m.kernel.dtype)
            or _size_problem(recipe, 'matmul',
                             {'in_features': in_features,
                              'out_features': out_features}))
  if not recipe.fp8_activations:
    return 'the recipe has no FP8 activations'
  if m.axis_name is not None:
    return f'axis_name={m.axis_name!r} (statistics across devices)'
  for name in ('reduction_axes', 'feature_axes'):
    axes = getattr(m, name)
    if tuple(np.atleast_1d(axes).tolist()) != (-1,):
      return f'{name}={axes!r}: only the last axis'
  if isinstance(m, nnx.RMSNorm) and m.scale is None:
    return 'use_scale=False (CoatRMSNorm has a scale)'
  return (_custom_problem(m, ('promote_dtype',))
          or _dtype_problem(m.dtype, _norm_param_dtype(m))
          or _size_problem(recipe, 'activation',
                           {'num_features': m.num_features}))


def _norm_param_dtype(m: nnx.RMSNorm | nnx.LayerNorm) -> Any:
  """The dtype of a norm's params as they are (param_dtype if none)."""
  for param in (m.scale, getattr(m, 'bias', None)):
    if param is not None:
      return param.dtype
  return m.param_dtype


# The builders make the new layer without params or their metadata (the
# old layer's Params come with theirs), so no sharding is applied there.


def _coat_linear(m: nnx.Linear, recipe: recipes.Recipe) -> CoatLinear:
  in_features, out_features = m.kernel.shape
  new = _adopt(
      lambda: CoatLinear(
          in_features, out_features, use_bias=m.bias is not None,
          dtype=m.dtype, param_dtype=m.kernel.dtype, recipe=recipe,
          rngs=nnx.Rngs(0)),
      {'kernel': m.kernel, 'bias': m.bias})
  # Its FP8 weight gather (the recipe's fp8_weight_gather) reads them.
  new.kernel_axes = _axes(m.kernel)
  return new


def _coat_rms_norm(m: nnx.RMSNorm, recipe: recipes.Recipe) -> CoatRMSNorm:
  return _adopt(
      lambda: CoatRMSNorm(
          m.num_features, epsilon=m.epsilon, dtype=m.dtype,
          param_dtype=_norm_param_dtype(m), recipe=recipe,
          rngs=nnx.Rngs(0)),
      {'scale': m.scale})


def _coat_layer_norm(m: nnx.LayerNorm,
                     recipe: recipes.Recipe) -> CoatLayerNorm:
  return _adopt(
      lambda: CoatLayerNorm(
          m.num_features, epsilon=m.epsilon, dtype=m.dtype,
          param_dtype=_norm_param_dtype(m), use_bias=m.bias is not None,
          use_scale=m.scale is not None,
          use_fast_variance=m.use_fast_variance, recipe=recipe,
          rngs=nnx.Rngs(0)),
      {'scale': m.scale, 'bias': m.bias})


# The layers convert replaces, with their builders.
_BUILDERS = {nnx.Linear: _coat_linear, nnx.RMSNorm: _coat_rms_norm,
             nnx.LayerNorm: _coat_layer_norm}
