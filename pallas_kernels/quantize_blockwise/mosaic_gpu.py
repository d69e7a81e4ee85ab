"""The two-layout 1x128 quantizer (x and x^T in one pass) in Pallas Mosaic
GPU, for Hopper.

One CTA (one warpgroup) per 128x128 tile of x (M, K): TMA brings the 16-bit
tile into shared memory; the warpgroup reads it twice, as x (rows of 128
along K) and through a transposed view of the same buffer as x^T (rows of
128 along M), each in two 64-row halves, quantizes them with the
reference's math and TMA writes both layouts' codes and scales. x^T comes
in 1x128 tiles along M or, with transpose_block (128, 128), as one 128x128
block per tile (scale from the max of the whole tile). Three CTAs share an
SM (65 KiB of shared memory; 96 registers a thread, 163 with blocks), so
one CTA's loads overlap another's math: nearer a copy's speed than the
Triton kernel (one 128x256 tile per program at 16 warps) at power-of-two
widths (RESULTS.md "Block quantizers").

Scales leave the kernel K-block first ((K // 128, M), and (M // 128, K) for
x^T's tiles: TMA needs rows of 16 bytes or more; the block GEMM reads that
layout, so XLA cancels the transposes back between the two) and are
transposed to the reference's layout after it. A 128x128 block's one scale
is stored from registers.

Needs rows and columns in multiples of 128 and a 16-bit input (`supports`);
the Triton kernel (`pallas_triton`) takes every other case.
"""

import functools
from typing import Any

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels import _common
from pallas_kernels import _mosaic
from pallas_kernels.quantize_blockwise import reference

TILE = reference.TILE
HALF = 64  # rows of a WGMMA-layout array (one warpgroup's m64)
INPUT_DTYPES = (jnp.bfloat16, jnp.float16)


def supports(widths: tuple[int, ...], rows: int, dtype: Any,
             transpose: bool) -> bool:
  """Whether this kernel runs the case: x and x^T of 16-bit parts of these
  widths side by side, every width and `rows` a multiple of 128."""
  return (transpose and jnp.dtype(dtype) in INPUT_DTYPES
          and rows % TILE == 0 and rows > 0
          and all(w % TILE == 0 and w > 0 for w in widths))


def _halves(ref, transposed):
  """The float32 64-row halves of a (128, 128) tile in shared memory, in
  WGMMA layout: of the tile itself, or of its transpose."""
  if transposed:
    ref = ref.T
  for h in range(TILE // HALF):
    half = pl.ds(h * HALF, HALF)
    if transposed:  # a transposed load, then a register shuffle
      x = plgpu.layout_cast(
          _mosaic.load(ref.at[half], plgpu.Layout.WGMMA_TRANSPOSED),
          plgpu.Layout.WGMMA)
    else:
      x = _mosaic.load(ref.at[half], plgpu.Layout.WGMMA)
    yield half, x.astype(jnp.float32)


def _encode_tiles(x_ref, v_ref, s_ref, transposed, dtype, pow2):
  """Codes of each 1x128 row of the tile (or of its transpose) into v_ref
  (128, 128) and the rows' scales into s_ref (1, 128)."""
  for half, x in _halves(x_ref, transposed):
    amax = jnp.max(jnp.abs(x), axis=1)
    scale = reference.scale_from_amax(amax, dtype, pow2)
    den = lax.broadcast_in_dim(scale, x.shape, (0,))
    v_ref[half] = _mosaic.saturated_codes(x, den, dtype)
    s_ref[0, half] = scale


def _encode_block(x_ref, v_ref, dtype, pow2):
  """The tile's transpose as one 128x128 block into v_ref; its scale."""
  halves = list(_halves(x_ref, True))
  amax = functools.reduce(jnp.maximum, [
      jnp.max(jnp.max(jnp.abs(x), axis=1), axis=0) for _, x in halves])
  scale = reference.scale_from_amax(amax, dtype, pow2)
  for half, x in halves:
    den = plgpu.layout_cast(lax.broadcast_in_dim(scale, x.shape, ()),
                            plgpu.Layout.WGMMA)
    v_ref[half] = _mosaic.saturated_codes(x, den, dtype)
  return scale


def _kernel(*refs, parts, ncb, dtype, pow2, t_blocks):
  """refs: one input per part (`parts`: each one's (first column tile,
  tiles)), the four outputs, then the scratch buffers."""
  in_refs, refs = refs[:len(parts)], refs[len(parts):]
  v_gmem, s_gmem, vt_gmem, st_gmem = refs[:4]
  x_smem, v_smem, vt_smem, s_smem, st_smem, bar = refs[4:]
  p = lax.axis_index('tile')
  i, j = p // ncb, p % ncb
  rows, cols = pl.ds(i * TILE, TILE), pl.ds(j * TILE, TILE)
  for x_gmem, (first, tiles) in zip(in_refs, parts):
    def load(x_gmem=x_gmem, first=first):
      plgpu.copy_gmem_to_smem(
          x_gmem.at[rows, pl.ds((j - first) * TILE, TILE)], x_smem, bar)
    if len(parts) == 1:
      load()
    else:
      pl.when((j >= first) & (j < first + tiles))(load)
  plgpu.barrier_wait(bar)
  _encode_tiles(x_smem, v_smem, s_smem, False, dtype, pow2)
  if t_blocks:
    st_gmem[j, i] = _encode_block(x_smem, vt_smem, dtype, pow2)
  else:
    _encode_tiles(x_smem, vt_smem, st_smem, True, dtype, pow2)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(v_smem, v_gmem.at[rows, cols])
  plgpu.copy_smem_to_gmem(s_smem, s_gmem.at[pl.ds(j, 1), rows])
  plgpu.copy_smem_to_gmem(vt_smem, vt_gmem.at[cols, rows])
  if not t_blocks:
    plgpu.copy_smem_to_gmem(st_smem, st_gmem.at[pl.ds(i, 1), cols])
  plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit,
                   static_argnames=('dtype', 'pow2', 'transpose_block'))
def quantize_blockwise_parts(
    parts: tuple[jax.Array, ...], dtype: Any = jnp.float8_e4m3fn, *,
    pow2: bool = False, transpose_block: tuple[int, int] = (1, TILE)
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """`reference.quantize_blockwise_parts(parts, dtype, transpose=True,
  ...)` in one pass, for the cases `supports` (rows and widths multiples of
  128, one 16-bit dtype; a single x is one part).

  Returns:
    (values (M, K), scales (M, K // 128), values_t (K, M), scales_t
    (K, M // 128), or (K // 128, M // 128) with transpose_block (128, 128)),
    K = sum of the parts' widths: the reference's bits.
  """
  dt = _common.fp8_dtype(dtype)
  m = parts[0].shape[0]
  widths = tuple(x.shape[1] for x in parts)
  if not supports(widths, m, parts[0].dtype, True) or any(
      x.shape[0] != m or x.dtype != parts[0].dtype for x in parts):
    raise ValueError(
        f'parts of shapes {[x.shape for x in parts]} and dtypes'
        f' {[x.dtype for x in parts]}: the Mosaic kernel needs one 16-bit'
        ' dtype and rows and widths in multiples of 128 (use pallas_triton).')
  k = sum(widths)
  mb, kb = m // TILE, k // TILE
  firsts = [sum(widths[:q]) // TILE for q in range(len(parts))]
  t_blocks = tuple(transpose_block) == (TILE, TILE)
  st_shape = (kb, mb) if t_blocks else (mb, k)
  tile = lambda d: plgpu.SMEM((TILE, TILE), d,
                              transforms=_mosaic.smem_transforms(d, TILE))
  parts_tiles = tuple((f, w // TILE) for f, w in zip(firsts, widths))
  kernel = plgpu.kernel(
      _mosaic.named('quantize_tiles_t', _kernel, parts=parts_tiles, ncb=kb,
                    dtype=dt, pow2=pow2, t_blocks=t_blocks),
      out_type=(jax.ShapeDtypeStruct((m, k), dt),
                jax.ShapeDtypeStruct((kb, m), jnp.float32),
                jax.ShapeDtypeStruct((k, m), dt),
                jax.ShapeDtypeStruct(st_shape, jnp.float32)),
      scratch_types=[tile(parts[0].dtype), tile(dt), tile(dt),
                     plgpu.SMEM((1, TILE), jnp.float32),
                     plgpu.SMEM((1, TILE), jnp.float32),
                     plgpu.Barrier(num_arrivals=1)],
      grid=(mb * kb,),
      grid_names=('tile',),
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Lane),
  )
  values, scales, values_t, scales_t = kernel(*parts)
  return values, scales.T, values_t, scales_t if t_blocks else scales_t.T


def quantize_blockwise(
    x: jax.Array, dtype: Any = jnp.float8_e4m3fn, *, pow2: bool = False,
    transpose_block: tuple[int, int] = (1, TILE)
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """x (M, K) and x^T in 1x128 tiles (x^T's in 128x128 blocks with
  transpose_block (128, 128)): `quantize_blockwise_parts((x,), ...)`."""
  return quantize_blockwise_parts((x,), dtype, pow2=pow2,
                                  transpose_block=transpose_block)
