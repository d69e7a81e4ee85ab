"""Per-group quantize and dequantize as Pallas kernels (Triton lowering).

Each program owns a (block_rows, block_cols) tile of the 2-D view
(rows, cols) of the array (the last axis kept, so groups never straddle a
tile); block_cols is a multiple of the group size. Out-of-range lanes are
masked on load and store and read as zeros, which is exactly the zero padding
of a partial last group in the reference. The group math is
`reference.encode_groups` / `decode_groups` itself.
"""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _common
from pallas_kernels._common import pl
from pallas_kernels._common import pltriton
from pallas_kernels.quantize_per_group import log2_math
from pallas_kernels.quantize_per_group import reference


@dataclasses.dataclass(frozen=True)
class BlockSizes(_common.GroupBlockSizes):
  """Tiles of the per-group quantizers (defaults: the fastest measured by
  benchmarks/kernels.py)."""


def _grid(rows: int, cols: int, br: int, bc: int):
  ncb = pl.cdiv(cols, bc)
  return (pl.cdiv(rows, br) * ncb,), ncb


def _spec(block, ncb):
  return pl.BlockSpec(block, lambda p: (p // ncb, p % ncb))


def kernel_scale_dtype(scale_dtype: Any) -> np.dtype:
  """The dtype in which a kernel stores `scale_dtype` scales: E8M0 as its
  bits (`reference.E8M0_BITS`), others as they are."""
  sd = np.dtype(scale_dtype)
  return reference.E8M0_BITS if sd == reference.E8M0 else sd


def to_kernel_scales(scales: jax.Array) -> jax.Array:
  """Scales as a kernel reads them (E8M0 bitcast to its bytes)."""
  if scales.dtype == reference.E8M0:
    return jax.lax.bitcast_convert_type(scales, reference.E8M0_BITS)
  return scales


def from_kernel_scales(scales: jax.Array, scale_dtype: Any) -> jax.Array:
  """A kernel's stored scales as `scale_dtype` (E8M0 bytes bitcast back)."""
  if np.dtype(scale_dtype) == reference.E8M0:
    return jax.lax.bitcast_convert_type(scales, reference.E8M0)
  return scales


def _load_scale(ref, gmask):
  """A tile of scales, 1 where `gmask` is False: float32, or E8M0 bytes
  (decoded by `reference.scale_as_float32` in the group math)."""
  if ref.dtype != reference.E8M0_BITS:
    return _common.masked_load(ref, gmask, 1.0)
  bits = pltriton.load(ref, mask=gmask)
  return bits if gmask is None else jnp.where(gmask, bits, np.uint8(127))


def load_groups(q_refs, mask, gmask, group_size, dtype, ops):
  """A tile's FP8 codes and metadata from (values, scale[, exponent]) refs,
  decoded: float32 (br, bc). Lanes outside `mask` hold codes 0. With
  `ops.log2` set and expansion, `log2_math`'s formulation."""
  br, bc = q_refs[0].shape
  codes = _common.masked_load(q_refs[0], mask, 0.0)
  scale = _load_scale(q_refs[1], gmask)
  exponent = (_common.masked_load(q_refs[2], gmask, 1.0)
              if len(q_refs) == 3 else None)
  groups = codes.reshape(br, bc // group_size, group_size)
  if exponent is not None and ops.log2 is not None:
    out = log2_math.decode_groups(groups, scale, exponent, dtype, ops)
  else:
    out = reference.decode_groups(groups, scale, exponent, dtype, ops)
  return out.reshape(br, bc)


def store_groups(x, q_refs, mask, gmask, group_size, dtype, expansion,
                 scale_dtype, ops):
  """Quantizes a float32 tile (br, bc) whose lanes outside `mask` are 0 and
  stores values, scale (and exponent) to `q_refs` (`log2_math`'s
  formulation with `ops.log2` set and expansion)."""
  br, bc = x.shape
  groups = x.reshape(br, bc // group_size, group_size)
  if expansion and ops.log2 is not None:
    values, scale, exponent = log2_math.encode_groups(
        groups, dtype, scale_dtype, ops)
  else:
    values, scale, exponent = reference.encode_groups(
        groups, dtype, expansion, scale_dtype, ops)
  pltriton.store(q_refs[0], values.reshape(br, bc), mask=mask)
  pltriton.store(q_refs[1], scale, mask=gmask)
  if expansion:
    pltriton.store(q_refs[2], exponent, mask=gmask)


def _quantize_kernel(x_ref, *out_refs, rows, cols, ncb, group_size, dtype,
                     expansion, scale_dtype, ops):
  _, mask, gmask = _common.group_tile(
      x_ref.shape, ncb, rows, cols, group_size)
  x = _common.masked_load(x_ref, mask, 0.0)
  store_groups(x, out_refs, mask, gmask, group_size, dtype, expansion,
               scale_dtype, ops)


@functools.partial(
    jax.jit,
    static_argnames=('group_size', 'dtype', 'expansion', 'scale_dtype',
                     'block_sizes', 'interpret'))
def quantize_per_group(
    x: jax.Array, group_size: int = 128, dtype: Any = 'e4m3',
    expansion: bool = False, *, scale_dtype: Any = jnp.float32,
    block_sizes: BlockSizes = BlockSizes(), interpret: bool = False
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """Pallas version of `reference.quantize_per_group` (same contract)."""
  dt = _common.fp8_dtype(dtype)
  shape = x.shape
  rows, cols = _common.as_2d(shape)
  br, bc = block_sizes.resolve(rows, cols, group_size)
  ng_total = pl.cdiv(cols, group_size)
  grid, ncb = _grid(rows, cols, br, bc)
  ksd = kernel_scale_dtype(scale_dtype)
  out_shape = [
      jax.ShapeDtypeStruct((rows, cols), dt),
      jax.ShapeDtypeStruct((rows, ng_total), ksd),
  ]
  out_specs = [_spec((br, bc), ncb), _spec((br, bc // group_size), ncb)]
  if expansion:
    out_shape.append(jax.ShapeDtypeStruct((rows, ng_total), jnp.float32))
    out_specs.append(_spec((br, bc // group_size), ncb))
  kernel = functools.partial(
      _quantize_kernel, rows=rows, cols=cols, ncb=ncb, group_size=group_size,
      dtype=dt, expansion=expansion, scale_dtype=ksd,
      ops=_common.kernel_ops(interpret))
  outs = pl.pallas_call(
      kernel, grid=grid, in_specs=[_spec((br, bc), ncb)],
      out_specs=out_specs, out_shape=out_shape, interpret=interpret,
      compiler_params=_common.compiler_params(block_sizes.num_warps, 1),
      name='quantize_per_group',
  )(x.reshape(rows, cols))
  sshape = reference.scale_shape(shape, group_size)
  values = outs[0].reshape(shape)
  scale = from_kernel_scales(outs[1].reshape(sshape), scale_dtype)
  exponent = outs[2].reshape(sshape) if expansion else None
  return values, scale, exponent


def _dequantize_kernel(*refs, rows, cols, ncb, group_size, dtype, ops):
  *q_refs, o_ref = refs
  _, mask, gmask = _common.group_tile(
      o_ref.shape, ncb, rows, cols, group_size)
  out = load_groups(q_refs, mask, gmask, group_size, dtype, ops)
  pltriton.store(o_ref, out.astype(o_ref.dtype), mask=mask)


@functools.partial(
    jax.jit,
    static_argnames=('group_size', 'out_dtype', 'block_sizes', 'interpret'))
def dequantize_per_group(
    values: jax.Array, scale: jax.Array, exponent: jax.Array | None,
    group_size: int, *, out_dtype: Any = jnp.float32,
    block_sizes: BlockSizes = BlockSizes(), interpret: bool = False
) -> jax.Array:
  """Pallas version of `reference.dequantize_per_group` (same contract)."""
  shape = values.shape
  rows, cols = _common.as_2d(shape)
  br, bc = block_sizes.resolve(rows, cols, group_size)
  ng_total = pl.cdiv(cols, group_size)
  grid, ncb = _grid(rows, cols, br, bc)
  expansion = exponent is not None
  args = [values.reshape(rows, cols),
          to_kernel_scales(scale.reshape(rows, ng_total))]
  in_specs = [_spec((br, bc), ncb), _spec((br, bc // group_size), ncb)]
  if expansion:
    args.append(exponent.reshape(rows, ng_total))
    in_specs.append(_spec((br, bc // group_size), ncb))
  kernel = functools.partial(
      _dequantize_kernel, rows=rows, cols=cols, ncb=ncb,
      group_size=group_size, dtype=values.dtype,
      ops=_common.kernel_ops(interpret))
  out = pl.pallas_call(
      kernel, grid=grid, in_specs=in_specs, out_specs=_spec((br, bc), ncb),
      out_shape=jax.ShapeDtypeStruct((rows, cols), out_dtype),
      interpret=interpret,
      compiler_params=_common.compiler_params(block_sizes.num_warps, 1),
      name='dequantize_per_group',
  )(*args)
  return out.reshape(shape)
