"""Precision modes of the layers, and the constants COAT's numerics fix.

Modes (the same model code; only the layer implementations differ):
  'bf16': BF16 matmuls and plain jnp non-linear layers (autodiff decides
    what is saved): the baseline.
  'fp8_linear': FP8 matmuls whose linear layers save FP8 inputs, BF16
    non-linear layers (as TransformerEngine-JAX does).
  'coat': FP8 matmuls, and RMSNorm and SwiGLU save their inputs as FP8 1x16
    groups (COAT's mixed-granularity precision flow).
"""

import jax.numpy as jnp

PRECISIONS = ('bf16', 'fp8_linear', 'coat')

# Scaling granularity of the FP8 linear layers: 'tensor' (per-tensor current
# scaling, COAT's paper) or 'block' (1x128 tiles, 128x128 weight blocks).
SCALINGS = ('tensor', 'block')

# 1x16 groups along the last (hidden) axis for non-linear layer inputs.
GROUP_SIZE = 16

# Storage dtype of the 1x16 activation scales: one byte, a power of two (MX's
# E8M0), so an FP8g tensor costs 1.0625 bytes/element (bf16 scales: 1.125,
# fp32: 1.25). Measured (H100, 1b, unrolled, no remat): peak 33.5 -> 33.0 GiB
# at batch 16. The scale is rounded up to a power of two, so codes never clip
# and the division and dequantization are exact, but a group's max lands
# anywhere in [fp8_max / 2, fp8_max] rather than on fp8_max: 1.18x the
# relative error of bf16 scales on Gaussian groups (0.026 vs 0.022), which
# moves the 125m gradient's cosine to the bf16 one at E4M3 weights by 2e-4
# or less (0.99642 vs 0.99663, 0.99722 vs 0.99725 on two text batches).
# The Pallas kernels store E8M0 scales as their bytes (bitcast outside).
ACTIVATION_SCALE_DTYPE = jnp.float8_e8m0fnu

# Multiples of 16 are what both the 1x16 groups and the FP8 GEMMs need.
FP8_MULTIPLE = 16


def check_precision(precision: str) -> str:
  """Returns `precision` if it names a mode, else raises ValueError."""
  if precision not in PRECISIONS:
    raise ValueError(
        f'precision={precision!r} is not a precision mode: use one of'
        f' {PRECISIONS}.')
  return precision


def check_scaling(scaling: str) -> str:
  """Returns `scaling` if it names a granularity, else raises ValueError."""
  if scaling not in SCALINGS:
    raise ValueError(
        f'scaling={scaling!r} is not a scaling granularity: use one of'
        f' {SCALINGS}.')
  return scaling


def uses_fp8_matmuls(precision: str) -> bool:
  """Whether linear layers run FP8 matmuls and save FP8 inputs."""
  return check_precision(precision) != 'bf16'


def uses_fp8_activations(precision: str) -> bool:
  """Whether RMSNorm and SwiGLU save their inputs as FP8 1x16 groups."""
  return check_precision(precision) == 'coat'


def check_fp8_size(name: str, size: int, precision: str) -> None:
  """Raises ValueError if `size` cannot be tiled by 16 in an FP8 mode.

  Args:
    name: the argument's name, for the message.
    size: a feature size (hidden, intermediate, projection width).
    precision: the mode; 'bf16' accepts any size.
  """
  if check_precision(precision) == 'bf16' or size % FP8_MULTIPLE == 0:
    return
  raise ValueError(
      f'{name}={size} must be a multiple of {FP8_MULTIPLE} for'
      f' precision={precision!r} (1x{GROUP_SIZE} FP8 groups and FP8 GEMM'
      f' tiles); pad it to {size + (-size) % FP8_MULTIPLE} or use'
      " precision='bf16'.")
