"""LayerNorm: plain jnp, or a custom_vjp that saves its input as FP8 1x16.

y = (x - mean) * rsqrt(var + eps) * scale + bias over the last axis,
statistics in float32, computed as `nnx.LayerNorm` computes them (with its
`use_fast_variance`, var = max(0, E[x^2] - E[x]^2), or E[(x - E[x])^2]), so
the forward pass equals nnx.LayerNorm's to float32 rounding.
`fp8_layer_norm` saves only x as E4M3 groups along the last axis
(power-of-two E8M0 scales) and the float32 mean and rstd of each row;
backward dequantizes x and recomputes x_hat. The forward pass reads the
exact x: only the gradients see the quantization.
"""

import functools
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from coat_jax import quant
from coat_jax import recipes
from coat_jax.nn import partitioning
from coat_jax.nn.residuals import after_grads
from coat_jax.nn.residuals import reduced_now
from coat_jax.nn.residuals import with_residuals

_ones_init = nnx.initializers.ones_init()
_zeros_init = nnx.initializers.zeros_init()


def _stats(xf: jax.Array, eps: float, use_fast_variance: bool
           ) -> tuple[jax.Array, jax.Array]:
  """(mean, rstd), each (..., 1) float32, of float32 rows xf (..., H)."""
  mean = jnp.mean(xf, axis=-1, keepdims=True)
  if use_fast_variance:
    var = jnp.maximum(0.0, jnp.mean(jnp.square(xf), axis=-1, keepdims=True)
                      - jnp.square(mean))
  else:
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
  return mean, jax.lax.rsqrt(var + eps)


def _normalize(x, scale, bias, eps, use_fast_variance):
  """(y in x.dtype, mean, rstd): nnx.LayerNorm's arithmetic in float32."""
  xf = x.astype(jnp.float32)
  mean, rstd = _stats(xf, eps, use_fast_variance)
  mul = rstd if scale is None else rstd * scale.astype(jnp.float32)
  y = (xf - mean) * mul
  if bias is not None:
    y = y + bias.astype(jnp.float32)
  return y.astype(x.dtype), mean, rstd


def layer_norm(
    x: jax.Array, scale: jax.Array | None, bias: jax.Array | None,
    eps: float = 1e-6, *, use_fast_variance: bool = True,
) -> jax.Array:
  """Reference LayerNorm in plain jnp (autodiff decides what it saves).

  Args:
    x: (..., H) floating input.
    scale: (H,) gain, or None for none.
    bias: (H,) offset, or None for none.
    eps: added to the variance.
    use_fast_variance: var = max(0, E[x^2] - E[x]^2) (nnx.LayerNorm's
      default), else E[(x - E[x])^2].

  Returns:
    (..., H) in x.dtype, computed in float32 as `nnx.LayerNorm` does.
  """
  _check_args(x, scale, bias)
  return _normalize(x, scale, bias, eps, use_fast_variance)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _fp8_layer_norm(x, scale, bias, eps, group_size, use_fast_variance,
                    bias_dtype):
  return _normalize(x, scale, bias, eps, use_fast_variance)[0]


def _fp8_layer_norm_fwd(x, scale, bias, eps, group_size, use_fast_variance,
                        bias_dtype):
  del bias_dtype  # backward's
  y, mean, rstd = _normalize(x, scale, bias, eps, use_fast_variance)
  xq = quant.quantize_per_group(x, group_size, 'e4m3',
                                scale_dtype=recipes.ACTIVATION_SCALE_DTYPE)
  y, residuals = with_residuals(y, (xq, mean, rstd))
  return y, residuals + (scale,)


def _fp8_layer_norm_bwd(eps, group_size, use_fast_variance, bias_dtype,
                        residuals, g):
  """(dx, dscale, dbias), each in its input's dtype (None where the input
  is None)."""
  del eps, group_size, use_fast_variance  # in the saved statistics
  *saved, scale = residuals
  (xq, mean, rstd), g = after_grads(tuple(saved), g)
  x_hat = (quant.dequantize(xq) - mean) * rstd
  gf = g.astype(jnp.float32)
  rows = tuple(range(g.ndim - 1))
  dbias = None if bias_dtype is None else jnp.sum(gf, rows).astype(
      bias_dtype)
  if scale is None:
    dscale, g_hat = None, gf
  else:
    dscale = jnp.sum(gf * x_hat, rows).astype(scale.dtype)
    g_hat = gf * scale.astype(jnp.float32)
  # d/dx of (x - mean) * rstd, applied to g_hat.
  dx = rstd * (g_hat - jnp.mean(g_hat, -1, keepdims=True)
               - x_hat * jnp.mean(g_hat * x_hat, -1, keepdims=True))
  return reduced_now((dx.astype(g.dtype), dscale, dbias))


_fp8_layer_norm.defvjp(_fp8_layer_norm_fwd, _fp8_layer_norm_bwd)


def fp8_layer_norm(
    x: jax.Array, scale: jax.Array | None, bias: jax.Array | None,
    eps: float = 1e-6, *, group_size: int = 16,
    use_fast_variance: bool = True,
) -> jax.Array:
  """LayerNorm that saves its input as E4M3 groups plus fp32 mean and rstd.

  Args:
    x: (..., H) floating input (bfloat16 or float32 activations); any H (a
      partial last group is zero-padded).
    scale: (H,) gain, or None for none; its gradient keeps its dtype.
    bias: (H,) offset, or None for none; its gradient keeps its dtype.
    eps: added to the variance.
    group_size: elements per saved FP8 group (a power of two, 16 in COAT).
    use_fast_variance: as `layer_norm`'s.

  Returns:
    (..., H) in x.dtype, the same values as `layer_norm` (computed from the
    exact x). Saved: H bytes + ceil(H / group_size) one-byte scales + two
    float32 (mean, rstd) per row, and scale (a param, saved as it is).
  """
  _check_args(x, scale, bias)
  recipes.Recipe(activation_group_size=group_size)  # validates it
  bias_dtype = None if bias is None else np.dtype(bias.dtype)
  return _fp8_layer_norm(x, scale, bias, float(eps), group_size,
                         bool(use_fast_variance), bias_dtype)


def _check_args(x, scale, bias) -> None:
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f'x has dtype {x.dtype}; LayerNorm needs floating'
                    ' inputs.')
  if x.ndim < 1:
    raise ValueError('x must have at least one axis (the features).')
  for name, p in (('scale', scale), ('bias', bias)):
    if p is not None and p.shape != x.shape[-1:]:
      raise ValueError(f'{name} has shape {p.shape}; expected'
                       f' {x.shape[-1:]} to match x.shape[-1] (or None).')


class CoatLayerNorm(nnx.Module):
  """LayerNorm over the last axis; saves its input as FP8 groups where the
  recipe has `fp8_activations`.

  Mirrors `nnx.LayerNorm` (the same params `scale` and `bias`, (H,) each,
  the same forward arithmetic), so an nnx.LayerNorm's params serve it as
  they are (`coat_jax.convert`). Without FP8 activations it is plain jnp
  (`layer_norm`), which autodiff differentiates.

  Args:
    num_features: size H of the last axis (a multiple of 16 with FP8
      activations, as every FP8 layer's).
    epsilon: added to the variance (nnx.LayerNorm's 1e-6; GPT-2 and ViT use
      1e-5 and 1e-6).
    dtype: the compute and output dtype, or None for the promoted dtype of
      the input and the params (as nnx.LayerNorm); statistics are float32.
    param_dtype: dtype of the params (float32).
    use_bias: learn a bias (offset).
    use_scale: learn a scale (gain).
    bias_init: initializer of the bias (zeros).
    scale_init: initializer of the scale (ones).
    use_fast_variance: as nnx.LayerNorm's: var = max(0, E[x^2] - E[x]^2),
      else E[(x - E[x])^2].
    recipe: a `coat_jax.Recipe` or a preset name (default `recipes.COAT`).
    scale_axes: logical axis name of the scale and the bias, e.g.
      ('norm',).
    rngs: random number generators.
  """

  def __init__(
      self,
      num_features: int,
      *,
      epsilon: float = 1e-6,
      dtype: Any = None,
      param_dtype: Any = jnp.float32,
      use_bias: bool = True,
      use_scale: bool = True,
      bias_init: Any = _zeros_init,
      scale_init: Any = _ones_init,
      use_fast_variance: bool = True,
      recipe: recipes.Recipe | str | None = None,
      scale_axes: tuple[str | None, ...] | None = None,
      rngs: nnx.Rngs,
  ):
    recipe = recipes.from_arguments(recipe, None)
    recipe.check_size('num_features', num_features, part='activation')
    shape = (num_features,)
    self.scale: nnx.Param | None = nnx.data(None)
    if use_scale:
      self.scale = partitioning.make_param(
          scale_init, rngs.params(), shape, param_dtype, scale_axes)
    self.bias: nnx.Param | None = nnx.data(None)
    if use_bias:
      self.bias = partitioning.make_param(
          bias_init, rngs.params(), shape, param_dtype, scale_axes)
    self.num_features = num_features
    self.epsilon = epsilon
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.use_bias = use_bias
    self.use_scale = use_scale
    self.use_fast_variance = use_fast_variance
    self.recipe = recipe

  def __call__(self, x: jax.Array, *,
               mask: jax.Array | None = None) -> jax.Array:
    """(..., num_features) -> same shape in the compute dtype.

    mask: not supported (nnx.LayerNorm's masked statistics); leave it None.
    """
    if mask is not None:
      raise ValueError(
          'mask: CoatLayerNorm computes the statistics of whole rows; for a'
          ' masked LayerNorm keep nnx.LayerNorm (coat_jax.convert\'s'
          ' filter can leave the layer out).')
    scale, bias = (None if p is None else p[...]
                   for p in (self.scale, self.bias))
    dtype = self.dtype
    if dtype is None:  # as nnx.LayerNorm's promote_dtype
      dtype = jnp.result_type(
          x.dtype, *(p.dtype for p in (scale, bias) if p is not None))
    x = x.astype(dtype)
    scale, bias = (None if p is None else p.astype(dtype)
                   for p in (scale, bias))
    if self.recipe.fp8_activations:
      return fp8_layer_norm(
          x, scale, bias, self.epsilon,
          group_size=self.recipe.activation_group_size,
          use_fast_variance=self.use_fast_variance)
    return layer_norm(x, scale, bias, self.epsilon,
                      use_fast_variance=self.use_fast_variance)
