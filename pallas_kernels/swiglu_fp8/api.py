"""FP8 SwiGLU forward and backward (COAT's 1x16 residuals): public entry.

`swiglu_fp8_fwd` also returns amax |h| and `swiglu_fp8_bwd` amax |dgate| and
amax |dup| (float32, NaN if the tensor holds NaN): pass them as `amax=` to
the per-tensor quantizers of the GEMMs that read those tensors.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import dispatch
from pallas_kernels.quantize_per_group import reference as group_reference
from pallas_kernels.swiglu_fp8 import reference

Groups = reference.Groups


def _check_group_size(group_size: Any) -> int:
  if (isinstance(group_size, bool)
      or not isinstance(group_size, int | np.integer) or group_size <= 0):
    raise ValueError(f'group_size={group_size!r} must be a positive integer'
                     ' (16 for COAT).')
  return int(group_size)


def _use_pallas(implementation: str | None, group_size: int, size: int):
  impl, interpret = dispatch.resolve_implementation('swiglu_fp8',
                                                    implementation)
  # Tiles hold whole groups and Triton tiles are powers of two; an empty
  # array has no program to run.
  ok = (group_size & (group_size - 1) == 0 and size > 0)
  return impl == 'pallas' and ok, interpret


def swiglu_fp8_fwd(
    gate: jax.Array, up: jax.Array, *,
    group_size: int = reference.GROUP_SIZE, scale_dtype: Any = jnp.bfloat16,
    implementation: str | None = None
) -> tuple[jax.Array, Groups, Groups, jax.Array]:
  """silu(gate) * up, the E4M3 groups of gate and up, and amax |h|.

  Args:
    gate, up: (..., I) bfloat16 or float32, same shape and dtype.
    group_size: elements per group of the E4M3 copies (16 for COAT).
    scale_dtype: float32, bfloat16 or float8_e8m0fnu, the group
      scales' dtype.
    implementation: None (fastest available), 'xla' or 'pallas'.

  Returns:
    (h (..., I) gate.dtype, (gate codes (..., I) float8_e4m3fn, gate scales
    (..., ceil(I / group_size)) scale_dtype), (up codes, up scales),
    amax |h| () float32).
  """
  if gate.shape != up.shape or gate.dtype != up.dtype:
    raise ValueError(f'gate {gate.shape} {gate.dtype} and up {up.shape}'
                     f' {up.dtype} must have the same shape and dtype.')
  if not jnp.issubdtype(gate.dtype, jnp.floating):
    raise TypeError(f'gate has dtype {gate.dtype}; SwiGLU needs floats.')
  group_size = _check_group_size(group_size)
  sd = group_reference.check_scale_dtype(scale_dtype)
  use, interpret = _use_pallas(implementation, group_size, gate.size)
  if use:
    from pallas_kernels.swiglu_fp8 import pallas_triton
    return pallas_triton.swiglu_fp8_fwd(
        gate, up, group_size=group_size, scale_dtype=sd, interpret=interpret)
  return reference.swiglu_fp8_fwd(
      gate, up, group_size=group_size, scale_dtype=sd)


def swiglu_fp8_bwd(
    gate_groups: Groups, up_groups: Groups, dh: jax.Array, *,
    group_size: int = reference.GROUP_SIZE,
    implementation: str | None = None
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """dgate and dup of `swiglu_fp8_fwd` from its saved groups, in one pass.

  Args:
    gate_groups, up_groups: (codes, scales) from `swiglu_fp8_fwd`.
    dh: (..., I) gradient of h.
    group_size: the forward pass's group size.
    implementation: None (fastest available), 'xla' or 'pallas'.

  Returns:
    (dgate (..., I) dh.dtype, dup (..., I) dh.dtype, amax |dgate| () float32,
    amax |dup| () float32).
  """
  if not jnp.issubdtype(dh.dtype, jnp.floating):
    raise TypeError(f'dh has dtype {dh.dtype}; SwiGLU needs floats.')
  group_size = _check_group_size(group_size)
  sshape = dh.shape[:-1] + (-(-dh.shape[-1] // group_size),)
  for name, (codes, scales) in (('gate_groups', gate_groups),
                                ('up_groups', up_groups)):
    if (codes.shape != dh.shape or scales.shape != sshape
        or codes.dtype != np.dtype(jnp.float8_e4m3fn)):
      raise ValueError(
          f'{name} has codes {codes.shape} {codes.dtype} and scales'
          f' {scales.shape}; expected E4M3 codes {dh.shape} and scales'
          f' {sshape} (the forward outputs for dh {dh.shape}).')
  use, interpret = _use_pallas(implementation, group_size, dh.size)
  if use:
    from pallas_kernels.swiglu_fp8 import pallas_triton
    return pallas_triton.swiglu_fp8_bwd(
        gate_groups, up_groups, dh, group_size=group_size,
        interpret=interpret)
  return reference.swiglu_fp8_bwd(
      gate_groups, up_groups, dh, group_size=group_size)
