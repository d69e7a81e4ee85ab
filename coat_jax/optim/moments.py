"""FP8 moments in whatever container a framework hands them back in.

A moment leaf of an optimizer state is a `quant.QuantizedArray`, but it does
not always come back as one: `nnx.Optimizer.update` stores the new state with
`nnx.update(opt_state, nnx.state(new_state))`, and `nnx.state` turns every
pytree node it meets, the `QuantizedArray` dataclass included, into an nnx
`State` mapping {'exponent', 'scale', 'values'}. The next update then gets
those mappings. So the optimizers pair params with moments by flattening the
state *up to the params' tree*, read each moment by its field names from
whatever holds it, and return the new moment in that same container (optax's
`MultiSteps`, `apply_if_finite` and `lax.cond` need the state's structure to
stay the same from step to step).

`nnx_layout` has init build a moment of a param held in an nnx Variable in
that State mapping from the start, so that nnx.Optimizer's state keeps one
structure and a jitted step compiles once.
"""

import math
import sys
from typing import Any

import jax

from coat_jax import quant

_FIELDS = ('values', 'scale', 'exponent')


def _name(key: Any) -> str:
  for attr in ('name', 'key', 'idx'):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def is_moment(x: Any) -> bool:
  return isinstance(x, quant.QuantizedArray)


def nnx_layout(tree: Any) -> Any:
  """`tree` (a new optimizer state) with each QuantizedArray held in an nnx
  Variable replaced by its nnx State mapping, `nnx.state(q)`.

  The Variables come from params given as nnx Variables (`nnx.Optimizer`
  inits with `nnx.state(model, wrt)`). `nnx.Optimizer.update` stores every
  new moment as `nnx.state(moment)` in its Variable: a QuantizedArray there
  would become that mapping at the first update, changing the state's tree
  structure, and a jitted step would compile twice. The mapping has the
  moment's leaves under the same names, so checkpoints are those of the
  state after an update. Without nnx Variables (plain optax) `tree` is
  returned unchanged, QuantizedArrays and all.

  Sharding: a param sharded at creation (eager sharding) has a Variable
  that `nnx.Optimizer` would shard again by its one annotation, values and
  scales alike, but the scales' last axis (the groups) may not split as the
  param's does. So the fields are placed here, each by a spec that fits it
  (`_scale_sharding`), and the moment's Variable is not sharded again.
  """
  # The one flax-aware step. Only nnx makes Variables: if flax.nnx was never
  # imported, there are none (and this module does not import flax).
  nnx = sys.modules.get('flax.nnx')
  if nnx is None:
    return tree

  to_state = lambda m: nnx.state(m) if is_moment(m) else m  # not float32 ones

  def in_variable(v):
    q = v.get_value()
    if not is_moment(q):  # a float32 moment, or moments deeper inside
      return jax.tree.map(to_state, v, is_leaf=is_moment)
    meta = v.get_metadata()
    sharding = meta.get('optimizer_sharding') or meta.get('out_sharding')
    if meta.get('eager_sharding') and sharding:
      from flax.core import spmd  # pylint: disable=g-import-not-at-top
      place = lambda x, s: spmd.shard_value(
          x, s, meta.get('sharding_rules'), meta.get('mesh'))
      q = quant.QuantizedArray(
          place(q.values, sharding),
          place(q.scale, _scale_sharding(sharding, q.scale.shape, meta)),
          None if q.exponent is None else place(
              q.exponent, _scale_sharding(sharding, q.scale.shape, meta)),
          q.group_size)
      meta = {**meta, 'eager_sharding': False}
    return type(v)(nnx.state(q), **meta)

  is_variable = lambda x: isinstance(x, nnx.Variable)
  return jax.tree.map(lambda x: in_variable(x) if is_variable(x) else x,
                      tree, is_leaf=is_variable)


def _scale_sharding(sharding: Any, shape: tuple[int, ...], meta: dict) -> Any:
  """A param's sharding annotation (logical or mesh axis names, a
  PartitionSpec or a NamedSharding) fitted to its moment's scale of
  `shape` (`param.shape[:-1] + (groups,)`): the last axis keeps its entry
  only where the mesh size of that entry divides the number of groups;
  else it is replicated. An entry whose mesh size is unknown (no mesh) is
  kept."""
  from flax.core import spmd  # pylint: disable=g-import-not-at-top
  P = jax.sharding.PartitionSpec
  if isinstance(sharding, jax.sharding.NamedSharding):
    return jax.sharding.NamedSharding(sharding.mesh, _scale_sharding(
        sharding.spec, shape, {**meta, 'mesh': sharding.mesh}))
  if not isinstance(sharding, tuple | P) or len(sharding) != len(shape):
    return sharding  # a Format, or no entry for the last axis
  mesh = meta.get('mesh') or jax.sharding.get_abstract_mesh()
  entry = tuple(spmd.apply_rules(sharding, meta.get('sharding_rules')))[-1]
  names = entry if isinstance(entry, tuple) else (entry,)
  if any(n is not None and n not in mesh.shape for n in names):
    return sharding
  if shape[-1] % math.prod(mesh.shape[n] for n in names if n is not None):
    fitted = (*sharding[:-1], None)
    return P(*fitted) if isinstance(sharding, P) else fitted
  return sharding


def _is_array_leaf(x: Any) -> bool:
  return jax.tree_util.all_leaves([x])


def mismatch_error(updates: Any, state_tree: Any, what: str) -> ValueError:
  return ValueError(
      f'The updates (gradients) do not have the tree structure of the params'
      f' this optimizer state was initialized with.\n  {what}:'
      f' {jax.tree.structure(state_tree, is_leaf=is_moment)}\n  updates:'
      f' {jax.tree.structure(updates)}\nPass gradients of the same params to'
      ' update, or re-run tx.init on the new params.')


def per_param(updates: Any, state_tree: Any, what: str = 'params') -> list:
  """The subtrees of `state_tree` (a tree mirroring the params) that belong to
  each leaf of `updates`, in `jax.tree.leaves(updates)` order.

  Raises:
    ValueError: the trees do not match (naming both structures).
  """
  try:
    return jax.tree.structure(updates).flatten_up_to(state_tree)
  except (ValueError, TypeError):
    raise mismatch_error(updates, state_tree, what) from None


def as_quantized(x: Any, group_size: int | None) -> Any:
  """`x` as a `QuantizedArray` if it is an FP8 moment in any container
  (a QuantizedArray, an nnx State or a dict of values/scale[/exponent]);
  anything else (a float32 moment) is returned as is."""
  if is_moment(x) or _is_array_leaf(x):
    return x
  leaves = jax.tree_util.tree_leaves_with_path(x)
  fields = {_name(path[-1]): leaf for path, leaf in leaves if path}
  if (len(fields) != len(leaves) or not set(fields) <= set(_FIELDS)
      or not {'values', 'scale'} <= set(fields)):
    raise ValueError(
        f'A moment of the optimizer state is a {type(x).__name__} with'
        f' fields {sorted(fields)}; expected a QuantizedArray (or a mapping of'
        f' its fields {_FIELDS}). Was the state built by this optimizer?')
  return quant.QuantizedArray(fields['values'], fields['scale'],
                              fields.get('exponent'), group_size)


def like(new: Any, old: Any) -> Any:
  """The new moment `new` (a QuantizedArray or an array) in `old`'s
  container: unchanged when `old` is a QuantizedArray or an array."""
  if is_moment(old) or _is_array_leaf(old):
    return new
  leaves, treedef = jax.tree_util.tree_flatten_with_path(old)
  return treedef.unflatten([getattr(new, _name(path[-1]))
                            for path, _ in leaves])
