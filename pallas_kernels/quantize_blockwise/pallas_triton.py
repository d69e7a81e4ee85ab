"""Block-scaled quantization as Pallas kernels (Triton lowering).

Tiles (`_tiles_kernel`): each program reads one (block_rows, block_cols)
tile of the 2-D view x (M, K) once (block sizes multiples of 128) and writes
its FP8 values with their 1x128 scales along K and, with `transpose`, the
tile's transpose into x^T (K, M) with 1x128 scales along M (or 128x128
block scales): the two layouts of the operand in one pass. x^T's scales are
taken down x's columns, in x's own layout, so only the 1-byte codes go
through the transpose, not the float32 tile. `quantize_blockwise_parts`
runs the same kernel over several 2-D parts side by side (a fused
projection's gradient), each program reading its tile from its own part,
so the joined tensor is never written. Blocks (`_blocks_kernel`): one
program per 128x128 block. Out-of-range lanes load as zeros (the
reference's zero padding) and are masked on store. The programs take the
tiles band by band; with x^T in 128x128 blocks each band's column tiles
start further on than the band before's (`_tile_of`, `T_BLOCKS_SKEW`):
measured, power-of-two widths run faster so. The tile math is the
reference's `encode_tiles`, with the kernel's `Ops`.
"""

import dataclasses
import functools
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp

from pallas_kernels import _common
from pallas_kernels._common import pl
from pallas_kernels._common import pltriton
from pallas_kernels.quantize_blockwise import reference

TILE = reference.TILE
# Warps of the 128x128 weight-block kernel (one block per program; measured
# in benchmarks/kernels.py --blockwise), which takes no BlockSizes.
BLOCKS_NUM_WARPS = 8
# Column-tile skew between bands (`_tile_of`) with the transpose in 128x128
# blocks (g, g^T): at power-of-two widths a skew of 3 beats the plain order,
# other widths are unchanged (RESULTS.md "Block quantizers"). x, x^T gains
# nothing from any order.
T_BLOCKS_SKEW = 3


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiles of the 1x128 quantizer: multiples of 128, powers of two.

  Attributes:
    block_rows: rows (tokens) of a tile.
    block_cols: columns (K) of a tile.
    num_warps: warps per program; None: 16 with the transpose in 1x128
      tiles (and without a transpose), 8 with it in 128x128 blocks, the
      fastest of each (RESULTS.md "Block quantizers").
  """

  block_rows: int = 128
  block_cols: int = 256  # the fastest of benchmarks/kernels.py --blockwise
  num_warps: int | None = None

  def __post_init__(self):
    for name in ('block_rows', 'block_cols'):
      v = getattr(self, name)
      if v < TILE or v & (v - 1):
        raise ValueError(
            f'BlockSizes.{name}={v} must be a power of two >= {TILE}.')


def _tile_of(p, ncb, skew=0):
  """Program p's tile: (band i, column tile j) of a grid `ncb` tiles wide.
  The bands run in order; with a skew, band i's programs start at column
  tile skew * i (mod ncb)."""
  i = p // ncb
  if not skew:
    return i, p % ncb
  return i, (p % ncb + skew * i) % ncb


def _spec(block, ncb, transposed=False, skew=0):
  if transposed:
    return pl.BlockSpec(block, lambda p: _tile_of(p, ncb, skew)[::-1])
  return pl.BlockSpec(block, lambda p: _tile_of(p, ncb, skew))


def _part_spec(block, ncb, first, tiles, skew=0):
  """The input spec of a part whose `tiles` tile columns start at tile
  column `first` of the whole: programs of other parts get a clamped block
  of it, which they do not read."""
  if first == 0 and tiles == ncb:
    return _spec(block, ncb, skew=skew)
  def index(p):
    i, j = _tile_of(p, ncb, skew)
    return i, jnp.clip(j - first, 0, tiles - 1)
  return pl.BlockSpec(block, index)


def _quantize_tile(x, dtype, pow2, ops):
  """float32 (r, c) -> (values (r, c), scales (r, c // 128))."""
  r, c = x.shape
  values, scales = reference.encode_tiles(
      x.reshape(r, c // TILE, TILE), dtype, pow2, ops)
  return values.reshape(r, c), scales


def _quantize_cols(x, dtype, pow2, ops):
  """float32 (r, c) in 128x1 tiles down the rows: (values (r, c), scales
  (r // 128, c)): the 1x128 tiles of x^T, computed without moving x.

  The tiles of x.T are the columns of each 128-row band of x: the same
  maxima and divisions as `_quantize_tile(x.T)` (so the same bits), while
  only the 1-byte codes go through the transpose, not the float32 tile.
  """
  r, c = x.shape
  bands = x.reshape(r // TILE, TILE, c)
  amax = _common.abs_max(jnp.abs(bands), 1)  # (r // 128, c)
  scales = reference.scale_from_amax(amax, dtype, pow2)
  values = _common.saturate(ops.div(bands, scales[:, None, :]), dtype, ops)
  return values.reshape(r, c), scales


def _blocks_of_band(x, dtype, pow2, ops):
  """float32 (128, c) -> its 128x128 blocks: (values (128, c), scales
  (c // 128,)); c = 128 is one block. A block of x^T is the transposed block
  of x with the same scale, so only the codes go through the transpose.

  Each block's max is a masked reduction of the column maxima and its scale
  is selected back per column: no (128, c // 128, 128) view of the tile,
  whose reshapes cost Triton layout conversions (slower for g, g^T)."""
  c = x.shape[1]
  col_max = _common.abs_max(jnp.abs(x), 0)[None, :]  # (1, c)
  block_of_col = lax.broadcasted_iota(jnp.int32, (1, c), 1) // TILE
  block_index = lax.broadcasted_iota(jnp.int32, (c // TILE,), 0)
  col_scale = jnp.ones((1, c), jnp.float32)
  scales = jnp.ones((c // TILE,), jnp.float32)
  for b in range(c // TILE):
    in_block = block_of_col == b
    amax = _common.abs_max(jnp.where(in_block, col_max, 0.0), 1)  # (1,)
    scale = reference.scale_from_amax(amax, dtype, pow2)
    col_scale = jnp.where(in_block, scale[:, None], col_scale)
    scales = jnp.where(block_index == b, scale, scales)
  return _common.saturate(ops.div(x, col_scale), dtype, ops), scales


def _widen(x):
  """x as float32 for the second layout, converted again rather than kept.

  A bf16 tile held until x^T is encoded takes half the registers of its
  float32 copy, which matters at the 128-register cap of 16 warps (x, x^T
  runs faster so). The bf16 widening is
  spelt as a shift of the bits so that the compiler does not merge it with
  the first conversion (which would keep the float32 tile live again)."""
  if x.dtype != jnp.bfloat16:
    return x.astype(jnp.float32)
  bits = lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32) << 16
  return lax.bitcast_convert_type(bits, jnp.float32)


def _tiles_kernel(*refs, parts, rows, cols, ncb, skew, dtype, pow2,
                  transpose, t_blocks, ops):
  """refs: one input ref per part of x's columns (`parts`: each one's
  (first column tile, width)), then the outputs. A tile lies in one part."""
  in_refs, out_refs = refs[:len(parts)], refs[len(parts):]
  br, bc = in_refs[0].shape
  i, j = _tile_of(pl.program_id(0), ncb, skew)
  exact = rows % br == 0 and cols % bc == 0
  if len(parts) == 1:
    _encode_tile(in_refs[0], out_refs, i, j, j, rows, cols, exact, dtype,
                 pow2, transpose, t_blocks, ops)
    return
  for x_ref, (first, width) in zip(in_refs, parts):
    @pl.when((j >= first) & (j < first + pl.cdiv(width, bc)))
    def _(x_ref=x_ref, first=first, width=width):
      _encode_tile(x_ref, out_refs, i, j, j - first, rows, cols,
                   rows % br == 0 and width % bc == 0, dtype,
                   pow2, transpose, t_blocks, ops, part_cols=width)


def _encode_tile(x_ref, out_refs, i, j, part_j, rows, cols, exact, dtype,
                 pow2, transpose, t_blocks, ops, part_cols=None):
  """Loads tile (i, part_j) of x_ref (a part `part_cols` wide, x itself by
  default) and writes its codes and scales as tile (i, j) of the outputs."""
  br, bc = x_ref.shape
  mask = None if exact else _common.tile_mask(i, j, (br, bc), (rows, cols))
  load_mask = mask if part_cols is None or exact else _common.tile_mask(
      i, part_j, (br, bc), (rows, part_cols))
  x = _common.masked_load(x_ref, load_mask, 0.0, dtype=None)  # see _widen
  values, scales = _quantize_tile(x.astype(jnp.float32), dtype, pow2, ops)
  smask = None if exact else _common.tile_mask(
      i, j, (br, bc // TILE), (rows, pl.cdiv(cols, TILE)))
  pltriton.store(out_refs[0], values, mask=mask)
  pltriton.store(out_refs[1], scales, mask=smask)
  if transpose and t_blocks:  # a band of 128x128 blocks of x^T
    values_t, scales_t = _blocks_of_band(_widen(x), dtype, pow2, ops)
    bmask = None if exact else _common.tile_mask(
        j, i, (bc // TILE, 1), (pl.cdiv(cols, TILE), pl.cdiv(rows, TILE)))
    pltriton.store(out_refs[2], values_t.T, mask=None if exact else mask.T)
    pltriton.store(out_refs[3], scales_t[:, None], mask=bmask)
  elif transpose:
    values_t, scales_t = _quantize_cols(_widen(x), dtype, pow2, ops)
    tmask = None if exact else _common.tile_mask(
        j, i, (bc, br // TILE), (cols, pl.cdiv(rows, TILE)))
    pltriton.store(out_refs[2], values_t.T, mask=None if exact else mask.T)
    pltriton.store(out_refs[3], scales_t.T, mask=tmask)


def _blocks_kernel(x_ref, v_ref, s_ref, *, rows, cols, ncb, dtype, pow2, ops):
  i, j = _tile_of(pl.program_id(0), ncb)
  exact = rows % TILE == 0 and cols % TILE == 0
  mask = None if exact else _common.tile_mask(
      i, j, (TILE, TILE), (rows, cols))
  x = _common.masked_load(x_ref, mask, 0.0)
  values, scale = _blocks_of_band(x, dtype, pow2, ops)  # one block
  pltriton.store(v_ref, values, mask=mask)
  s_ref[...] = jnp.broadcast_to(scale[:, None], s_ref.shape)


@functools.partial(
    jax.jit, static_argnames=('block', 'dtype', 'transpose', 'pow2',
                              'transpose_block', 'block_sizes', 'interpret'))
def quantize_blockwise(
    x: jax.Array, block: tuple[int, int] = (1, TILE), dtype: Any = 'e4m3',
    *, transpose: bool = False, pow2: bool = False,
    transpose_block: tuple[int, int] = (1, TILE),
    block_sizes: BlockSizes = BlockSizes(), interpret: bool = False
) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None]:
  """Pallas version of `reference.quantize_blockwise` (same contract).

  With `transpose_block=(128, 128)` each program's tile is one band of
  128 rows (block_sizes.block_rows is then ignored); block=(128, 128)
  ignores block_sizes (one block per program)."""
  dt = _common.fp8_dtype(dtype)
  shape = x.shape
  rows, cols = _common.as_2d(shape)
  x2 = x.reshape(rows, cols)
  kb, mb = pl.cdiv(cols, TILE), pl.cdiv(rows, TILE)
  ops = _common.kernel_ops(interpret)
  if tuple(block) == (TILE, TILE):
    values, scales = pl.pallas_call(
        functools.partial(_blocks_kernel, rows=rows, cols=cols, ncb=kb,
                          dtype=dt, pow2=pow2, ops=ops),
        grid=(mb * kb,),
        in_specs=[_spec((TILE, TILE), kb)],
        out_specs=[_spec((TILE, TILE), kb), _spec((1, 1), kb)],
        out_shape=[jax.ShapeDtypeStruct((rows, cols), dt),
                   jax.ShapeDtypeStruct((mb, kb), jnp.float32)],
        interpret=interpret,
        compiler_params=_common.compiler_params(BLOCKS_NUM_WARPS, 1),
        name='quantize_blocks',
    )(x2)
    return values.reshape(shape), scales, None, None
  values, scales, values_t, scales_t = _tiles_call(
      (x2,), dt, pow2, transpose, transpose_block, block_sizes, interpret)
  values = values.reshape(shape)
  scales = scales.reshape(shape[:-1] + (kb,) if shape else (kb,))
  return values, scales, values_t, scales_t


def parts_tile_cols(widths: tuple[int, ...],
                    block_sizes: BlockSizes = BlockSizes()) -> int | None:
  """The tile width at which no tile straddles two parts of these widths:
  block_sizes.block_cols, or 128 where that is what divides every part but
  the last; None if even 128 does not."""
  for bc in (block_sizes.block_cols, TILE):
    if all(w % bc == 0 for w in widths[:-1]):
      return bc
  return None


@functools.partial(
    jax.jit, static_argnames=('dtype', 'transpose', 'pow2', 'transpose_block',
                              'block_sizes', 'interpret'))
def quantize_blockwise_parts(
    parts: tuple[jax.Array, ...], dtype: Any = 'e4m3', *,
    transpose: bool = False, pow2: bool = False,
    transpose_block: tuple[int, int] = (1, TILE),
    block_sizes: BlockSizes = BlockSizes(), interpret: bool = False
) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None]:
  """Pallas version of `reference.quantize_blockwise_parts` (same
  contract): one pass over the parts, each tile read from its own part
  (`parts_tile_cols` must give a width). No concatenation is written."""
  widths = tuple(x.shape[1] for x in parts)
  bc = parts_tile_cols(widths, block_sizes)
  if bc is None:
    raise ValueError(f'parts of widths {widths}: every part but the last'
                     f' must be a multiple of {TILE} wide.')
  return _tiles_call(tuple(parts), _common.fp8_dtype(dtype), pow2,
                     transpose, transpose_block,
                     dataclasses.replace(block_sizes, block_cols=bc),
                     interpret)


def _tiles_call(parts, dt, pow2, transpose, transpose_block, block_sizes,
                interpret):
  """The 1x128 tile quantizer over 2-D parts side by side (rows, sum n_i):
  (values, scales (rows, KB), values_t, scales_t) as `quantize_blockwise`
  of their concatenation; with several parts, block_sizes.block_cols
  divides every part but the last."""
  rows = parts[0].shape[0]
  cols = sum(x.shape[1] for x in parts)
  kb, mb = pl.cdiv(cols, TILE), pl.cdiv(rows, TILE)
  t_blocks = transpose and tuple(transpose_block) == (TILE, TILE)
  num_warps = block_sizes.num_warps
  if num_warps is None:
    num_warps = 8 if t_blocks else 16
  # 128x128 blocks of x^T: a tile is one band of 128 rows (tokens).
  br, bc = ((TILE, block_sizes.block_cols) if t_blocks
            else (block_sizes.block_rows, block_sizes.block_cols))
  ncb = pl.cdiv(cols, bc)
  skew = T_BLOCKS_SKEW if t_blocks else 0
  spec = functools.partial(_spec, ncb=ncb, skew=skew)
  out_shape = [jax.ShapeDtypeStruct((rows, cols), dt),
               jax.ShapeDtypeStruct((rows, kb), jnp.float32)]
  out_specs = [spec((br, bc)), spec((br, bc // TILE))]
  if t_blocks:
    out_shape += [jax.ShapeDtypeStruct((cols, rows), dt),
                  jax.ShapeDtypeStruct((kb, mb), jnp.float32)]
    out_specs += [spec((bc, br), transposed=True),
                  spec((bc // TILE, 1), transposed=True)]
  elif transpose:
    out_shape += [jax.ShapeDtypeStruct((cols, rows), dt),
                  jax.ShapeDtypeStruct((cols, mb), jnp.float32)]
    out_specs += [spec((bc, br), transposed=True),
                  spec((bc, br // TILE), transposed=True)]
  firsts = [sum(x.shape[1] for x in parts[:p]) // bc  # first tile columns
            for p in range(len(parts))]
  in_specs = [_part_spec((br, bc), ncb, first, pl.cdiv(x.shape[1], bc), skew)
              for x, first in zip(parts, firsts)]
  outs = pl.pallas_call(
      functools.partial(_tiles_kernel,
                        parts=tuple((f, x.shape[1])
                                    for f, x in zip(firsts, parts)),
                        rows=rows, cols=cols, ncb=ncb, skew=skew, dtype=dt,
                        pow2=pow2, transpose=transpose, t_blocks=t_blocks,
                        ops=_common.kernel_ops(interpret)),
      grid=(pl.cdiv(rows, br) * ncb,),
      in_specs=in_specs,
      out_specs=out_specs, out_shape=out_shape, interpret=interpret,
      compiler_params=_common.compiler_params(num_warps, 1),
      name='quantize_tiles',
  )(*parts)
  if not transpose:
    return outs[0], outs[1], None, None
  return tuple(outs)
