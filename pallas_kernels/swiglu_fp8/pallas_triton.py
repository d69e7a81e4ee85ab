"""FP8 SwiGLU forward and backward as one-pass Pallas kernels (Triton).

Elementwise over (block_rows, block_cols) tiles of the 2-D view (M, I), as
the per-group quantizer tiles it (groups never straddle a tile; lanes
outside the view read as zeros, the reference's zero padding). Forward: one
read of gate and up writes h, both 1x16 group copies and one max |h| per
program; backward: one read of the groups and dh writes dgate, dup and one
max of each per program (the maxima are reduced in XLA).
"""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import _common
from pallas_kernels._common import pl
from pallas_kernels._common import pltriton
from pallas_kernels.quantize_per_group.pallas_triton import from_kernel_scales
from pallas_kernels.quantize_per_group.pallas_triton import kernel_scale_dtype
from pallas_kernels.quantize_per_group.pallas_triton import load_groups
from pallas_kernels.quantize_per_group.pallas_triton import store_groups
from pallas_kernels.quantize_per_group.pallas_triton import to_kernel_scales
from pallas_kernels.swiglu_fp8 import reference


@dataclasses.dataclass(frozen=True)
class BlockSizes(_common.GroupBlockSizes):
  """Tiles of the SwiGLU kernels.

  With block_cols None, the widest power of two up to max_cols that divides
  the columns (and is >= min_cols) is picked, so that the tiles cover the
  view without masks (5632 = 11 x 512, 11008 = 43 x 256).
  """

  min_cols: int = 256

  def resolve(self, rows: int, cols: int, group_size: int) -> tuple[int, int]:
    bc = self.block_cols or self.max_cols
    while self.block_cols is None and bc > self.min_cols and cols % bc:
      bc //= 2
    if self.block_cols is None and (cols % bc or bc < group_size):
      bc = None  # no exact tiling: the default, masked
    return _common.GroupBlockSizes.resolve(
        dataclasses.replace(self, block_cols=bc), rows, cols, group_size)


def _grid(rows, cols, br, bc):
  ncb = pl.cdiv(cols, bc)
  return (pl.cdiv(rows, br) * ncb,), ncb


def _spec(block, ncb):
  return pl.BlockSpec(block, lambda p: (p // ncb, p % ncb))


def _store_amax(ref, x):
  """One max |x| of a float32 tile (lanes outside the view hold 0)."""
  m = _common.abs_max(_common.abs_max(jnp.abs(x), 1), 0)
  ref[...] = jnp.full(ref.shape, m, jnp.float32)


def _fwd_kernel(g_ref, u_ref, h_ref, gc_ref, gs_ref, uc_ref, us_ref, a_ref,
                *, rows, cols, ncb, group_size, scale_dtype, ops):
  _, mask, gmask = _common.group_tile(
      g_ref.shape, ncb, rows, cols, group_size)
  g = _common.masked_load(g_ref, mask, 0.0)
  u = _common.masked_load(u_ref, mask, 0.0)
  h = (g * jax.nn.sigmoid(g) * u).astype(h_ref.dtype)
  pltriton.store(h_ref, h, mask=mask)
  for x, refs in ((g, (gc_ref, gs_ref)), (u, (uc_ref, us_ref))):
    store_groups(x, refs, mask, gmask, group_size, reference.FP8, False,
                 scale_dtype, ops)
  _store_amax(a_ref, h.astype(jnp.float32))


@functools.partial(
    jax.jit, static_argnames=('group_size', 'scale_dtype', 'block_sizes',
                              'interpret'))
def swiglu_fp8_fwd(
    gate: jax.Array, up: jax.Array, *,
    group_size: int = reference.GROUP_SIZE, scale_dtype: Any = jnp.bfloat16,
    block_sizes: BlockSizes = BlockSizes(), interpret: bool = False
) -> tuple[jax.Array, reference.Groups, reference.Groups, jax.Array]:
  """Pallas version of `reference.swiglu_fp8_fwd` (same contract)."""
  shape = gate.shape
  rows, cols = _common.as_2d(shape)
  br, bc = block_sizes.resolve(rows, cols, group_size)
  ng = pl.cdiv(cols, group_size)
  grid, ncb = _grid(rows, cols, br, bc)
  tile, gtile = _spec((br, bc), ncb), _spec((br, bc // group_size), ncb)
  codes = jax.ShapeDtypeStruct((rows, cols), jnp.float8_e4m3fn)
  ksd = kernel_scale_dtype(scale_dtype)
  scales = jax.ShapeDtypeStruct((rows, ng), ksd)
  kernel = functools.partial(
      _fwd_kernel, rows=rows, cols=cols, ncb=ncb, group_size=group_size,
      scale_dtype=ksd, ops=_common.kernel_ops(interpret))
  h, gc, gs, uc, us, amax = pl.pallas_call(
      kernel, grid=grid, in_specs=[tile, tile],
      out_specs=[tile, tile, gtile, tile, gtile,
                 pl.BlockSpec((1, 1), lambda p: (p, 0))],
      out_shape=[jax.ShapeDtypeStruct((rows, cols), gate.dtype), codes,
                 scales, codes, scales,
                 jax.ShapeDtypeStruct((grid[0], 1), jnp.float32)],
      interpret=interpret,
      compiler_params=_common.compiler_params(block_sizes.num_warps, 1),
      name='swiglu_fp8_fwd',
  )(gate.reshape(rows, cols), up.reshape(rows, cols))
  sshape = shape[:-1] + (ng,)
  gs, us = (from_kernel_scales(s.reshape(sshape), scale_dtype)
            for s in (gs, us))
  return (h.reshape(shape), (gc.reshape(shape), gs),
          (uc.reshape(shape), us), jnp.max(amax))


def _bwd_kernel(gc_ref, gs_ref, uc_ref, us_ref, dh_ref, dg_ref, du_ref,
                ag_ref, au_ref, *, rows, cols, ncb, group_size, ops):
  _, mask, gmask = _common.group_tile(
      dh_ref.shape, ncb, rows, cols, group_size)
  g = load_groups((gc_ref, gs_ref), mask, gmask, group_size, gc_ref.dtype,
                  ops)
  u = load_groups((uc_ref, us_ref), mask, gmask, group_size, uc_ref.dtype,
                  ops)
  s = jax.nn.sigmoid(g)
  dh = _common.masked_load(dh_ref, mask, 0.0)
  dup = (dh * g * s).astype(du_ref.dtype)
  dgate = (dh * u * s * (1.0 + g * (1.0 - s))).astype(dg_ref.dtype)
  pltriton.store(dg_ref, dgate, mask=mask)
  pltriton.store(du_ref, dup, mask=mask)
  _store_amax(ag_ref, dgate.astype(jnp.float32))
  _store_amax(au_ref, dup.astype(jnp.float32))


@functools.partial(
    jax.jit, static_argnames=('group_size', 'block_sizes', 'interpret'))
def swiglu_fp8_bwd(
    gate_groups: reference.Groups, up_groups: reference.Groups,
    dh: jax.Array, *, group_size: int = reference.GROUP_SIZE,
    block_sizes: BlockSizes = BlockSizes(), interpret: bool = False
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Pallas version of `reference.swiglu_fp8_bwd` (same contract)."""
  shape = dh.shape
  rows, cols = _common.as_2d(shape)
  br, bc = block_sizes.resolve(rows, cols, group_size)
  ng = pl.cdiv(cols, group_size)
  grid, ncb = _grid(rows, cols, br, bc)
  tile, gtile = _spec((br, bc), ncb), _spec((br, bc // group_size), ncb)
  out = jax.ShapeDtypeStruct((rows, cols), dh.dtype)
  amax = jax.ShapeDtypeStruct((grid[0], 1), jnp.float32)
  amax_spec = pl.BlockSpec((1, 1), lambda p: (p, 0))
  kernel = functools.partial(
      _bwd_kernel, rows=rows, cols=cols, ncb=ncb, group_size=group_size,
      ops=_common.kernel_ops(interpret))
  (gc, gs), (uc, us) = gate_groups, up_groups
  dgate, dup, amax_g, amax_u = pl.pallas_call(
      kernel, grid=grid, in_specs=[tile, gtile, tile, gtile, tile],
      out_specs=[tile, tile, amax_spec, amax_spec],
      out_shape=[out, out, amax, amax], interpret=interpret,
      compiler_params=_common.compiler_params(block_sizes.num_warps, 1),
      name='swiglu_fp8_bwd',
  )(gc.reshape(rows, cols), to_kernel_scales(gs.reshape(rows, ng)),
    uc.reshape(rows, cols), to_kernel_scales(us.reshape(rows, ng)),
    dh.reshape(rows, cols))
  return (dgate.reshape(shape), dup.reshape(shape), jnp.max(amax_g),
          jnp.max(amax_u))
