"""Per-tensor quantize (+ transposed copy) as Pallas kernels (Triton lowering).

Two kernels over (block_rows, block_cols) tiles of the 2-D view (rows, cols):
`_amax_kernel` writes one max |x| per tile (NaN counted as +inf) (COAT's "group
scaling": per-block maxima, then a tiny reduction in XLA), `_quantize_kernel`
divides by the scale and writes the FP8 tile and, optionally, its transpose
into a (cols, rows) array. Given the amax (from the producer), quantization is
a single pass over x. `quantize_per_tensor_parts` runs the quantize kernel
once per part, each writing its columns of the shared outputs (aliased from
one call to the next): no concatenation is written.
"""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import _common
from pallas_kernels._common import pl
from pallas_kernels._common import pltriton
from pallas_kernels.quantize_per_tensor import reference


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Static tiling (powers of two). None picks a size from the shape.

  Attributes:
    block_rows: rows of a tile.
    block_cols: columns of a tile.
    num_warps: warps per program.
    target: elements per tile (without transpose) when picked from the shape.
  """

  block_rows: int | None = None
  block_cols: int | None = None
  num_warps: int = 4
  target: int = 4096

  def resolve(self, rows: int, cols: int, transpose: bool) -> tuple[int, int]:
    if transpose:  # square-ish tiles keep both stores coalesced
      bc = self.block_cols or min(_common.next_pow2(cols), 64)
      br = self.block_rows or min(_common.next_pow2(rows), 64)
    else:
      bc = self.block_cols or min(_common.next_pow2(cols), 1024)
      br = self.block_rows or min(
          _common.next_pow2(rows), max(1, self.target // bc))
    if bc & (bc - 1) or br & (br - 1):
      raise ValueError(f'block sizes ({br}, {bc}) must be powers of two.')
    return br, bc


def _tile(ref, rows, cols, ncb):
  pid = pl.program_id(0)
  i, j = pid // ncb, pid % ncb
  mask = _common.tile_mask(i, j, ref.shape, (rows, cols))
  x = pltriton.load(ref, mask=mask).astype(jnp.float32)
  return i, j, mask, jnp.where(mask, x, 0.0)


def _amax_kernel(x_ref, o_ref, *, rows, cols, ncb):
  _, _, _, x = _tile(x_ref, rows, cols, ncb)
  m = _common.nan_max(_common.nan_max(jnp.abs(x), 1), 0)
  o_ref[...] = jnp.full(o_ref.shape, m, jnp.float32)


def _quantize_kernel(s_ref, x_ref, *out_refs, rows, cols, ncb, dtype,
                     transpose, ops):
  i, j, mask, x = _tile(x_ref, rows, cols, ncb)
  scale = s_ref[...].astype(jnp.float32)  # (1, 1)
  values = _common.saturate(ops.div(x, scale), dtype, ops)
  pltriton.store(out_refs[0], values, mask=mask)
  if transpose:
    pltriton.store(out_refs[1], values.T, mask=mask.T)


def _grid(rows, cols, br, bc):
  ncb = pl.cdiv(cols, bc)
  return (pl.cdiv(rows, br) * ncb,), ncb


@functools.partial(jax.jit, static_argnames=('block_sizes', 'interpret'))
def tensor_amax(
    x: jax.Array, *, block_sizes: BlockSizes = BlockSizes(),
    interpret: bool = False
) -> jax.Array:
  """max |x| as float32, +inf if any element is NaN or Inf (x.size > 0)."""
  rows, cols = _common.as_2d(x.shape)
  br, bc = block_sizes.resolve(rows, cols, False)
  grid, ncb = _grid(rows, cols, br, bc)
  partial = pl.pallas_call(
      functools.partial(_amax_kernel, rows=rows, cols=cols, ncb=ncb),
      grid=grid,
      in_specs=[pl.BlockSpec((br, bc), lambda p: (p // ncb, p % ncb))],
      out_specs=pl.BlockSpec((1, 1), lambda p: (p, 0)),
      out_shape=jax.ShapeDtypeStruct((grid[0], 1), jnp.float32),
      interpret=interpret,
      compiler_params=_common.compiler_params(block_sizes.num_warps, 1),
      name='tensor_amax',
  )(x.reshape(rows, cols))
  return jnp.max(partial)  # NaN-propagating in XLA


@functools.partial(
    jax.jit, static_argnames=('dtype', 'scale_dtype', 'transpose',
                              'block_sizes', 'interpret'))
def quantize_per_tensor(
    x: jax.Array, dtype: Any = 'e4m3', *, scale_dtype: Any = jnp.float32,
    amax: jax.Array | None = None, transpose: bool = False,
    block_sizes: BlockSizes = BlockSizes(), interpret: bool = False
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """Pallas version of `reference.quantize_per_tensor` (same contract)."""
  dt = _common.fp8_dtype(dtype)
  shape = x.shape
  rows, cols = _common.as_2d(shape)
  if amax is None:
    amax = (tensor_amax(x, block_sizes=dataclasses.replace(
        block_sizes, block_rows=None, block_cols=None),
                        interpret=interpret) if x.size
            else jnp.float32(0))
  scale = reference.scale_from_amax(
      jnp.asarray(amax, jnp.float32), dt, scale_dtype)
  if not x.size:
    values = jnp.zeros(shape, dt)
    return values, scale, (jnp.zeros((cols, rows), dt) if transpose else None)
  br, bc = block_sizes.resolve(rows, cols, transpose)
  grid, ncb = _grid(rows, cols, br, bc)
  out_shape = [jax.ShapeDtypeStruct((rows, cols), dt)]
  out_specs = [pl.BlockSpec((br, bc), lambda p: (p // ncb, p % ncb))]
  if transpose:
    out_shape.append(jax.ShapeDtypeStruct((cols, rows), dt))
    out_specs.append(pl.BlockSpec((bc, br), lambda p: (p % ncb, p // ncb)))
  kernel = functools.partial(
      _quantize_kernel, rows=rows, cols=cols, ncb=ncb, dtype=dt,
      transpose=transpose, ops=_common.kernel_ops(interpret))
  outs = pl.pallas_call(
      kernel, grid=grid,
      in_specs=[pl.BlockSpec((1, 1), lambda p: (0, 0)),
                pl.BlockSpec((br, bc), lambda p: (p // ncb, p % ncb))],
      out_specs=out_specs, out_shape=out_shape, interpret=interpret,
      compiler_params=_common.compiler_params(block_sizes.num_warps, 1),
      name='quantize_per_tensor',
  )(scale.reshape(1, 1), x.reshape(rows, cols))
  values = outs[0].reshape(shape)
  return values, scale, (outs[1] if transpose else None)


def _column_block(block_cols: int, offsets) -> int:
  """The largest power of two <= block_cols that divides every offset (a
  tile then never straddles two parts)."""
  bc = block_cols
  while any(off % bc for off in offsets):
    bc //= 2
  return bc


@functools.partial(
    jax.jit, static_argnames=('dtype', 'scale_dtype', 'transpose',
                              'block_sizes', 'interpret'))
def quantize_per_tensor_parts(
    parts: tuple[jax.Array, ...], dtype: Any = 'e4m3', *,
    scale_dtype: Any = jnp.float32, amax: jax.Array | None = None,
    transpose: bool = False, block_sizes: BlockSizes = BlockSizes(),
    interpret: bool = False
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """Pallas version of `reference.quantize_per_tensor_parts` (same
  contract): one quantize call per part, into its columns of the outputs."""
  dt = _common.fp8_dtype(dtype)
  rows = parts[0].shape[0]
  widths = [x.shape[1] for x in parts]
  offsets = [sum(widths[:i]) for i in range(len(parts))]
  if amax is None:
    amax = jnp.max(jnp.stack([tensor_amax(x, interpret=interpret)
                              for x in parts]))
  scale = reference.scale_from_amax(
      jnp.asarray(amax, jnp.float32), dt, scale_dtype)
  br, bc = block_sizes.resolve(rows, max(widths), transpose)
  bc = _column_block(bc, offsets)
  out_shape = [jax.ShapeDtypeStruct((rows, sum(widths)), dt)]
  if transpose:
    out_shape.append(jax.ShapeDtypeStruct((sum(widths), rows), dt))
  outs = None
  for x, off in zip(parts, offsets):
    grid, ncb = _grid(rows, x.shape[1], br, bc)
    ob = off // bc
    out_specs = [pl.BlockSpec((br, bc), lambda p, ob=ob, ncb=ncb: (
        p // ncb, p % ncb + ob))]
    if transpose:
      out_specs.append(pl.BlockSpec((bc, br), lambda p, ob=ob, ncb=ncb: (
          p % ncb + ob, p // ncb)))
    kernel = functools.partial(
        _quantize_kernel, rows=rows, cols=x.shape[1], ncb=ncb, dtype=dt,
        transpose=transpose, ops=_common.kernel_ops(interpret))
    inputs = [scale.reshape(1, 1), x]
    in_specs = [pl.BlockSpec((1, 1), lambda p: (0, 0)),
                pl.BlockSpec((br, bc), lambda p, ncb=ncb: (p // ncb,
                                                           p % ncb))]
    aliases = {}
    if outs is not None:  # the earlier parts' outputs, written in place
      aliases = {2 + k: k for k in range(len(outs))}
      inputs += outs
      in_specs += out_specs
      kernel = functools.partial(_skip_refs, kernel, len(outs))
    outs = pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=_common.compiler_params(block_sizes.num_warps, 1),
        name='quantize_per_tensor',
    )(*inputs)
  return outs[0], scale, (outs[1] if transpose else None)


def _skip_refs(kernel, count, s_ref, x_ref, *refs):
  """`kernel` on (s_ref, x_ref, outputs), past `count` aliased inputs that
  it only writes through the outputs."""
  kernel(s_ref, x_ref, *refs[count:])
