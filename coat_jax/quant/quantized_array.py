"""`QuantizedArray`: an FP8 payload with its scales, as one pytree."""

import dataclasses
import functools

import jax
import numpy as np


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=['values', 'scale', 'exponent'],
    meta_fields=['group_size', 'block'],
)
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
  """An FP8 tensor with per-tensor or per-group (last axis) scales.

  Attributes:
    values: the FP8 codes, float8_e4m3fn or float8_e5m2, with the shape of the
      original array.
    scale: float32 (or bfloat16). Per-tensor: shape (). Per-group: shape
      `shape[:-1] + (ceil(shape[-1] / group_size),)` (a 0-d array is treated
      as shape (1,)); a partial last group is padded with zeros.
    exponent: None for linear quantization, where x ~ values * scale.
      With dynamic range expansion, the float32 per-group exponent k (a
      multiple of 1/16), same shape as `scale`; then `scale` is the group's
      max |x| and x ~ sign(values) * scale * (|values| / fp8_max)^(1/k).
    group_size: static; None for per-tensor scaling (and for 128x128
      blocks). 1x128 tiles along the last axis are per-group scaling with
      group_size 128.
    block: static; (128, 128) for a 2-D array in 128x128 blocks (scale
      (ceil(M / 128), ceil(K / 128)), x ~ values * its block's scale), else
      None (the default, so older trees keep their structure).

  Invariants: a group (or tensor) holding NaN or +-Inf has a NaN scale and
  dequantizes to NaN everywhere; an all-zero group dequantizes to exact zeros.
  The leaves keep the sharding of the array they were made from, so the
  quantized state of a sharded parameter stays sharded.
  """

  values: jax.Array
  scale: jax.Array
  exponent: jax.Array | None = None
  group_size: int | None = None
  block: tuple[int, int] | None = None

  @property
  def shape(self) -> tuple[int, ...]:
    return self.values.shape

  @property
  def ndim(self) -> int:
    return self.values.ndim

  @property
  def dtype(self) -> np.dtype:
    """The FP8 dtype of the payload."""
    return self.values.dtype

  @property
  def nbytes(self) -> int:
    """Bytes of the payload and all metadata."""
    return sum(x.nbytes for x in jax.tree.leaves(self))
