"""Helpers shared by the Pallas Mosaic GPU kernels (Hopper)."""

import functools

import jax.numpy as jnp

from pallas_kernels import _common

try:  # Mosaic GPU is in jax >= 0.6; keep the module importable without it.
  from jax.experimental.mosaic import gpu as mgpu
  from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover
  mgpu = plgpu = None


def smem_transforms(dtype, minor_elems: int):
  """(8, swizzle) tiling + swizzle for a tile whose minor dim is given."""
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = 128
  while (minor_elems * itemsize) % swizzle:
    swizzle //= 2
  if swizzle < 32:
    raise ValueError(f'tile minor dim {minor_elems} too small to swizzle.')
  return (
      plgpu.TilingTransform((8, swizzle // itemsize)),
      plgpu.SwizzleTransform(swizzle),
  )


def div_full(x, y):
  """x / y as XLA's GPU float32 division computes it (PTX div.full.f32), for
  WGMMA-layout arrays.

  Mosaic's own division is correctly rounded (div.rn), XLA's is not, and
  the quantizing kernels must round like their XLA references.
  """
  @plgpu.inline_mgpu(
      arg_types=(plgpu.Layout.WGMMA, plgpu.Layout.WGMMA),
      return_type=plgpu.ShapeDtypeStruct(x.shape, x.dtype,
                                         plgpu.Layout.WGMMA))
  def div(_, x, y):
    # pylint: disable-next=protected-access
    return x._pointwise(mgpu.FragmentedArray._lift_fast_instr('div.full.f32'),
                        y)
  return div(x, y)


def saturated_codes(x, den, dtype):
  """saturate(x / den) as FP8 `dtype`, for float32 WGMMA-layout arrays: the
  references' division (`div_full`) and `_common.saturate`'s math, clipped
  with selects, which keep NaN."""
  fmax = _common.fp8_max(dtype)
  return _common.clip(div_full(x, den), -fmax, fmax).astype(dtype)


def load(ref, layout, optimized=True):
  """plgpu.load of a whole ref; jax 0.10 wants the index as an argument.
  optimized=False for GMEM refs."""
  try:
    return plgpu.load(ref, layout=layout, optimized=optimized)
  except TypeError:  # jax < 0.11: `idx` is positional and required.
    return plgpu.load(ref, None, layout=layout, optimized=optimized)


def named(name: str, body, **kwargs):
  """functools.partial(body, **kwargs) named `name` for plgpu.kernel, which
  names the kernel after its body (a bare partial is "anonymous"): profiles
  then show `<name>_mosaic_gpu_kernel`."""
  kernel_body = functools.partial(body, **kwargs)
  kernel_body.__name__ = name
  return kernel_body
