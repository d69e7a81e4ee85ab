"""Block-scaled FP8 quantization (1x128 tiles, 128x128 blocks): public entry.
"""

from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import _common
from pallas_kernels import dispatch
from pallas_kernels.quantize_blockwise import reference

TILE = reference.TILE
BLOCKS = reference.BLOCKS


def _mosaic_kernel():
  from pallas_kernels.quantize_blockwise import mosaic_gpu  # pylint: disable=import-outside-toplevel
  return mosaic_gpu


def _runs_mosaic(widths, rows, dtype, transpose, interpret) -> bool:
  """Whether the Pallas path takes the Mosaic GPU kernel: compiled (not
  interpreted) 1x128 tiles of x with x^T, x 16-bit with rows and widths in
  multiples of 128, where it is nearer a copy's speed than the Triton
  kernel (RESULTS.md "Block quantizers"). Otherwise the Triton kernel."""
  return not interpret and _mosaic_kernel().supports(widths, rows, dtype,
                                                      transpose)


def check_block(block: Any) -> tuple[int, int]:
  """`block` as a tuple, or ValueError naming the allowed values."""
  try:
    b = tuple(int(v) for v in block)
  except TypeError:
    b = None
  if b not in BLOCKS:
    raise ValueError(
        f'block={block!r} must be (1, 128) (tiles along the last axis) or'
        ' (128, 128) (weight blocks).')
  return b


def quantize_blockwise(
    x: jax.Array, block: tuple[int, int] = (1, TILE), dtype: Any = 'e4m3',
    *, transpose: bool = False, pow2_scales: bool = False,
    transpose_block: tuple[int, int] = (1, TILE),
    implementation: str | None = None
) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None]:
  """Quantizes `x` in 1x128 tiles or 128x128 blocks (see `reference`).

  Args:
    x: floating array. block (1, 128): any shape, tiled along the last axis
      (a 0-d array is one tile); block (128, 128): 2-D.
    block: (1, 128) or (128, 128).
    dtype: 'e4m3' or 'e5m2'.
    transpose: (1, 128) only: also the FP8 transpose of the 2-D view
      (prod(shape[:-1]), K), tiled along its last axis, in the same pass.
    pow2_scales: scales rounded up to powers of two (exact rescaling).
    transpose_block: (1, 128) (the transpose tiled along its last axis, the
      tokens) or (128, 128) (the transpose in 128x128 blocks: a GEMM's B
      operand with one scale per 128x128 block).
    implementation: None (fastest available), 'xla' or 'pallas'.

  Returns:
    (values x.shape FP8, scales float32: x.shape[:-1] + (ceil(K / 128),) for
    tiles, (ceil(M / 128), ceil(K / 128)) for blocks; values_t (K, M) FP8
    and scales_t (K, ceil(M / 128)) float32 -- (ceil(K / 128),
    ceil(M / 128)) with transpose_block (128, 128) -- with transpose, else
    None).
  """
  block = check_block(block)
  transpose_block = check_block(transpose_block)
  dt = _common.fp8_dtype(dtype)
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f'x has dtype {x.dtype}; quantization needs a floating'
                    ' array (cast with x.astype(jnp.float32)).')
  if block == (TILE, TILE):
    if x.ndim != 2:
      raise ValueError(
          f'block=(128, 128) quantizes a 2-D weight; x has shape {x.shape}.'
          ' Reshape it to 2-D or use block=(1, 128).')
    if transpose:
      raise ValueError(
          'transpose=True is for block=(1, 128): a 128x128 block scale serves'
          ' W and W^T alike (transpose the values yourself).')
  impl, interpret = dispatch.resolve_implementation(
      'quantize_blockwise', implementation)
  if impl == 'pallas' and x.size:
    rows, cols = _common.as_2d(x.shape)
    if block == (1, TILE) and _runs_mosaic((cols,), rows, x.dtype, transpose,
                                           interpret):
      values, scales, values_t, scales_t = _mosaic_kernel().quantize_blockwise(
          x.reshape(rows, cols), dt, pow2=bool(pow2_scales),
          transpose_block=transpose_block)
      return (values.reshape(x.shape),
              scales.reshape(x.shape[:-1] + scales.shape[-1:]), values_t,
              scales_t)
    from pallas_kernels.quantize_blockwise import pallas_triton
    return pallas_triton.quantize_blockwise(
        x, block, dt, transpose=transpose, pow2=bool(pow2_scales),
        transpose_block=transpose_block, interpret=interpret)
  return reference.quantize_blockwise(
      x, block, dt, transpose=transpose, pow2=bool(pow2_scales),
      transpose_block=transpose_block)


def quantize_blockwise_parts(
    parts, dtype: Any = 'e4m3', *, transpose: bool = False,
    pow2_scales: bool = False, transpose_block: tuple[int, int] = (1, TILE),
    implementation: str | None = None
) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None]:
  """`quantize_blockwise(jnp.concatenate(parts, axis=1), (1, 128), ...)`
  without writing the concatenation: the Pallas path reads each tile from
  its part (of a fused projection's gradient: the parts come from
  different producers). It needs every part but the last a multiple of 128
  wide (so no tile straddles two parts); otherwise the parts are joined.

  Args:
    parts: 2-D (rows, n_i) floating arrays, same rows and dtype.
    dtype, transpose, pow2_scales, transpose_block, implementation: as
      `quantize_blockwise` with block (1, 128).

  Returns:
    As `quantize_blockwise` of the (rows, sum n_i) concatenation.
  """
  parts = _common.check_parts(parts)
  transpose_block = check_block(transpose_block)
  dt = _common.fp8_dtype(dtype)
  impl, interpret = dispatch.resolve_implementation(
      'quantize_blockwise', implementation)
  if impl == 'pallas' and all(x.size for x in parts):
    widths = tuple(x.shape[1] for x in parts)
    if _runs_mosaic(widths, parts[0].shape[0], parts[0].dtype, transpose,
                    interpret):
      return _mosaic_kernel().quantize_blockwise_parts(
          tuple(parts), dt, pow2=bool(pow2_scales),
          transpose_block=transpose_block)
    from pallas_kernels.quantize_blockwise import pallas_triton
    if pallas_triton.parts_tile_cols(widths):
      return pallas_triton.quantize_blockwise_parts(
          parts, dt, transpose=transpose, pow2=bool(pow2_scales),
          transpose_block=transpose_block, interpret=interpret)
  return reference.quantize_blockwise_parts(
      parts, dt, transpose=transpose, pow2=bool(pow2_scales),
      transpose_block=transpose_block)
