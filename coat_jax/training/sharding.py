"""Mesh, and the rules that shard params and their optimizer states alike.

Params carry logical axis names (`coat_jax.nn.partitioning`). A rule maps
each name to mesh axes; a mesh axis is dropped from a dimension it does not
divide, and from a parameter's last axis unless every shard then holds whole
quantization groups, and then goes to the largest other named dimension
that takes it (not a stack's unnamed layer axis). The optimizer state of a
parameter (FP8 values, scales, exponents, or float32 moments) gets that
parameter's spec, so a shard of a moment always sits with the shard of its
parameter.
"""

from collections.abc import Sequence
import logging
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from coat_jax.nn.partitioning import LOGICAL_AXIS_RULES

AXES = ('data', 'fsdp', 'tensor')
BATCH_AXES = ('data', 'fsdp')


def make_mesh(shape: tuple[int, int, int], devices=None) -> Mesh:
  """A (data, fsdp, tensor) mesh over `devices` (default: all)."""
  devices = jax.devices() if devices is None else devices
  return Mesh(np.asarray(devices).reshape(shape), AXES)


def _axis_size(mesh: Mesh, axes: Any) -> int:
  axes = axes if isinstance(axes, tuple) else (axes,)
  return int(np.prod([mesh.shape[a] for a in axes]))


def logical_to_spec(
    names: Sequence[str | None], shape: tuple[int, ...], mesh: Mesh, *,
    group_size: int | None, rules=LOGICAL_AXIS_RULES, what: str = '',
) -> P:
  """The PartitionSpec of one array, fitted to its shape.

  Args:
    names: a logical axis name (or None) per dimension.
    shape: the array's shape.
    mesh: the mesh.
    group_size: quantization group size along the last axis, or None.
    rules: (logical name, mesh axes) pairs.
    what: the param's name, for the log line when an axis is dropped.
  """
  table = dict(rules)
  spec = []
  used = set()
  dropped = []  # mesh axes a dimension could not take

  def why_not(dim, size, shards):
    if size % shards:
      return f'{size} is not divisible by {shards}'
    if (group_size and dim == len(shape) - 1
        and (size // shards) % group_size):
      return (f'a shard of {size // shards} would split the quantization'
              f' groups of {group_size}')
    return None

  for dim, (name, size) in enumerate(zip(names, shape)):
    axes = table.get(name)
    if axes is None:
      spec.append(None)
      continue
    axes = tuple(a for a in (axes if isinstance(axes, tuple) else (axes,))
                 if mesh.shape[a] > 1 and a not in used)
    why = why_not(dim, size, _axis_size(mesh, axes)) if axes else None
    if why or not axes:
      if why:
        logging.info('not sharding %s axis %d over %s: %s', what, dim, axes,
                     why)
        dropped.append(axes)
      spec.append(None)
      continue
    used.update(axes)
    spec.append(axes[0] if len(axes) == 1 else axes)
  # A mesh axis a dimension could not take goes to the largest other
  # unsharded named dimension that takes it (never a stack's layer axis,
  # which the layer scan and the per-layer optimizer steps slice): a hidden
  # size whose shards would split the groups (6656 over 8: 6.5 groups of
  # 128) still shards its (heads, embed) and (mlp, embed) weights.
  for axes in dropped:
    axes = tuple(a for a in axes if a not in used)
    if not axes:
      continue
    shards = _axis_size(mesh, axes)
    free = [d for d in range(len(shape)) if spec[d] is None
            and names[d] not in _UNSHARDABLE
            and why_not(d, shape[d], shards) is None]
    if free:
      dim = max(free, key=lambda d: shape[d])
      logging.info('sharding %s axis %d over %s instead', what, dim, axes)
      used.update(axes)
      spec[dim] = axes[0] if len(axes) == 1 else axes
  return P(*spec)


# Logical axes that never take a mesh axis given up by another dimension:
# a stack's layer axis (unnamed) and the norms' features (kept whole).
_UNSHARDABLE = (None, 'norm')


def param_specs(abstract_params: Any, names: Any, mesh: Mesh,
                group_size: int | None) -> Any:
  """Specs for a tree of params, from a same-structured tree of axis names."""
  def one(path, x, axes):
    return logical_to_spec(axes, x.shape, mesh, group_size=group_size,
                           what=jax.tree_util.keystr(path))
  return jax.tree_util.tree_map_with_path(
      one, abstract_params, names,
      is_leaf=lambda x: hasattr(x, 'shape'))


def _fit(spec: P, shape: tuple[int, ...], mesh: Mesh) -> P:
  """`spec` restricted to dims it divides (and to `shape`'s rank)."""
  entries = list(spec) + [None] * (len(shape) - len(spec))
  out = []
  for axes, size in zip(entries[:len(shape)], shape):
    out.append(axes if axes is None or size % _axis_size(mesh, axes) == 0
               else None)
  return P(*out)


def state_specs(abstract_state: Any, params_specs: Any) -> Any:
  """Specs for an optimizer state: each leaf takes its param's spec.

  A state leaf belongs to the param whose key path it ends with (float32
  moments) or ends with plus one field name (QuantizedArray values, scale,
  exponent). Other leaves (step counts) are replicated.
  """
  by_path = {tuple(path): spec for path, spec in
             jax.tree_util.tree_leaves_with_path(
                 params_specs, is_leaf=lambda x: isinstance(x, P))}

  def one(path, leaf):
    path = tuple(path)
    for start in range(len(path)):
      for end in (len(path), len(path) - 1):
        spec = by_path.get(path[start:end])
        if spec is not None:
          return spec
    del leaf
    return P()

  return jax.tree_util.tree_map_with_path(one, abstract_state)


def named(mesh: Mesh, specs: Any, abstract: Any) -> Any:
  """NamedShardings for a tree, each spec fitted to its leaf's shape."""
  return jax.tree.map(
      lambda spec, x: NamedSharding(mesh, _fit(spec, x.shape, mesh)),
      specs, abstract, is_leaf=lambda x: isinstance(x, P))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """(batch, seq) arrays: batch over data x fsdp."""
  return NamedSharding(mesh, P(BATCH_AXES, None))
