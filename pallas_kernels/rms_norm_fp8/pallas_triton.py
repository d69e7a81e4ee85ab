"""FP8 RMSNorm forward and backward as one-pass Pallas kernels (Triton).

A program owns whole rows of the 2-D view (M, H), padded to the next power
of two Hp and masked (lanes past H read as zeros, which is the reference's
zero padding of a partial last group). Forward: one read of x writes y, x's
1x16 groups, rstd and one max |y| per program (reduced in XLA). Backward:
a program walks `steps` blocks of `block_rows` rows, writes dx and
accumulates its partial dscale (one float32 row per program, summed in XLA:
deterministic, unlike atomics) and its max |dx| (of dx as rounded); a
residual stream's gradient, if given, is added to dx in float32 before dx
is rounded. The group math is the per-group quantizer's own
(`store_groups`, `load_groups`).
"""

import dataclasses
import functools
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _common
from pallas_kernels._common import pl
from pallas_kernels._common import pltriton
from pallas_kernels.quantize_per_group.pallas_triton import from_kernel_scales
from pallas_kernels.quantize_per_group.pallas_triton import kernel_scale_dtype
from pallas_kernels.quantize_per_group.pallas_triton import load_groups
from pallas_kernels.quantize_per_group.pallas_triton import store_groups
from pallas_kernels.quantize_per_group.pallas_triton import to_kernel_scales
from pallas_kernels.rms_norm_fp8 import reference


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Row tiling: a program holds (block_rows, Hp) at a time.

  Attributes:
    block_rows: rows per block (a power of two); None: target // Hp.
    steps: blocks per program (backward only: amortizes the partial dscale
      row each program writes).
    num_warps: warps per program; None picks from the block size.
    target: elements per block when block_rows is None.
  """

  block_rows: int | None = None
  steps: int = 8
  num_warps: int | None = None
  target: int = 4096

  def resolve(self, rows: int, cols: int) -> tuple[int, int, int, int]:
    """(block_rows, Hp, steps, num_warps) for a (rows, cols) view."""
    hp = _common.next_pow2(cols)
    br = self.block_rows or min(_common.next_pow2(rows),
                                max(1, self.target // hp))
    if br & (br - 1) or self.steps < 1:
      raise ValueError(f'block_rows={br} must be a power of two and'
                       f' steps={self.steps} positive.')
    steps = min(self.steps, pl.cdiv(rows, br))
    warps = self.num_warps or (4 if br * hp <= 2048 else
                               8 if br * hp <= 8192 else 16)
    return br, hp, steps, warps


def _masks(row0, br, hp, rows, cols, group_size, exact):
  """(element, group, row) masks of the (br, hp) block at row0; all None
  when the programs' blocks tile the view `exact`ly."""
  if exact:
    return None, None, None
  r = row0 + lax.broadcasted_iota(jnp.int32, (br, 1), 0)
  rmask = r < rows
  c = lax.broadcasted_iota(jnp.int32, (1, hp), 1)
  gc = lax.broadcasted_iota(jnp.int32, (1, hp // group_size), 1)
  return (rmask & (c < cols), rmask & (gc < pl.cdiv(cols, group_size)),
          rmask)


def _col_mask(hp, cols):
  if cols == hp:
    return None
  return lax.broadcasted_iota(jnp.int32, (1, hp), 1) < cols


def _fwd_kernel(x_ref, s_ref, y_ref, c_ref, xs_ref, r_ref, a_ref, *, rows,
                cols, eps, group_size, scale_dtype, ops):
  br, hp = x_ref.shape
  mask, gmask, rmask = _masks(pl.program_id(0) * br, br, hp, rows, cols,
                              group_size, rows % br == 0 and cols == hp)
  x = _common.masked_load(x_ref, mask, 0.0)
  scale = _common.masked_load(s_ref, _col_mask(hp, cols), 0.0)
  rstd = lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) / np.float32(cols)
                   + eps)
  y = (x * rstd * scale).astype(y_ref.dtype)
  pltriton.store(y_ref, y, mask=mask)
  pltriton.store(r_ref, rstd, mask=rmask)
  store_groups(x, (c_ref, xs_ref), mask, gmask, group_size, reference.FP8,
               False, scale_dtype, ops)
  absy = jnp.abs(y.astype(jnp.float32))
  if mask is not None:  # padded rows: rsqrt(eps) * 0, NaN when eps == 0
    absy = jnp.where(mask, absy, 0.0)
  a_ref[...] = jnp.full(a_ref.shape, _common.abs_max(
      _common.abs_max(absy, 1), 0), jnp.float32)


@functools.partial(
    jax.jit, static_argnames=('eps', 'group_size', 'scale_dtype',
                              'block_sizes', 'interpret'))
def rms_norm_fp8_fwd(
    x: jax.Array, scale: jax.Array, eps: float, *,
    group_size: int = reference.GROUP_SIZE, scale_dtype: Any = jnp.bfloat16,
    block_sizes: BlockSizes = BlockSizes(), interpret: bool = False
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
  """Pallas version of `reference.rms_norm_fp8_fwd` (same contract)."""
  shape = x.shape
  rows, cols = _common.as_2d(shape)
  br, hp, _, warps = block_sizes.resolve(rows, cols)
  ng = pl.cdiv(cols, group_size)
  nprog = pl.cdiv(rows, br)
  row_block = lambda w: pl.BlockSpec((br, w), lambda i: (i, 0))
  ksd = kernel_scale_dtype(scale_dtype)
  out_shape = [
      jax.ShapeDtypeStruct((rows, cols), x.dtype),
      jax.ShapeDtypeStruct((rows, cols), jnp.float8_e4m3fn),
      jax.ShapeDtypeStruct((rows, ng), ksd),
      jax.ShapeDtypeStruct((rows, 1), jnp.float32),
      jax.ShapeDtypeStruct((nprog, 1), jnp.float32),
  ]
  out_specs = [row_block(hp), row_block(hp), row_block(hp // group_size),
               row_block(1), pl.BlockSpec((1, 1), lambda i: (i, 0))]
  kernel = functools.partial(
      _fwd_kernel, rows=rows, cols=cols, eps=eps, group_size=group_size,
      scale_dtype=ksd, ops=_common.kernel_ops(interpret))
  y, codes, scales, rstd, amax = pl.pallas_call(
      kernel, grid=(nprog,),
      in_specs=[row_block(hp), pl.BlockSpec((1, hp), lambda i: (0, 0))],
      out_specs=out_specs, out_shape=out_shape, interpret=interpret,
      compiler_params=_common.compiler_params(warps, 1),
      name='rms_norm_fp8_fwd',
  )(x.reshape(rows, cols), scale.astype(jnp.float32).reshape(1, cols))
  lead = shape[:-1]
  return (y.reshape(shape), codes.reshape(shape),
          from_kernel_scales(scales.reshape(lead + (ng,)), scale_dtype),
          rstd.reshape(lead + (1,)),
          jnp.max(amax))  # NaN-propagating in XLA


# About this many backward programs (~4 per SM of a Hopper GPU).
_BWD_PROGRAMS = 512


def bwd_block_sizes(rows: int, cols: int) -> BlockSizes:
  """The backward's default for a (rows, cols) view: 2048-element blocks
  (one row from H = 2048), a warp per 256 elements, and 8 to 32 blocks per
  program, as many as leave ~512 programs (each program's float32 dscale
  row is summed in XLA: fewer programs, fewer rows). Fewer blocks per
  program, or more, were slower (RESULTS.md "One-pass FP8 RMSNorm and
  SwiGLU")."""
  hp = _common.next_pow2(cols)
  block_rows = max(1, 2048 // hp)
  steps = min(32, max(8, rows // (block_rows * _BWD_PROGRAMS)))
  return BlockSizes(block_rows=block_rows, steps=steps,
                    num_warps=min(16, max(4, block_rows * hp // 256)))


def _bwd_kernel(c_ref, xs_ref, r_ref, s_ref, g_ref, *refs, rows, cols,
                block_rows, steps, group_size, ops):
  # refs: (residual_grad, dx, dscale, amax), or (dx, dscale, amax).
  res_ref, (dx_ref, ds_ref, a_ref) = (
      (refs[0], refs[1:]) if len(refs) == 4 else (None, refs))
  br = block_rows
  hp = g_ref.shape[1]
  scale = _common.masked_load(s_ref, _col_mask(hp, cols), 0.0)
  first_row = pl.program_id(0) * br * steps
  exact = rows % (br * steps) == 0 and cols == hp

  def block(k, carry):
    # amax as int32 bits: |dx| orders like its bits (NaN above +inf), and
    # Triton's float max would drop a NaN.
    dscale, amax_bits = carry
    mask, gmask, rmask = _masks(first_row + k * br, br, hp, rows, cols,
                                group_size, exact)
    at = lambda ref, w: ref.at[pl.ds(k * br, br), pl.ds(0, w)]
    x = load_groups((at(c_ref, hp), at(xs_ref, hp // group_size)), mask,
                    gmask, group_size, c_ref.dtype, ops)
    rstd = _common.masked_load(at(r_ref, 1), rmask, 0.0)
    x_hat = x * rstd
    g = _common.masked_load(at(g_ref, hp), mask, 0.0)
    g_hat = g * scale
    mean = jnp.sum(g_hat * x_hat, axis=1, keepdims=True) / np.float32(cols)
    dx = rstd * (g_hat - x_hat * mean)
    if res_ref is not None:
      dx = dx + _common.masked_load(at(res_ref, hp), mask, 0.0)
    dx = dx.astype(dx_ref.dtype)
    pltriton.store(at(dx_ref, hp), dx, mask=mask)
    absdx = jnp.abs(dx.astype(jnp.float32))
    if mask is not None:  # lanes past the view: 0 * a NaN row's mean
      absdx = jnp.where(mask, absdx, 0.0)
    amax = _common.abs_max(_common.abs_max(absdx, 1), 0)
    return (dscale + jnp.sum(g * x_hat, axis=0, keepdims=True),
            jnp.maximum(amax_bits, lax.bitcast_convert_type(amax, jnp.int32)))

  carry = (jnp.zeros((1, hp), jnp.float32), jnp.int32(0))
  if steps == 1:
    dscale, amax_bits = block(0, carry)
  else:
    dscale, amax_bits = lax.fori_loop(0, steps, block, carry)
  pltriton.store(ds_ref, dscale, mask=_col_mask(hp, cols))
  a_ref[...] = jnp.full(a_ref.shape,
                        lax.bitcast_convert_type(amax_bits, jnp.float32))


@functools.partial(
    jax.jit, static_argnames=('group_size', 'block_sizes', 'interpret'))
def rms_norm_fp8_bwd(
    codes: jax.Array, scales: jax.Array, rstd: jax.Array, scale: jax.Array,
    g: jax.Array, *, residual_grad: jax.Array | None = None,
    group_size: int = reference.GROUP_SIZE,
    block_sizes: BlockSizes | None = None, interpret: bool = False
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Pallas version of `reference.rms_norm_fp8_bwd` (same contract);
  block_sizes None: `bwd_block_sizes`."""
  shape = g.shape
  rows, cols = _common.as_2d(shape)
  block_sizes = block_sizes or bwd_block_sizes(rows, cols)
  br, hp, steps, warps = block_sizes.resolve(rows, cols)
  ng = pl.cdiv(cols, group_size)
  nprog = pl.cdiv(rows, br * steps)
  row_block = lambda w: pl.BlockSpec((br * steps, w), lambda i: (i, 0))
  kernel = functools.partial(
      _bwd_kernel, rows=rows, cols=cols, block_rows=br, steps=steps,
      group_size=group_size, ops=_common.kernel_ops(interpret))
  inputs = [codes.reshape(rows, cols),
            to_kernel_scales(scales.reshape(rows, ng)), rstd.reshape(rows, 1),
            scale.astype(jnp.float32).reshape(1, cols), g.reshape(rows, cols)]
  in_specs = [row_block(hp), row_block(hp // group_size), row_block(1),
              pl.BlockSpec((1, hp), lambda i: (0, 0)), row_block(hp)]
  if residual_grad is not None:
    inputs.append(residual_grad.reshape(rows, cols))
    in_specs.append(row_block(hp))
  dx, dscale, amax = pl.pallas_call(
      kernel, grid=(nprog,), in_specs=in_specs,
      out_specs=[row_block(hp), pl.BlockSpec((1, hp), lambda i: (i, 0)),
                 pl.BlockSpec((1, 1), lambda i: (i, 0))],
      out_shape=[jax.ShapeDtypeStruct((rows, cols), g.dtype),
                 jax.ShapeDtypeStruct((nprog, cols), jnp.float32),
                 jax.ShapeDtypeStruct((nprog, 1), jnp.float32)],
      interpret=interpret,
      compiler_params=_common.compiler_params(warps, 1),
      name='rms_norm_fp8_bwd',
  )(*inputs)
  return (dx.reshape(shape), jnp.sum(dscale, axis=0),
          jnp.max(amax))  # NaN-propagating in XLA
