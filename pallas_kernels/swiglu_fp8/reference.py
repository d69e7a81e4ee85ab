"""FP8 SwiGLU (COAT): the pure-jnp reference of the forward and backward.

The math of `coat_jax.nn.mlp.fp8_swiglu`, unchanged (it is the
specification of the kernels): h = silu(gate) * up in float32, cast to
gate.dtype; gate and up are saved as 1x16 E4M3 groups (bfloat16 scales) and
silu is recomputed in backward. Besides, each pass returns the max |.| of
its outputs (float32; NaN if they hold NaN): the per-tensor scales of the
FP8 GEMMs that read them (h: the down projection; dgate, dup: the gate and
up projections' output gradients), so that their quantizers need no amax
pass of their own.
"""

from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import _common
from pallas_kernels.quantize_per_group import reference as group_reference

GROUP_SIZE = 16
FP8 = 'e4m3'

Groups = tuple[jax.Array, jax.Array]  # (codes float8_e4m3fn, scales)


def swiglu_fp8_fwd(
    gate: jax.Array, up: jax.Array, *, group_size: int = GROUP_SIZE,
    scale_dtype: Any = jnp.bfloat16
) -> tuple[jax.Array, Groups, Groups, jax.Array]:
  """silu(gate) * up and the FP8 groups of gate and up.

  Args:
    gate, up: (..., I) floating, same shape and dtype.
    group_size: elements per group of the E4M3 copies.
    scale_dtype: dtype of the group scales.

  Returns:
    (h (..., I) gate.dtype, (gate codes (..., I), gate scales (...,
    ceil(I / group_size))), (up codes, up scales), amax |h| () float32).
  """
  g = gate.astype(jnp.float32)
  h = (g * jax.nn.sigmoid(g) * up.astype(jnp.float32)).astype(gate.dtype)
  quantize = lambda x: group_reference.quantize_per_group(
      x, group_size, FP8, scale_dtype=scale_dtype)[:2]
  return h, quantize(gate), quantize(up), _common.tensor_abs_max(h)


def swiglu_fp8_bwd(
    gate_groups: Groups, up_groups: Groups, dh: jax.Array, *,
    group_size: int = GROUP_SIZE
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Gradients of `swiglu_fp8_fwd`'s h from the saved groups.

  Args:
    gate_groups, up_groups: (codes, scales) from the forward pass.
    dh: (..., I) gradient of h.
    group_size: the forward pass's group size.

  Returns:
    (dgate (..., I) dh.dtype, dup (..., I) dh.dtype, amax |dgate| () float32,
    amax |dup| () float32).
  """
  g = group_reference.dequantize_per_group(*gate_groups, None, group_size)
  u = group_reference.dequantize_per_group(*up_groups, None, group_size)
  s = jax.nn.sigmoid(g)
  dhf = dh.astype(jnp.float32)
  dup = dhf * g * s
  dgate = dhf * u * s * (1.0 + g * (1.0 - s))
  dgate, dup = dgate.astype(dh.dtype), dup.astype(dh.dtype)
  return (dgate, dup, _common.tensor_abs_max(dgate),
          _common.tensor_abs_max(dup))
