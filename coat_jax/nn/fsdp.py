"""FSDP placement hints: batch-sharded activations, FP8 weight all-gathers.

Both act only under a mesh (`jax.set_mesh`) with the ('data', 'fsdp',
'tensor') Auto axes of `coat_jax.training.sharding`; elsewhere (one device,
no mesh, other axis names, Explicit axes) they return their input
unchanged.

Under Explicit mesh axes the shardings are the arrays' types, and
`gather_weight` spells FSDP out: a layer gathers each weight it uses whole
(its 'fsdp' and 'tensor' shards alike), so the activations keep the batch
sharding of the tokens and nothing else; backward reduce-scatters the
gradients to the params' shards.

With weights sharded over 'fsdp' and nothing pinning the activations, XLA's
partitioner may keep the weights in place and shard the activations' feature
axis instead (it did on XLA:CPU: every matmul then moved activations).
`shard_batch` pins the residual stream to the batch sharding, so each layer
all-gathers its weights, as FSDP means.

`gather_fp8_weight` all-gathers FP8 codes: the float32 weight shards are
quantized where they are (the per-tensor amax is a scalar all-reduce) and the
1-byte codes (as uint8) are gathered instead of 4-byte params (what torchao's
FP8 all-gather does).
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from coat_jax.nn import partitioning
from pallas_kernels import _common

BATCH_AXES = ('data', 'fsdp')
TENSOR_AXIS = 'tensor'


def _mesh():
  """The active abstract mesh if it has the FSDP axes, all of type Auto
  (as `coat_jax.training.sharding.make_mesh` makes them), else None."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not set(BATCH_AXES) <= set(mesh.axis_names):
    return None
  if any(t != jax.sharding.AxisType.Auto for t in mesh.axis_types):
    return None  # Explicit axes: shardings are the arrays' types already.
  return mesh


def _batch_shards(mesh) -> int:
  return mesh.shape['data'] * mesh.shape['fsdp']


def shard_batch(x: jax.Array) -> jax.Array:
  """(B, ...) activations constrained to B over ('data', 'fsdp'), the other
  axes replicated; unchanged without an FSDP mesh or when B does not divide.
  """
  mesh = _mesh()
  if mesh is None or _batch_shards(mesh) == 1 or x.shape[0] % _batch_shards(
      mesh):
    return x
  return jax.lax.with_sharding_constraint(
      x, P(BATCH_AXES, *([None] * (x.ndim - 1))))


def gather_weight(w: jax.Array) -> jax.Array:
  """w all-gathered (no sharded axis) if its type is sharded (Explicit mesh
  axes); w itself otherwise, so Auto-mode programs are unchanged."""
  return _common.replicated(w)


def _fsdp_names(rules=partitioning.LOGICAL_AXIS_RULES) -> set[str]:
  """Logical axis names that the rules place on 'fsdp' ('embed')."""
  def axes(a):
    return a if isinstance(a, tuple) else (a,)
  return {name for name, a in rules if 'fsdp' in axes(a)}


def gather_fp8_weight(values: jax.Array,
                      axes: tuple[str | None, ...] | None) -> jax.Array:
  """FP8 codes of an FSDP-sharded weight, all-gathered as FP8.

  Args:
    values: (K, N) float8 codes of a weight (quantized elementwise with one
      scale, so any shard can be quantized where it is).
    axes: the weight's logical axis names, e.g. ('embed', 'mlp'); the
      'embed' axis is the one `LOGICAL_AXIS_RULES` shards over 'fsdp'.

  Returns:
    `values`, pinned first to the weight's FSDP sharding (the cast runs on
    the local shards) and then replicated (so the all-gather moves 1 byte
    per element). Unchanged without an FSDP mesh, with 'tensor' > 1 (the
    partitioner keeps tensor-parallel weights sharded), without axes, or
    when no FSDP axis divides.
  """
  mesh = _mesh()
  if (mesh is None or axes is None or mesh.shape['fsdp'] == 1
      or mesh.shape.get(TENSOR_AXIS, 1) > 1):
    return values
  if len(axes) != values.ndim:
    raise ValueError(f'axes={axes} must name each of the {values.ndim} axes'
                     f' of the weight codes {values.shape}.')
  n, names = mesh.shape['fsdp'], _fsdp_names()
  local = ['fsdp' if name in names and size % n == 0 else None
           for name, size in zip(axes, values.shape)]
  if 'fsdp' not in local:
    return values
  # Without the first constraint the partitioner may move the replicated
  # placement back through the cast and gather float32 after all. The codes
  # travel as uint8: backends without FP8 collectives (XLA:CPU) would
  # widen FP8 to 16 bits.
  codes = jax.lax.bitcast_convert_type(values, jnp.uint8)
  codes = jax.lax.with_sharding_constraint(codes, P(*local))
  codes = jax.lax.with_sharding_constraint(codes, P())
  return jax.lax.bitcast_convert_type(codes, values.dtype)
