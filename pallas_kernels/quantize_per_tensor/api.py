"""Per-tensor FP8 quantization (+ transposed copy): public entry."""

from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import _common
from pallas_kernels import dispatch
from pallas_kernels.quantize_per_group import reference as group_reference
from pallas_kernels.quantize_per_tensor import reference


def quantize_per_tensor(
    x: jax.Array, dtype: Any = 'e4m3', *, scale_dtype: Any = jnp.float32,
    amax: jax.Array | None = None, transpose: bool = False,
    implementation: str | None = None
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """Quantizes `x` with one current scale, optionally with its FP8 transpose.

  scale = amax / fp8_max (1 for all zeros, NaN if x holds NaN or Inf);
  values = saturate(x / scale), round to nearest even.

  Args:
    x: floating array of any shape.
    dtype: 'e4m3' or 'e5m2'.
    scale_dtype: float32 or bfloat16.
    amax: max |x| if already known (computed by the producer of x: then the
      Pallas path is one pass over x), else None.
    transpose: also return the FP8 transpose of the 2-D view
      (prod(x.shape[:-1]), x.shape[-1]), written in the same pass.
    implementation: None (fastest available), 'xla' or 'pallas'.

  Returns:
    (values: x.shape FP8, scale: () scale_dtype, values_t: (n, rows) FP8 or
    None).
  """
  dt = _common.fp8_dtype(dtype)
  sd = group_reference.check_scale_dtype(scale_dtype)
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f'x has dtype {x.dtype}; quantization needs a floating'
                    ' array (cast with x.astype(jnp.float32)).')
  if amax is not None and jnp.shape(amax) != ():
    raise ValueError(f'amax must be a scalar, got shape {jnp.shape(amax)}.')
  impl, interpret = dispatch.resolve_implementation(
      'quantize_per_tensor', implementation)
  if impl == 'pallas':
    from pallas_kernels.quantize_per_tensor import pallas_triton
    return pallas_triton.quantize_per_tensor(
        x, dt, scale_dtype=sd, amax=amax, transpose=transpose,
        interpret=interpret)
  return reference.quantize_per_tensor(
      x, dt, scale_dtype=sd, amax=amax, transpose=transpose)


def quantize_per_tensor_parts(
    parts, dtype: Any = 'e4m3', *, scale_dtype: Any = jnp.float32,
    amax: jax.Array | None = None, transpose: bool = False,
    implementation: str | None = None
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """`quantize_per_tensor(jnp.concatenate(parts, axis=1), ...)` without
  writing the concatenation: the Pallas path quantizes each part straight
  into its columns of the outputs (of a fused projection's gradient: the
  parts come from different producers).

  Args:
    parts: 2-D (rows, n_i) floating arrays, same rows and dtype.
    dtype, scale_dtype, transpose, implementation: as `quantize_per_tensor`.
    amax: max |x| over all parts if known (e.g. the max of each producer's),
      else None.

  Returns:
    (values (rows, sum n_i) FP8, scale () scale_dtype, values_t (sum n_i,
    rows) FP8 or None).
  """
  parts = _common.check_parts(parts)
  if amax is not None and jnp.shape(amax) != ():
    raise ValueError(f'amax must be a scalar, got shape {jnp.shape(amax)}.')
  dt = _common.fp8_dtype(dtype)
  sd = group_reference.check_scale_dtype(scale_dtype)
  impl, interpret = dispatch.resolve_implementation(
      'quantize_per_tensor', implementation)
  if impl == 'pallas' and all(x.size for x in parts):
    from pallas_kernels.quantize_per_tensor import pallas_triton
    return pallas_triton.quantize_per_tensor_parts(
        parts, dt, scale_dtype=sd, amax=amax, transpose=transpose,
        interpret=interpret)
  return reference.quantize_per_tensor_parts(
      parts, dt, scale_dtype=sd, amax=amax, transpose=transpose)


def tensor_amax(
    x: jax.Array, *, implementation: str | None = None
) -> jax.Array:
  """max |x| as float32 (0 for an empty array): the `amax` that
  `quantize_per_tensor` computes when it is not given one, by the same
  implementation, so passing it back gives the same scale and codes.

  Args:
    x: floating array of any shape.
    implementation: None (fastest available), 'xla' or 'pallas'.
  """
  x = jnp.asarray(x)
  impl, interpret = dispatch.resolve_implementation(
      'quantize_per_tensor', implementation)
  if impl == 'pallas' and x.size:
    from pallas_kernels.quantize_per_tensor import pallas_triton
    return pallas_triton.tensor_amax(x, interpret=interpret)
  return reference.tensor_amax(x)
