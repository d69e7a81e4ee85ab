"""Per-tensor FP8 quantization with a current scale: the pure-jnp reference.

scale = amax(|x|) / fp8_max (1 if x is all zeros; NaN if x holds NaN or Inf,
so the whole tensor dequantizes to NaN); values = saturate(x / scale).
`coat_jax.quant.quantize_per_tensor` builds its `QuantizedArray` on this.
"""

from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import _common
from pallas_kernels.quantize_per_group import reference as group_reference


def tensor_amax(x: jax.Array) -> jax.Array:
  """max |x| as float32 (0 for an empty array)."""
  x = jnp.asarray(x).astype(jnp.float32)
  return jnp.max(jnp.abs(x)) if x.size else jnp.float32(0)


def scale_from_amax(
    amax_: jax.Array, dtype: Any, scale_dtype: Any = jnp.float32
) -> jax.Array:
  """The stored scale for a tensor whose max |x| is `amax_` (shape ())."""
  fmax = _common.fp8_max(dtype)
  return group_reference.store_scale(
      amax_ * group_reference.reciprocal(fmax), amax_, scale_dtype)


def as_matrix(x: jax.Array) -> jax.Array:
  """The 2-D view (prod(shape[:-1]), shape[-1]) that a transpose refers to."""
  return x.reshape(_common.as_2d(x.shape))


def quantize_per_tensor(
    x: jax.Array, dtype: Any = 'e4m3', *, scale_dtype: Any = jnp.float32,
    amax: jax.Array | None = None, transpose: bool = False
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """Quantizes `x` with one current scale.

  Args:
    x: floating array of any shape.
    dtype: 'e4m3' or 'e5m2'.
    scale_dtype: float32 or bfloat16; x is divided by the stored scale.
    amax: max |x| if the producer already computed it (COAT's group
      scaling), else None to compute it here.
    transpose: also return the FP8 transpose of the 2-D view
      (prod(shape[:-1]), n), as FP8 matmuls need both K-major layouts.

  Returns:
    (values: x.shape FP8, scale: () scale_dtype, values_t: (n, rows) FP8 or
    None).
  """
  dt = _common.fp8_dtype(dtype)
  x = jnp.asarray(x).astype(jnp.float32)
  amax_ = tensor_amax(x) if amax is None else jnp.asarray(amax, jnp.float32)
  scale = scale_from_amax(amax_, dt, scale_dtype)
  values = _common.saturate(x / scale.astype(jnp.float32), dt)
  values_t = as_matrix(values).T if transpose else None
  return values, scale, values_t


def quantize_per_tensor_parts(
    parts, dtype: Any = 'e4m3', *, scale_dtype: Any = jnp.float32,
    amax: jax.Array | None = None, transpose: bool = False
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """`quantize_per_tensor` of the columns of 2-D `parts` side by side:
  (values (rows, sum n_i), one scale, values_t (sum n_i, rows) or None)."""
  return quantize_per_tensor(jnp.concatenate(parts, axis=1), dtype,
                             scale_dtype=scale_dtype, amax=amax,
                             transpose=transpose)
