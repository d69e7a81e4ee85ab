"""FSDP placement hints: batch-sharded activations, FP8 weight all-gathers,
the embedding lookup, row-wise kernels per device.

All act only under a mesh (`jax.set_mesh`) with the ('data', 'fsdp',
'tensor') Auto axes of `coat_jax.training.sharding`; elsewhere (one device,
no mesh, other axis names, Explicit axes) they leave the program as it was
(the hints return their input, `embed_lookup` None, `row_wise` the plain
kernel call).

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

`embed_lookup` looks each device's tokens up in the table's H slices of its
FSDP group and moves the rows with one all-to-all, where the partitioner
gathered the whole batch's rows on a data x FSDP mesh.

`row_wise` runs a row-by-row Pallas kernel (RMSNorm, SwiGLU, the per-tensor
quantizers) on each device's rows of batch-sharded activations inside
`jax.shard_map`, where a bare pallas_call would be replicated: on several
GPUs the FP8 layers then run the kernels that they run on one.
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from coat_jax.nn import partitioning
from pallas_kernels import _common

BATCH_AXES = ('data', 'fsdp')
TENSOR_AXIS = 'tensor'

# How `row_wise` places each input and output of a kernel on the devices.
ROWS = 'rows'  # the leading axis split over BATCH_AXES
COLS = 'cols'  # the last axis split over BATCH_AXES (a transpose's codes)
WHOLE = 'whole'  # the same whole array on every device (a gain, a scale)
MAX = 'max'  # each device's value reduced with max (an amax)
SUM = 'sum'  # each device's value summed (a column sum: dscale)


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


def embed_lookup(table: jax.Array, tokens: jax.Array,
                 dtype: jnp.dtype) -> jax.Array | None:
  """table[tokens] in dtype, (B, S, H) and batch-sharded, for a (V, H)
  table sharded over 'fsdp' on H; None where that does not apply (no FSDP
  mesh or 'fsdp' 1, 'tensor' > 1, B not a multiple of the batch shards or H
  of 'fsdp'): then a plain take.

  Inside `jax.shard_map`, each device looks its FSDP group's tokens up in
  its H slice of the table and an all-to-all hands each row its whole H:
  one device's rows move each way. Left to the partitioner, a data x FSDP
  mesh all-gathered the whole batch's (B, S, H) float32 rows and their
  gradient on every device ("involuntary full rematerialization").
  Backward scatter-adds into each table slice and sums over 'data'.
  """
  mesh = _mesh()
  if mesh is None or mesh.shape.get(TENSOR_AXIS, 1) > 1:
    return None
  fsdp = mesh.shape['fsdp']
  if (fsdp == 1 or tokens.shape[0] % _batch_shards(mesh)
      or table.shape[1] % fsdp):
    return None

  def body(table, tokens):
    group = jax.lax.all_gather(tokens, 'fsdp', axis=0, tiled=True)
    # (B / data, S, H / fsdp)
    rows = jnp.take(table, group, axis=0).astype(dtype)
    return jax.lax.all_to_all(rows, 'fsdp', 0, rows.ndim - 1, tiled=True)

  return jax.shard_map(
      body, in_specs=(P(None, 'fsdp'), P(BATCH_AXES)), out_specs=P(BATCH_AXES),
      axis_names=set(BATCH_AXES))(table, tokens)


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


def _amax_across(amax: jax.Array, axes) -> jax.Array:
  """The max of each device's amax (>= 0), NaN if one is: a max all-reduce
  drops NaN (XLA:CPU's does), so the few scalars are gathered instead."""
  return _common.tensor_abs_max(jax.lax.all_gather(amax, axes))


def batch_shards(rows: int) -> int:
  """The devices a (rows, ...) batch-sharded array is split over: the
  ('data', 'fsdp') shards of an FSDP mesh ('tensor' 1) when they divide
  `rows`, else 1 (no mesh, Explicit axes, one shard)."""
  mesh = _mesh()
  if mesh is None or mesh.shape.get(TENSOR_AXIS, 1) > 1:
    return 1
  shards = _batch_shards(mesh)
  return shards if rows % shards == 0 else 1


def grads_summed_across_devices() -> bool:
  """Whether each weight's gradient is summed over several devices here
  (an FSDP mesh whose batch axes hold more than one shard)."""
  mesh = _mesh()
  return mesh is not None and _batch_shards(mesh) > 1


def pallas_on_shards(rows: int) -> bool:
  """Whether `row_wise` runs its kernel on each device's rows here: under
  an FSDP mesh of several batch shards (and 'tensor' 1), on GPUs that run
  the Pallas kernels, with `rows` a multiple of the shards."""
  return batch_shards(rows) > 1 and _common.gpus_run_pallas()


def row_wise(kernel, args, in_kinds, out_kinds):
  """`kernel(*args, implementation=...)` for a kernel that works row by row.

  On one device (or where `pallas_on_shards` says no) this is
  `kernel(*args, implementation=None)`, the fastest implementation there.
  Under an FSDP mesh on several Hopper GPUs it is the Pallas kernel
  (`implementation='pallas'`) on each device's rows inside `jax.shard_map`
  over BATCH_AXES: the outputs are those of one call on the whole arrays,
  the MAX ones reduced across devices (exactly, NaN kept), the SUM ones
  summed (in another order than one device's).

  Args:
    kernel: fn(*arrays, implementation) -> tuple of arrays (None allowed
      where the kind is None).
    args: its arrays, None where the kernel is given None; the first ROWS
      one's leading axis is the rows.
    in_kinds: ROWS or WHOLE for each arg.
    out_kinds: ROWS, COLS, WHOLE, MAX, SUM or None (a None output) for
      each output.
  """
  rows = next(a for a, kind in zip(args, in_kinds, strict=True)
              if kind == ROWS and a is not None).shape[0]
  if not pallas_on_shards(rows):
    return kernel(*args, implementation=None)
  spec = {ROWS: P(BATCH_AXES), COLS: P(None, BATCH_AXES), WHOLE: P(),
          MAX: P(), SUM: P()}
  given = [(a, kind) for a, kind in zip(args, in_kinds) if a is not None]
  kept = [kind for kind in out_kinds if kind is not None]

  def body(*local):
    local = iter(local)
    outs = kernel(*(None if a is None else next(local) for a in args),
                  implementation='pallas')
    reduced = {MAX: _amax_across, SUM: jax.lax.psum}
    return tuple(
        reduced[kind](out, BATCH_AXES) if kind in reduced else out
        for out, kind in zip(outs, out_kinds, strict=True)
        if kind is not None)

  outs = iter(jax.shard_map(
      body, in_specs=tuple(spec[kind] for _, kind in given),
      out_specs=tuple(spec[kind] for kind in kept),
      axis_names=set(BATCH_AXES), check_vma=False)(*(a for a, _ in given)))
  return tuple(None if kind is None else next(outs) for kind in out_kinds)
