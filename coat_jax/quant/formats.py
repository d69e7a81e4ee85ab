"""FP8 formats and the saturating cast every quantizer goes through."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FORMATS = {
    'e4m3': np.dtype(jnp.float8_e4m3fn),
    'e5m2': np.dtype(jnp.float8_e5m2),
}
E4M3 = FORMATS['e4m3']
E5M2 = FORMATS['e5m2']


def fp8_dtype(dtype: Any, argname: str = 'dtype') -> np.dtype:
  """Returns the numpy dtype of an FP8 format given by name or dtype.

  Args:
    dtype: 'e4m3' (float8_e4m3fn, max 448) or 'e5m2' (float8_e5m2, max
      57344), or one of those dtypes.
    argname: the caller's argument name, for the error message.

  Raises:
    ValueError: for anything else.
  """
  if isinstance(dtype, str) and dtype in FORMATS:
    return FORMATS[dtype]
  try:
    dt = np.dtype(dtype)
  except TypeError:
    dt = None
  if dt is not None and dt in FORMATS.values():
    return dt
  raise ValueError(
      f'{argname}={dtype!r} is not an FP8 format: use one of'
      f' {sorted(FORMATS)} (or jnp.float8_e4m3fn / jnp.float8_e5m2).')


def fp8_max(dtype: Any) -> float:
  """Largest finite value of an FP8 format (448 for E4M3, 57344 for E5M2)."""
  return float(jnp.finfo(fp8_dtype(dtype)).max)


def saturating_cast(x: jax.Array, dtype: Any) -> jax.Array:
  """Casts to FP8 with saturation: clips to +-max, then rounds to nearest even.

  XLA's and ml_dtypes' casts do not saturate (465 -> NaN in E4M3), so every
  quantizer in this package casts through here. NaN stays NaN; +-Inf becomes
  +-max.
  """
  dt = fp8_dtype(dtype)
  m = fp8_max(dt)
  return jnp.clip(x, -m, m).astype(dt)
