"""Per-group FP8 quantize / dequantize along the last axis: public entry."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _common
from pallas_kernels import dispatch
from pallas_kernels.quantize_per_group import reference


def _check(group_size: Any, scale_dtype: Any,
           expansion: bool = False) -> tuple[int, np.dtype]:
  if (isinstance(group_size, bool)
      or not isinstance(group_size, int | np.integer) or group_size <= 0):
    raise ValueError(
        f'group_size={group_size!r} must be a positive integer, e.g. 128 for'
        ' optimizer states or 16 for activations.')
  sd = reference.check_scale_dtype(scale_dtype, expansion)
  return int(group_size), sd


def _pallas_ok(group_size: int) -> bool:
  # Tiles hold whole groups and Triton tiles are powers of two.
  return group_size >= 2 and group_size & (group_size - 1) == 0


def quantize_per_group(
    x: jax.Array, group_size: int = 128, dtype: Any = 'e4m3',
    expansion: bool = False, *, scale_dtype: Any = jnp.float32,
    implementation: str | None = None
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """Quantizes groups of `group_size` consecutive elements of the last axis.

  See `reference` for the math (linear, or COAT's dynamic range expansion).

  Args:
    x: floating array of any shape.
    group_size: positive int (the Pallas path needs a power of two and falls
      back to XLA otherwise).
    dtype: 'e4m3' or 'e5m2'.
    expansion: use dynamic range expansion.
    scale_dtype: float32, bfloat16 or float8_e8m0fnu (power-of-two scales,
      without expansion).
    implementation: None (fastest available), 'xla' or 'pallas'.

  Returns:
    (values: x.shape FP8, scale: x.shape[:-1] + (ceil(n / g),),
    exponent: float32 like scale, or None without expansion).
  """
  group_size, sd = _check(group_size, scale_dtype, expansion)
  dt = _common.fp8_dtype(dtype)
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f'x has dtype {x.dtype}; quantization needs a floating'
                    ' array (cast with x.astype(jnp.float32)).')
  impl, interpret = dispatch.resolve_implementation(
      'quantize_per_group', implementation)
  if impl == 'pallas' and _pallas_ok(group_size):
    from pallas_kernels.quantize_per_group import pallas_triton
    kernel = lambda x: pallas_triton.quantize_per_group(
        x, group_size, dt, expansion, scale_dtype=sd, interpret=interpret)
    # In parts where `_common.offsets_overflow`.
    return _common.in_leading_parts(
        lambda _, x: (kernel(x), ()), (), x,
        out_shapes=jax.eval_shape(kernel, x))[0]
  return reference.quantize_per_group(
      x, group_size, dt, expansion, scale_dtype=sd)


def dequantize_per_group(
    values: jax.Array, scale: jax.Array, exponent: jax.Array | None,
    group_size: int, *, out_dtype: Any = jnp.float32,
    implementation: str | None = None
) -> jax.Array:
  """Inverse of `quantize_per_group`.

  Args:
    values: FP8 codes of any shape.
    scale: values.shape[:-1] + (ceil(n / g),), float32, bfloat16 or
      float8_e8m0fnu.
    exponent: like scale, float32, or None for linear quantization.
    group_size: the group size used to quantize.
    out_dtype: floating dtype of the result.
    implementation: None (fastest available), 'xla' or 'pallas'.

  Returns:
    Array of values.shape and out_dtype.
  """
  group_size, _ = _check(group_size, jnp.float32)
  _common.fp8_dtype(values.dtype, 'values.dtype')
  expected = reference.scale_shape(values.shape, group_size)
  if scale.shape != expected or (
      exponent is not None and exponent.shape != expected):
    raise ValueError(
        f'scale {scale.shape} (and exponent) must have shape {expected} for'
        f' values {values.shape} and group_size={group_size}.')
  impl, interpret = dispatch.resolve_implementation(
      'dequantize_per_group', implementation)
  if impl == 'pallas' and _pallas_ok(group_size):
    from pallas_kernels.quantize_per_group import pallas_triton
    kernel = lambda q: pallas_triton.dequantize_per_group(
        *q, group_size, out_dtype=np.dtype(out_dtype), interpret=interpret)
    # In parts where `_common.offsets_overflow`.
    return _common.in_leading_parts(
        lambda _, q: (kernel(q), ()), (), (values, scale, exponent),
        out_shapes=jax.ShapeDtypeStruct(values.shape, np.dtype(out_dtype)))[0]
  return reference.dequantize_per_group(
      values, scale, exponent, group_size, out_dtype=out_dtype)
