"""RMSNorm: plain BF16, or a custom_vjp that saves its input as FP8 1x16.

y = x * rsqrt(mean(x^2) + eps) * scale, statistics in float32.
`fp8_rms_norm` saves only x as E4M3 in 1x16 groups (power-of-two E8M0
scales) and rstd (float32, one per row); backward dequantizes x and
recomputes x_hat.

Gradient amax slots: the FP8 GEMM that produced x (the out or down
projection of a pre-norm block, `coat_jax.nn.linear.fp8_dense` with
`grad_amax_slot=True`) quantizes dx, x's gradient, with one per-tensor
scale, so it needs max |dx|; the norm's backward kernel writes dx and can
take that max in the same pass. A cotangent is the only way back from one
custom_vjp to another: the projection returns a float32 zero, the slot,
which the norm takes as `grad_amax_slot`, and the norm's backward returns
max |dx| as the slot's cotangent (Flax's FP8 ops pass their scales back
through cotangents in the same way). A slot must reach exactly one norm:
unconsumed, its cotangent is 0, and two consumers would add theirs.
"""

import functools
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp

from coat_jax import recipes
from coat_jax.nn import fsdp
from coat_jax.nn import partitioning
from coat_jax.nn.residuals import after_grads
from coat_jax.nn.residuals import reduced_now
from coat_jax.nn.residuals import with_residuals
from coat_jax.quant import QuantizedArray
from pallas_kernels.rms_norm_fp8 import api as rms_norm_fp8_api

_ones_init = nnx.initializers.ones_init()


def _stats(x: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
  xf = x.astype(jnp.float32)
  rstd = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return xf, rstd


def rms_norm(x: jax.Array, scale: jax.Array, eps: float = 1e-5) -> jax.Array:
  """Reference RMSNorm in plain jnp (autodiff decides what it saves).

  Written as HF Llama's: normalize in float32, cast, then apply the gain in
  x.dtype.

  Args:
    x: (..., H) floating input.
    scale: (H,) gain.
    eps: added to the mean square.

  Returns:
    (..., H) in x.dtype.
  """
  xf, rstd = _stats(x, eps)
  return scale.astype(x.dtype) * (xf * rstd).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fp8_rms_norm(x, slot, scale, eps, group_size):
  return _fp8_rms_norm_fwd(x, slot, scale, eps, group_size)[0]


def _fp8_rms_norm_fwd(x, slot, scale, eps, group_size):
  del slot  # only its cotangent matters
  (y, _), residuals = _fp8_rms_norm_with_amax_fwd(x, scale, eps, group_size)
  return y, residuals


def _fp8_rms_norm_with_amax_fwd(x, scale, eps, group_size):
  """((y, max |y|), residuals): the amax, from the same pass and without
  gradient, is the per-tensor scale of the GEMM that reads y."""
  # The one-pass Pallas kernel on Hopper GPUs (each device's rows under
  # FSDP), XLA elsewhere.
  y, codes, scales, rstd, y_amax = fsdp.row_wise(
      functools.partial(rms_norm_fp8_api.rms_norm_fp8_fwd, eps=eps,
                        group_size=group_size,
                        scale_dtype=recipes.ACTIVATION_SCALE_DTYPE),
      (x, scale), (fsdp.ROWS, fsdp.WHOLE),
      (fsdp.ROWS, fsdp.ROWS, fsdp.ROWS, fsdp.ROWS, fsdp.MAX))
  xq = QuantizedArray(codes, scales, None, group_size)
  outs, residuals = with_residuals((y, y_amax), (xq, rstd))
  return outs, residuals + (scale,)


def _fp8_rms_norm_bwd(eps, group_size, residuals, g, residual_grad=None):
  """(dx, the slot's cotangent max |dx|, dscale)."""
  del eps, group_size  # xq carries its group size
  xq, rstd, scale = residuals
  (xq, rstd), (g, residual_grad) = after_grads((xq, rstd),
                                               (g, residual_grad))
  def kernel(codes, scales, rstd, scale, g, residual_grad, *, implementation):
    return rms_norm_fp8_api.rms_norm_fp8_bwd(
        codes, scales, rstd, scale, g, residual_grad=residual_grad,
        group_size=xq.group_size, implementation=implementation)
  rows = fsdp.ROWS
  dx, dscale, dx_amax = fsdp.row_wise(
      kernel, (xq.values, xq.scale, rstd, scale, g, residual_grad),
      (rows, rows, rows, fsdp.WHOLE, rows, rows), (rows, fsdp.SUM, fsdp.MAX))
  return reduced_now((dx, dx_amax, dscale.astype(scale.dtype)))


_fp8_rms_norm.defvjp(_fp8_rms_norm_fwd, _fp8_rms_norm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fp8_rms_norm_with_input(x, slot, scale, eps, group_size):
  return _fp8_rms_norm_with_input_fwd(x, slot, scale, eps, group_size)[0]


def _fp8_rms_norm_with_input_fwd(x, slot, scale, eps, group_size):
  del slot  # only its cotangent matters
  (y, y_amax), residuals = _fp8_rms_norm_with_amax_fwd(x, scale, eps,
                                                       group_size)
  return (x, y, y_amax), residuals


def _fp8_rms_norm_with_input_bwd(eps, group_size, residuals, grads):
  g_x, g_y, _ = grads  # max |y| is a statistic: no gradient
  return _fp8_rms_norm_bwd(eps, group_size, residuals, g_y,
                           residual_grad=g_x)


_fp8_rms_norm_with_input.defvjp(_fp8_rms_norm_with_input_fwd,
                                _fp8_rms_norm_with_input_bwd)


def fp8_rms_norm(
    x: jax.Array, scale: jax.Array, eps: float = 1e-5, *,
    grad_amax_slot: jax.Array | None = None, group_size: int = 16,
) -> jax.Array:
  """RMSNorm that saves its input as E4M3 1x16 groups plus fp32 rstd.

  Args:
    x: (..., H) bfloat16 (or float32) input, H a multiple of 16.
    scale: (H,) gain (a float32 param; its gradient keeps its dtype).
    eps: added to the mean square.
    grad_amax_slot: None, or the slot that came with x from the FP8 GEMM
      that produced it (see the module doc): its cotangent is max |dx|.
    group_size: elements per saved FP8 group (a power of two).

  Returns:
    (..., H) in x.dtype, identical to `rms_norm` in the forward pass.
    Saved: H bytes + H/group_size one-byte scales + one fp32 rstd per row.
  """
  _check_fp8_input(x, scale)
  return _fp8_rms_norm(x, _slot(grad_amax_slot), scale, eps, group_size)


def _slot(grad_amax_slot: jax.Array | None) -> jax.Array:
  """The slot as a float32 scalar (a zero whose cotangent nothing takes
  when None)."""
  if grad_amax_slot is None:
    return jnp.zeros((), jnp.float32)
  if (getattr(grad_amax_slot, 'shape', None) != ()
      or grad_amax_slot.dtype != jnp.float32):
    raise ValueError(
        f'grad_amax_slot must be the float32 scalar slot that an FP8 GEMM'
        f' returned with x (`fp8_dense(..., grad_amax_slot=True)`); got'
        f' {getattr(grad_amax_slot, "shape", None)}'
        f' {getattr(grad_amax_slot, "dtype", type(grad_amax_slot))}.')
  return grad_amax_slot


def _check_fp8_input(x: jax.Array, scale: jax.Array):
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f'x has dtype {x.dtype}; RMSNorm needs floating inputs.')
  recipes.COAT.check_size('x.shape[-1]', x.shape[-1], part='activation')
  if scale.shape != x.shape[-1:]:
    raise ValueError(f'scale has shape {scale.shape}; expected'
                     f' ({x.shape[-1]},) to match x.shape[-1].')


def fp8_rms_norm_with_input(
    x: jax.Array, scale: jax.Array, eps: float = 1e-5, *,
    grad_amax_slot: jax.Array | None = None, group_size: int = 16,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(x, y = fp8_rms_norm(x), max |y|) for a pre-norm block x + f(norm(x)).

  The same values as `x, fp8_rms_norm(x, scale, eps)`; backward adds the
  gradient that reaches x along the residual stream into the norm's own
  backward pass (`rms_norm_fp8_bwd`'s residual_grad: one Pallas pass on a
  GPU, in float32 before dx is rounded) instead of in a separate add.
  max |y| (a float32 scalar without gradient, from the norm's own pass) is
  the `x_amax` of the FP8 GEMMs that read y: no amax pass over y.
  grad_amax_slot: as `fp8_rms_norm`'s; its cotangent is max |dx| of the
  whole gradient of x, the residual stream's included. group_size: as
  `fp8_rms_norm`'s.
  """
  _check_fp8_input(x, scale)
  return _fp8_rms_norm_with_input(x, _slot(grad_amax_slot), scale, eps,
                                  group_size)


class CoatRMSNorm(nnx.Module):
  """RMSNorm over the last axis; saves its input as FP8 groups where the
  recipe has `fp8_activations`.

  y = x * rsqrt(mean(x^2) + epsilon) * (scale + scale_offset), statistics
  in float32. The param is `scale`, as `nnx.RMSNorm`'s, so an
  `nnx.RMSNorm`'s param serves it as it is (`coat_jax.convert`).

  Args:
    num_features: size H of the last axis (a multiple of 16 with FP8
      activations).
    epsilon: added to the mean square (Llama-2: 1e-5).
    dtype: output dtype (bfloat16), or None for the promoted dtype of the
      input and the scale (as nnx.RMSNorm); statistics are float32.
    param_dtype: dtype of the scale param (float32).
    recipe: a `coat_jax.Recipe` or a preset name (default `recipes.COAT`).
    scale_init: initializer of the scale (ones).
    scale_axes: logical axis name of the scale, e.g. ('norm',).
    scale_offset: added to the scale param to make the gain: 0 (Llama), or
      1 where the checkpoint stores gain - 1 (Gemma's (1 + w)).
    rngs: random number generators.
    precision: the older name of `recipe` (a preset name).
  """

  def __init__(
      self,
      num_features: int,
      *,
      epsilon: float = 1e-5,
      dtype: Any = jnp.bfloat16,
      param_dtype: Any = jnp.float32,
      recipe: recipes.Recipe | str | None = None,
      scale_init: Any = _ones_init,
      scale_axes: tuple[str | None, ...] | None = None,
      scale_offset: float = 0.0,
      rngs: nnx.Rngs,
      precision: str | None = None,
  ):
    recipe = recipes.from_arguments(recipe, precision)
    recipe.check_size('num_features', num_features, part='activation')
    self.scale = partitioning.make_param(
        scale_init, rngs.params(), (num_features,), param_dtype, scale_axes)
    self.num_features = num_features
    self.epsilon = epsilon
    self.dtype = dtype
    self.recipe = recipe
    self.scale_offset = scale_offset

  def _gain(self) -> jax.Array:
    scale = self.scale[...]
    return scale + self.scale_offset if self.scale_offset else scale

  def _dtype(self, x: jax.Array) -> Any:
    if self.dtype is not None:
      return self.dtype
    return jnp.result_type(x.dtype, self.scale.dtype)

  def __call__(self, x: jax.Array, *,
               grad_amax_slot: jax.Array | None = None) -> jax.Array:
    """(..., num_features) -> same shape in the compute dtype.
    grad_amax_slot: the slot that came with x (FP8 activations; see
    `fp8_rms_norm`)."""
    x = x.astype(self._dtype(x))
    if self.recipe.fp8_activations:
      return fp8_rms_norm(x, self._gain(), self.epsilon,
                          grad_amax_slot=grad_amax_slot,
                          group_size=self.recipe.activation_group_size)
    self._check_no_slot(grad_amax_slot)
    return rms_norm(x, self._gain(), self.epsilon)

  def with_input(
      self, x: jax.Array, *, grad_amax_slot: jax.Array | None = None
  ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """(x, y = self(x), max |y| or None), for a pre-norm block x + f(y):
    with FP8 activations (x in the compute dtype) backward adds the
    residual stream's gradient inside the norm's backward pass, and max |y|
    comes from the norm's pass (`fp8_rms_norm_with_input`, which takes
    `grad_amax_slot`); else None."""
    if self.recipe.fp8_activations and x.dtype == self._dtype(x):
      return fp8_rms_norm_with_input(
          x, self._gain(), self.epsilon, grad_amax_slot=grad_amax_slot,
          group_size=self.recipe.activation_group_size)
    self._check_no_slot(grad_amax_slot)
    return x, self(x), None

  def _check_no_slot(self, grad_amax_slot):
    if grad_amax_slot is not None:
      raise ValueError(
          'grad_amax_slot needs a recipe with fp8_activations and x in the'
          f' norm\'s dtype (recipe {self.recipe}): leave it None.')
