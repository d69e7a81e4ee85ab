"""Shared pieces of the kernels: FP8 formats, exact float ops, tiling.

Pure jnp where possible. The `Ops` bundle holds the operations whose
lowering may differ between XLA and Pallas-Triton (division, square root):
the references use `XLA_OPS`, the GPU kernels `TRITON_OPS`, and the same
group math runs in both, so that a kernel rounds like its reference.
"""

from collections.abc import Callable
import dataclasses
import math
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _device
from pallas_kernels import dispatch

try:
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover
  pl = None
  pltriton = None

FORMATS = {
    'e4m3': np.dtype(jnp.float8_e4m3fn),
    'e5m2': np.dtype(jnp.float8_e5m2),
}
# The values of every `implementation=` argument (coat_jax.optim checks its
# own against them).
IMPLEMENTATIONS = (None, *dispatch.IMPLEMENTATIONS)


def fp8_dtype(dtype: Any, argname: str = 'dtype') -> np.dtype:
  """The numpy dtype of an FP8 format given by name ('e4m3', 'e5m2') or dtype.

  Raises:
    ValueError: for anything else.
  """
  if isinstance(dtype, str) and dtype in FORMATS:
    return FORMATS[dtype]
  try:
    dt = np.dtype(dtype)
  except TypeError:
    dt = None
  if dt is not None and dt in FORMATS.values():
    return dt
  raise ValueError(
      f'{argname}={dtype!r} is not an FP8 format: use one of'
      f' {sorted(FORMATS)} (or jnp.float8_e4m3fn / jnp.float8_e5m2).')


def fp8_max(dtype: Any) -> float:
  """Largest finite value: 448 for E4M3, 57344 for E5M2."""
  return float(jnp.finfo(fp8_dtype(dtype)).max)


def saturate(x: jax.Array, dtype: Any, ops: 'Ops | None' = None) -> jax.Array:
  """Clips float32 `x` to +-fp8_max, then casts (round to nearest even).

  Equal to `jnp.clip(x, -m, m).astype(dtype)` on every input (NaN stays NaN,
  -0 stays -0), clipped by `ops.clip` (default `XLA_OPS`).
  """
  dt = fp8_dtype(dtype)
  m = fp8_max(dt)
  return (ops or XLA_OPS).clip(x, -m, m).astype(dt)


def clip(x: jax.Array, lo: float, hi: float) -> jax.Array:
  """`jnp.clip` with NaN propagated on every backend, as two selects.

  For the kernels: Triton lowers min/max (and clamp) to NaN-dropping
  `minnumf`/`maxnumf`.
  """
  x = jnp.where(x < lo, lo, x)
  return jnp.where(x > hi, hi, x)


def clamp(x: jax.Array, lo: float, hi: float) -> jax.Array:
  """`jnp.clip` for XLA: one clamp with scalar bounds (NaN propagates).

  Not `clip`'s selects: `jnp.where(x > hi, hi, x)` broadcasts the constant
  to x's shape, and under `lax.scan` autodiff jax hoists such constant-only
  values out of the loop and carries them as materialized arrays, read by
  every layer.
  """
  return lax.clamp(jnp.asarray(lo, x.dtype), x, jnp.asarray(hi, x.dtype))


def with_sign_of(a: jax.Array, x: jax.Array) -> jax.Array:
  """`sign(x) * a` for float32 `a >= 0` or NaN: -0.0 gives -0 too.

  The sign bit of x is or-ed into a: one instruction on the GPU.
  """
  sign = lax.bitcast_convert_type(x, jnp.int32) & np.int32(-2**31)
  bits = lax.bitcast_convert_type(a, jnp.int32) | sign
  return lax.bitcast_convert_type(bits, jnp.float32)


def nan_max(x: jax.Array, axis: int) -> jax.Array:
  """Max over `axis` of x >= 0 with NaN counted as +inf, in one reduction.

  Triton's max drops NaN. As +inf, a NaN still makes the amax non-finite, so
  the scale is NaN exactly as in the reference; only the exponent of such a
  group (meaningless: it decodes to NaN) may differ from XLA's.
  """
  return jnp.max(jnp.where(x != x, jnp.inf, x), axis=axis)


def abs_max(absx: jax.Array, axis: int) -> jax.Array:
  """Max over `axis` of float32 |x| values, NaN if any of them is NaN.

  Reduced on the int32 bits (non-negative floats order like their bits, NaN
  above +inf): XLA and Triton (whose float max drops NaN) then agree bit for
  bit, and no per-element select is needed as in `nan_max`.
  """
  bits = lax.bitcast_convert_type(absx, jnp.int32)
  return lax.bitcast_convert_type(jnp.max(bits, axis), jnp.float32)


def tensor_abs_max(x: jax.Array) -> jax.Array:
  """max |x| over the whole array as float32 (0 if empty), NaN if x holds
  NaN: `abs_max` of the flat array (XLA's CPU max reduction drops NaN)."""
  flat = jnp.abs(jnp.asarray(x).astype(jnp.float32)).reshape(-1)
  return abs_max(flat, 0) if flat.size else jnp.float32(0)


def explicit_spec(x: jax.Array) -> tuple | None:
  """x's sharding spec, one entry per axis, if its type shards an axis
  (Explicit mesh axes); None otherwise (one device, no mesh, Auto axes:
  then callers leave their code as it is)."""
  spec = tuple(jax.typeof(x).sharding.spec)
  if not any(s is not None for s in spec):
    return None
  return spec + (None,) * (x.ndim - len(spec))


def mesh_size(x: jax.Array, entry: Any) -> int:
  """Devices along one spec entry (a mesh axis name, a tuple, None) of x."""
  names = entry if isinstance(entry, tuple) else (entry,)
  mesh = jax.typeof(x).sharding.mesh
  return math.prod(mesh.shape[n] for n in names if n is not None)


def with_spec(x: jax.Array, spec: tuple | None) -> jax.Array:
  """x resharded to `spec` (from `explicit_spec`) if it has another."""
  if spec is None or explicit_spec(x) == spec:
    return x
  return jax.sharding.reshard(x, jax.sharding.PartitionSpec(*spec))


def replicated(x: jax.Array) -> jax.Array:
  """x with no sharded axis: an all-gather under Explicit mesh axes (its
  transpose, in backward, reduce-scatters); x itself otherwise."""
  spec = explicit_spec(x)
  return x if spec is None else with_spec(x, (None,) * x.ndim)


def _axes(entry: Any) -> tuple:
  return entry if isinstance(entry, tuple) else (() if entry is None
                                                 else (entry,))


def dot_out_sharding(
    a: jax.Array, b: jax.Array, a_free: int, b_free: int
) -> jax.sharding.PartitionSpec | None:
  """The out_sharding of a two-operand contraction under Explicit axes.

  For an (a_free-th axis of a) x (b_free-th axis of b) result, such as
  (M, K) x (N, K) -> (M, N) with a_free = b_free = 0: each output axis keeps
  its operand's sharding (b's dropped if it reuses a mesh axis of a's), and
  a contraction over sharded axes is summed across them. jax asks for it
  whenever contracted axes are sharded. None (no out_sharding) without
  Explicit sharding, so that other code is traced as before.
  """
  sa, sb = explicit_spec(a), explicit_spec(b)
  if sa is None and sb is None:
    return None
  ea = sa[a_free] if sa is not None else None
  eb = sb[b_free] if sb is not None else None
  if set(_axes(ea)) & set(_axes(eb)):
    eb = None
  return jax.sharding.PartitionSpec(ea, eb)


def _asm(instruction: str, *args: jax.Array) -> jax.Array:
  args = jnp.broadcast_arrays(*[jnp.asarray(a, jnp.float32) for a in args])
  constraints = '=f' + ',f' * len(args)
  (out,) = pltriton.elementwise_inline_asm(
      instruction, args=args, constraints=constraints, pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, jnp.float32)])
  return out


@dataclasses.dataclass(frozen=True)
class Ops:
  """The float32 operations whose lowering differs between backends.

  Attributes:
    div: float32 division.
    div_scalar: x / y for one scalar y with 2^-126 <= |y| <= 2^126, the same
      bits as the references' x / y (XLA's division by a broadcast scalar).
    div2: (x / y) / z for a scalar y as the references' XLA computes it: on
      the GPU its simplifier rewrites it to x / (y * z).
    sqrt: float32 square root.
    clip: clip(x, lo, hi) to scalar bounds, NaN propagated.
    log2, exp2: base-2 log and exp; when set, the group math with expansion
      runs in the log2 domain (`quantize_per_group.log2_math`, fewer
      operations per element) instead of the reference's expressions.
  """

  div: Callable[[Any, Any], jax.Array]
  div_scalar: Callable[[Any, Any], jax.Array]
  div2: Callable[[Any, Any, Any], jax.Array]
  sqrt: Callable[[Any], jax.Array]
  clip: Callable[[Any, float, float], jax.Array] = clamp
  log2: Callable[[Any], jax.Array] | None = None
  exp2: Callable[[Any], jax.Array] | None = None


def _times_reciprocal(x: jax.Array, y: jax.Array) -> jax.Array:
  # Triton's division, div.full.f32, is x * rcp.approx(y) for
  # 2^-126 <= |y| <= 2^126 (ptxas, sm_90), and XLA rewrites x / y for a
  # broadcast scalar y into x * (1 / y): the reciprocal taken once per program
  # gives the same bits without ~8 instructions per element.
  return x * lax.div(np.float32(1), y)


# The references run XLA's own ops. On the GPU, XLA's float32 division,
# sqrt, log and exp are not correctly rounded.
XLA_OPS = Ops(div=jnp.divide, div_scalar=jnp.divide,
              div2=lambda x, y, z: x / y / z, sqrt=jnp.sqrt)
# Triton's own lowering (div.full.f32, libdevice sqrt/log/exp) reproduces
# XLA's results bit for bit on the GPU (correctly rounded instructions
# would not), so the compiled kernels use it.
TRITON_OPS = Ops(div=lax.div, div_scalar=_times_reciprocal,
                 div2=lambda x, y, z: lax.div(x, y * z), sqrt=jnp.sqrt,
                 clip=clip)


# Interpreted kernels run as XLA on the host, where XLA rewrites x / y for a
# broadcast scalar y into x * (1 / y) in the references but not in the
# interpreted kernel: it is spelled out there.
_interpret_div_scalar = lambda x, y: x * jnp.divide(np.float32(1), y)
INTERPRET_OPS = dataclasses.replace(
    XLA_OPS, div_scalar=_interpret_div_scalar,
    div2=lambda x, y, z: _interpret_div_scalar(x, y) / z)


def approx_log2(x: jax.Array) -> jax.Array:
  """log2 x as lg2.approx.ftz.f32: one special-function op (subnormal x
  reads as 0: -inf)."""
  return _asm('lg2.approx.ftz.f32 $0, $1;', x)


def approx_exp2(x: jax.Array) -> jax.Array:
  """2^x as ex2.approx.ftz.f32: one op (a subnormal result is 0)."""
  return _asm('ex2.approx.ftz.f32 $0, $1;', x)


def approx_reciprocal(x: jax.Array) -> jax.Array:
  """1 / x as rcp.approx.ftz.f32 (~1 ulp): one op, against div.full's
  range checks."""
  return _asm('rcp.approx.ftz.f32 $0, $1;', x)


def approx_log2_domain(ops: Ops) -> Ops:
  """`ops` for the optimizer kernels compiled with `approx`: the group math
  in the log2 domain on the GPU's lg2/ex2 (subnormals flushed), Adam's
  division (x / y) / z as x * rcp(y z). Their moments need not be the
  reference's bits: the tests hold them to stated tolerances. The
  reciprocal flushes a subnormal denominator (1 - b1^t) (sqrt(v_hat) + eps)
  to 0, which needs eps < 2^-126 / (1 - b1) (~1e-35 at b1 = 0.999); it
  takes fewer instructions per element than the non-flushing rcp."""
  return dataclasses.replace(
      ops, log2=approx_log2, exp2=approx_exp2,
      div2=lambda x, y, z: x * approx_reciprocal(y * z))


def kernel_ops(interpret: bool) -> Ops:
  """The ops of a kernel: compiled (`TRITON_OPS`) or interpreted."""
  return INTERPRET_OPS if interpret else TRITON_OPS


# coat_jax's question (`coat_jax.nn.fsdp`, `coat_jax.optim.fused`): do the
# default backend's devices compile the kernels, each on its shard inside
# the caller's `jax.shard_map`?
gpus_run_pallas = _device.has_fp8_gpus


def check_parts(parts) -> tuple[jax.Array, ...]:
  """`parts` as a tuple of arrays: one or more 2-D floating arrays with the
  same rows and dtype (the columns of one tensor, side by side), else a
  ValueError or TypeError naming what is wrong."""
  parts = tuple(jnp.asarray(x) for x in parts)
  if not parts or any(x.ndim != 2 or x.shape[0] != parts[0].shape[0]
                      or x.dtype != parts[0].dtype for x in parts):
    raise ValueError(
        'parts must be one or more 2-D arrays with the same rows and dtype;'
        f' got {[(x.shape, str(x.dtype)) for x in parts]}.')
  if not jnp.issubdtype(parts[0].dtype, jnp.floating):
    raise TypeError(f'parts have dtype {parts[0].dtype}; quantization needs'
                    ' floating arrays (cast with x.astype(jnp.float32)).')
  return parts


def compiler_params(num_warps: int, num_stages: int):
  return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def next_pow2(n: int) -> int:
  return 1 << max(0, int(n) - 1).bit_length()


# Pallas-Triton indexes an operand with 32-bit signed offsets (in elements)
# unless the operand holds more than 2^32 bytes: a 1-byte (FP8) operand of
# 2^31 to 2^32 elements gets offsets past 2^31 - 1, which wrap, and the
# kernel reads and writes outside it (the FP8 moments of a 13B model's
# stacked MLP weights: 40 x 5120 x 13824 elements). Such operands go through
# the kernels in parts along their leading axis (`in_leading_parts`), each
# of at most PART_ELEMENTS elements.
INT32_OFFSET_LIMIT = 2**31
PART_ELEMENTS = 2**28


def offsets_overflow(*arrays: Any) -> bool:
  """Whether Pallas-Triton would index one of `arrays` (anything with shape
  and dtype; None is skipped) past 32-bit signed offsets."""
  for a in arrays:
    if a is None:
      continue
    n = math.prod(a.shape)
    if n >= INT32_OFFSET_LIMIT and n * np.dtype(a.dtype).itemsize <= 2**32:
      return True
  return False


def leading_parts(shape: tuple[int, ...],
                  limit: int | None = None) -> list[tuple[int, int]]:
  """[(start, stop)] covering shape[0] in parts of at most `limit`
  (default PART_ELEMENTS) elements, each at least one index of axis 0.

  Raises:
    ValueError: for a 0-d or 1-D shape (no leading axis to split with the
      last one kept whole).
  """
  if len(shape) < 2:
    raise ValueError(
        f'an array of shape {shape} has {math.prod(shape)} elements, more'
        f' than the {INT32_OFFSET_LIMIT} the Pallas-Triton kernels index'
        ' with 32-bit offsets, and no leading axis to split it along:'
        " reshape it to 2-D, or use implementation='xla'.")
  per_index = math.prod(shape[1:])
  step = max(1, (PART_ELEMENTS if limit is None else limit) // per_index)
  return [(i, min(i + step, shape[0])) for i in range(0, shape[0], step)]


def in_leading_parts(fn: Callable[..., Any], whole: Any, parts_of: Any,
                     out_shapes: Any = None) -> Any:
  """`fn(whole, parts_of)`, or where `offsets_overflow` (of whole,
  parts_of or out_shapes), `fn` part by part along axis 0 (`leading_parts`
  of the first leaf of `whole`, or of `parts_of`), its results written into
  `whole` in place.

  Args:
    fn: (whole's parts, parts_of's parts) -> a pytree like `whole`'s parts
      (or, with out_shapes, like out_shapes' parts, then whole's).
    whole: pytree of arrays updated part by part (dynamic-update-slices
      of the same buffers: in place under jit with donated inputs).
    parts_of: pytree of read-only arrays sliced alongside.
    out_shapes: None, or a pytree of ShapeDtypeStructs of further results,
      made as zeros and filled part by part.

  Returns:
    The updated `whole` (with out_shapes: (out, whole)).
  """
  if not offsets_overflow(*jax.tree.leaves((whole, parts_of, out_shapes))):
    return fn(whole, parts_of)
  leading = jax.tree.leaves((whole, parts_of))[0].shape
  state = whole
  if out_shapes is not None:
    state = (jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shapes),
             whole)
  for start, stop in leading_parts(leading):
    cut = lambda a: lax.slice_in_dim(a, start, stop, axis=0)
    args = jax.tree.map(cut, whole if out_shapes is None else state[1])
    new = fn(args, jax.tree.map(cut, parts_of))
    state = jax.tree.map(
        lambda a, b: lax.dynamic_update_slice_in_dim(a, b, start, 0),
        state, new)
  return state


def as_2d(shape: tuple[int, ...]) -> tuple[int, int]:
  """(rows, cols) of the 2-D view that keeps the last axis: () -> (1, 1)."""
  if not shape:
    return 1, 1
  return math.prod(shape[:-1]), shape[-1]


def tile_mask(
    pid_rows: jax.Array, pid_cols: jax.Array, block: tuple[int, int],
    bound: tuple[int, int]
) -> jax.Array:
  """Which elements of the (rows, cols) tile at the given block lie inside."""
  r = pid_rows * block[0] + lax.broadcasted_iota(jnp.int32, block, 0)
  c = pid_cols * block[1] + lax.broadcasted_iota(jnp.int32, block, 1)
  return (r < bound[0]) & (c < bound[1])


def group_tile(
    block: tuple[int, int], ncb: int, rows: int, cols: int, group_size: int
) -> tuple[int, jax.Array | None, jax.Array | None]:
  """This program's tile of a (rows, cols) view with groups along cols.

  Args:
    block: (block_rows, block_cols) of the tile; block_cols holds whole groups.
    ncb: tiles per row of tiles (the grid is flattened row-major).
    rows, cols: the view's shape.
    group_size: elements per group.

  Returns:
    (groups per tile row, element mask (block), group mask (block_rows,
    groups per tile row)); both masks are None when the tiles cover the view
    exactly, as the big ones do: masks cost selects and predicates on every
    element.
  """
  pid = pl.program_id(0)
  i, j = pid // ncb, pid % ncb
  ng = block[1] // group_size
  if rows % block[0] == 0 and cols % block[1] == 0:
    return ng, None, None
  mask = tile_mask(i, j, block, (rows, cols))
  gmask = tile_mask(i, j, (block[0], ng), (rows, pl.cdiv(cols, group_size)))
  return ng, mask, gmask


def masked_load(ref: Any, mask: jax.Array | None, fill: float,
                dtype: Any = jnp.float32) -> jax.Array:
  """The tile of `ref` as `dtype` (None: ref's own), `fill` where `mask` (if
  any) is False."""
  x = pltriton.load(ref, mask=mask)
  x = x if dtype is None else x.astype(dtype)
  return x if mask is None else jnp.where(mask, x, fill)


@dataclasses.dataclass(frozen=True)
class GroupBlockSizes:
  """Static tiling of a (rows, cols) view whose groups run along cols.

  Attributes:
    block_rows: rows of a tile (a power of two); None picks one.
    block_cols: columns of a tile (a power of two and a multiple of the group
      size, so a tile holds whole groups); None picks one.
    num_warps: warps per program.
    target: elements per tile when the sizes are picked from the shape.
    max_cols: the largest block_cols picked from the shape.
  """

  block_rows: int | None = None
  block_cols: int | None = None
  num_warps: int = 4
  target: int = 4096
  max_cols: int = 1024

  def resolve(self, rows: int, cols: int, group_size: int) -> tuple[int, int]:
    """(block_rows, block_cols) for a (rows, cols) array."""
    bc = self.block_cols or min(
        max(group_size, next_pow2(cols)), max(group_size, self.max_cols))
    br = self.block_rows or min(next_pow2(rows), max(1, self.target // bc))
    if bc % group_size or bc & (bc - 1) or br & (br - 1):
      raise ValueError(
          f'block sizes ({br}, {bc}) must be powers of two and block_cols a'
          f' multiple of group_size={group_size}.')
    return br, bc
