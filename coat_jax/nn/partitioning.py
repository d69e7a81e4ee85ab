"""Parameters annotated with logical axis names for sharding.

Every parameter carries `out_sharding` metadata naming its logical axes
('embed', 'mlp', 'heads', 'kv_heads', 'vocab', 'norm'). A training script
maps them onto a (data, fsdp, tensor) mesh with `LOGICAL_AXIS_RULES` (or its
own rules) through `nnx.logical_axis_rules` and `nnx.get_partition_spec`.
"""

from typing import Any

from flax import nnx
import jax

# Logical axis -> mesh axis, for a ('data', 'fsdp', 'tensor') mesh.
LOGICAL_AXIS_RULES = (
    ('batch', ('data', 'fsdp')),
    ('embed', 'fsdp'),
    ('mlp', 'tensor'),
    ('heads', 'tensor'),
    ('kv_heads', 'tensor'),
    ('vocab', 'tensor'),
    ('norm', None),
)


def _mesh_active() -> bool:
  return not jax.sharding.get_abstract_mesh().empty


def make_param(
    init: Any, key: jax.Array, shape: tuple[int, ...], dtype: Any,
    axes: tuple[str | None, ...] | None,
) -> nnx.Param:
  """Creates an `nnx.Param` with logical axis names as `out_sharding`.

  Under a mesh (`jax.set_mesh`) with logical axis rules the value is sharded
  eagerly; without one the names are only recorded, so models can be built
  on a single device with no mesh at all.

  Args:
    init: initializer `init(key, shape, dtype)`.
    key: PRNG key.
    shape: parameter shape.
    dtype: parameter dtype (float32 for master weights).
    axes: one logical name (or None) per dimension, or None for no metadata.
  """
  value = init(key, shape, dtype)
  if axes is None:
    return nnx.Param(value)
  if len(axes) != len(shape):
    raise ValueError(f'axes={axes} must name each of the {len(shape)} axes'
                     f' of shape {shape}.')
  eager = nnx.using_eager_sharding() and _mesh_active()
  return nnx.Param(value, out_sharding=axes, eager_sharding=eager)
