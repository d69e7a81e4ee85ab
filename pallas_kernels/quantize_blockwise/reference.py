"""Block-scaled FP8 quantization (1x128 tiles, 128x128 blocks): reference.

The pure-jnp numerics (the 'xla' path and the oracle of the Pallas kernel);
`coat_jax.quant.quantize_blockwise` builds its `QuantizedArray`s on them.

Layouts, for a 2-D view x (M, K) (the last axis kept):
  tiles: 1x128 tiles along K; scales (M, ceil(K / 128)). With `transpose`,
    also x^T (K, M) in 1x128 tiles along M, scales (K, ceil(M / 128)): the
    operand of the weight-gradient GEMM, whose K is the token axis; or, with
    `transpose_block=(128, 128)`, x^T in 128x128 blocks, scales
    (ceil(K / 128), ceil(M / 128)).
  blocks: 128x128 blocks; scales (ceil(M / 128), ceil(K / 128)). One scale
    serves a block of W and the same block of W^T.

Per tile or block, with amax = max |x|: scale = amax / fp8_max (float32),
or with `pow2` the power of two 2^ceil(log2(amax / fp8_max)) (division and
rescaling by it are exact); values = saturate(x / scale). Partial tiles at
the edges are zero-padded (zeros change no amax): scales use ceil. An
all-zero tile gets scale 1; a tile holding NaN or Inf gets a NaN scale (and
dequantizes to NaN), the others are untouched. Float32 tiles along the last
axis are exactly `quantize_per_group(x, 128)` (linear): the same group math
(`group_reference.encode_groups`), hence the same bits.
"""

import math
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp

from pallas_kernels import _common
from pallas_kernels.quantize_per_group import reference as group_reference
from pallas_kernels.quantize_per_tensor import reference as tensor_reference

TILE = 128
BLOCKS = ((1, TILE), (TILE, TILE))


def _code_exponent(dtype: Any) -> int:
  """e_max such that fp8_max = 1.75 * 2^e_max (8 for E4M3, 15 for E5M2)."""
  e_max = math.log2(_common.fp8_max(dtype) / 1.75)
  assert e_max == int(e_max), dtype
  return int(e_max)


def pow2_scale(amax: jax.Array, dtype: Any) -> jax.Array:
  """2^ceil(log2(amax / fp8_max)) for float32 amax >= 0 (or NaN), exactly.

  From the bits of amax = m 2^e (m in [1, 2)): amax <= 1.75 2^(e_max + s)
  gives s = e - e_max, or s + 1 when m > 1.75. The exponent is clipped to
  float32's normal range; amax == 0 gives 1, NaN or Inf gives NaN.
  Integer ops only, so XLA and Triton agree bit for bit.
  """
  bits = lax.bitcast_convert_type(amax, jnp.int32)
  biased = lax.shift_right_logical(bits, 23) & 0xFF
  bump = ((bits & 0x7FFFFF) > 0x600000).astype(jnp.int32)  # m > 1.75
  biased = biased - _code_exponent(dtype) + bump
  biased = jnp.where(biased < 1, 1, jnp.where(biased > 254, 254, biased))
  scale = lax.bitcast_convert_type(lax.shift_left(biased, 23), jnp.float32)
  scale = jnp.where(amax > 0, scale, 0.0)
  return group_reference.store_scale(scale, amax, jnp.float32)


def scale_from_amax(amax: jax.Array, dtype: Any, pow2: bool) -> jax.Array:
  """The float32 scale of a tile whose max |x| is `amax` (see module doc)."""
  if pow2:
    return pow2_scale(amax, dtype)
  return tensor_reference.scale_from_amax(amax, dtype, jnp.float32)


def encode_tiles(
    groups: jax.Array, dtype: Any, pow2: bool,
    ops: _common.Ops = _common.XLA_OPS
) -> tuple[jax.Array, jax.Array]:
  """float32 tiles (..., 128) -> (values (..., 128) FP8, scales (...)).

  Without pow2 this is `group_reference.encode_groups` itself (linear,
  float32 scales). The Pallas kernel runs this same function on its tiles.
  """
  if not pow2:
    values, scale, _ = group_reference.encode_groups(
        groups, dtype, False, jnp.float32, ops)
    return values, scale
  amax = _common.abs_max(jnp.abs(groups), -1)
  scale = pow2_scale(amax, dtype)
  return _common.saturate(ops.div(groups, scale[..., None]), dtype, ops), scale


def quantize_rows(
    x2: jax.Array, dtype: Any, pow2: bool,
    ops: _common.Ops = _common.XLA_OPS
) -> tuple[jax.Array, jax.Array]:
  """float32 (M, K) in 1x128 tiles along K: (values (M, K), scales (M, KB))."""
  groups = group_reference.to_groups(x2, TILE)  # (M, KB, 128)
  values, scale = encode_tiles(groups, dtype, pow2, ops)
  return group_reference.from_groups(values, x2.shape), scale


def _pad_to_tiles(x2: jax.Array) -> jax.Array:
  m, k = x2.shape
  return jnp.pad(x2, ((0, -m % TILE), (0, -k % TILE)))


def quantize_blocks_2d(
    x2: jax.Array, dtype: Any, pow2: bool,
    ops: _common.Ops = _common.XLA_OPS
) -> tuple[jax.Array, jax.Array]:
  """float32 (M, K) in 128x128 blocks: (values (M, K), scales (MB, KB))."""
  m, k = x2.shape
  xp = _pad_to_tiles(x2)
  mb, kb = xp.shape[0] // TILE, xp.shape[1] // TILE
  spec = tuple(jax.typeof(xp).sharding.spec) + (None, None)
  blocks = _reshape(xp, (mb, TILE, kb, TILE),
                    (spec[0], None, spec[1], None))
  amax = _common.abs_max(jnp.abs(blocks), (1, 3))
  scale = scale_from_amax(amax, dtype, pow2)
  values = _common.saturate(
      ops.div(blocks, scale[:, None, :, None]), dtype, ops)
  return _reshape(values, xp.shape, spec[:2])[:m, :k], scale


def _reshape(x: jax.Array, shape: tuple[int, ...], spec: tuple) -> jax.Array:
  """x.reshape(shape), spelling out the sharding (`spec`) that explicit
  sharding needs (a sharded axis stays on the leading factor of its split)."""
  if any(s is not None for s in tuple(jax.typeof(x).sharding.spec)):
    return lax.reshape(x, shape,
                       out_sharding=jax.sharding.PartitionSpec(*spec))
  return x.reshape(shape)


def as_matrix(x: jax.Array) -> jax.Array:
  """The float32 2-D view (prod(shape[:-1]), shape[-1]) (() -> (1, 1))."""
  x = jnp.asarray(x).astype(jnp.float32)
  return x.reshape(_common.as_2d(x.shape))


def quantize_blockwise(
    x: jax.Array, block: tuple[int, int] = (1, TILE), dtype: Any = 'e4m3',
    *, transpose: bool = False, pow2: bool = False,
    transpose_block: tuple[int, int] = (1, TILE)
) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None]:
  """Quantizes `x` in 1x128 tiles or 128x128 blocks (see module doc).

  Args:
    x: floating array; tiles: any shape, as its 2-D view (M, K) =
      (prod(shape[:-1]), shape[-1]); blocks: 2-D (M, K).
    block: (1, 128) or (128, 128).
    dtype: 'e4m3' or 'e5m2'.
    transpose: tiles only: also the transposed 2-D view (K, M) in 1x128
      tiles along M.
    pow2: power-of-two scales.
    transpose_block: (1, 128), or (128, 128) for the transposed view in
      128x128 blocks.

  Returns:
    (values x.shape FP8, scales float32 (M, KB) for tiles (x.shape[:-1] +
    (KB,) for an n-D x) or (MB, KB) for blocks, values_t (K, M) FP8 or None,
    scales_t (K, MB) float32 ((KB, MB) with 128x128 transpose_block) or
    None).
  """
  dt = _common.fp8_dtype(dtype)
  shape = jnp.shape(x)
  x2 = as_matrix(x)
  if tuple(block) == (TILE, TILE):
    values, scales = quantize_blocks_2d(x2, dt, pow2)
    return values.reshape(shape), scales, None, None
  values, scales = quantize_rows(x2, dt, pow2)
  values = values.reshape(shape)
  scales = scales.reshape(group_reference.scale_shape(shape, TILE))
  if not transpose:
    return values, scales, None, None
  if tuple(transpose_block) == (TILE, TILE):
    values_t, scales_t = quantize_blocks_2d(x2.T, dt, pow2)
  else:
    values_t, scales_t = quantize_rows(x2.T, dt, pow2)
  return values, scales, values_t, scales_t


def quantize_blockwise_parts(
    parts, dtype: Any = 'e4m3', *, transpose: bool = False,
    pow2: bool = False, transpose_block: tuple[int, int] = (1, TILE)
) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None]:
  """`quantize_blockwise` in 1x128 tiles of the 2-D `parts` side by side
  (rows, sum n_i): the same four results as of their concatenation."""
  return quantize_blockwise(jnp.concatenate(parts, axis=1), (1, TILE),
                            dtype, transpose=transpose, pow2=pow2,
                            transpose_block=transpose_block)


def dequantize_blocks(
    values: jax.Array, scales: jax.Array, *, out_dtype: Any = jnp.float32
) -> jax.Array:
  """Inverse of the 128x128 block quantizer: values (M, K) * their block's
  scale, as out_dtype."""
  m, k = values.shape
  vp = _pad_to_tiles(values.astype(jnp.float32))
  mb, kb = vp.shape[0] // TILE, vp.shape[1] // TILE
  spec = tuple(jax.typeof(vp).sharding.spec) + (None, None)
  blocks = _reshape(vp, (mb, TILE, kb, TILE), (spec[0], None, spec[1], None))
  out = blocks * scales.astype(jnp.float32)[:, None, :, None]
  return _reshape(out, vp.shape, spec[:2])[:m, :k].astype(out_dtype)
