"""A ViT encoder in plain Flax NNX layers, and SigLIP's vision tower in it.

`ViT` is images (B, H, W, C) -> patch features (B, N, D): a patch embedding
(an `nnx.Linear` over flattened patches, which is SigLIP's Conv2d with
stride = kernel = patch), learned position embeddings, pre-LayerNorm
encoder layers (non-causal attention with biased q/k/v/out projections, a
GELU MLP) and a final LayerNorm; no class token and no pooling head. Its
layers are `nnx.Linear` and `nnx.LayerNorm`, so `coat_jax.convert` turns
them into FP8 layers; the MLP's GELU is `jax.nn.gelu`, or the FP8-saving
`coat_jax.nn.gelu` with `activation_group_size` (what a converted model
wants).

The module and param names are SigLIP's (`transformers.SiglipVisionModel`):
`patch_embedding`, `position_embedding`, `layers[i].{layer_norm1,
self_attn.{q,k,v,out}_proj, layer_norm2, mlp.fc1, mlp.fc2}`,
`post_layernorm`, so `load_siglip` reads a checkpoint by renaming.
"""

from collections.abc import Callable
import dataclasses
import functools
from typing import Any
from typing import ClassVar

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from coat_jax import nn as coat_nn
from coat_jax.nn import partitioning

ACTIVATIONS = ('gelu_tanh', 'gelu')


@dataclasses.dataclass(frozen=True)
class ViTConfig:
  """A ViT encoder's architecture. The defaults are ViT-B/16's (and
  SigLIP-B/16's vision tower's) at 224 px.

  Attributes:
    image_size: height and width of the input images, in pixels.
    patch_size: height and width of a patch; divides image_size.
    num_channels: colour channels of the images.
    hidden_size: model width D.
    intermediate_size: the MLP's width.
    num_layers: encoder layers.
    num_heads: attention heads; divides hidden_size.
    layer_norm_eps: every LayerNorm's epsilon.
    activation: the MLP's, 'gelu_tanh' (SigLIP's gelu_pytorch_tanh) or
      'gelu' (exact, erf).
    init_std: std of the normal initializer of all matrices and of the
      position embeddings.
  """

  image_size: int = 224
  patch_size: int = 16
  num_channels: int = 3
  hidden_size: int = 768
  intermediate_size: int = 3072
  num_layers: int = 12
  num_heads: int = 12
  layer_norm_eps: float = 1e-6
  activation: str = 'gelu_tanh'
  init_std: float = 0.02

  PRESETS: ClassVar[dict] = {
      'tiny': dict(image_size=32, patch_size=8, hidden_size=64,
                   intermediate_size=256, num_layers=2, num_heads=4),
      'vit_b16': dict(),
  }

  def __post_init__(self):
    for name in ('image_size', 'patch_size', 'num_channels', 'hidden_size',
                 'intermediate_size', 'num_layers', 'num_heads'):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f'{name}={value!r} must be a positive int.')
    if self.image_size % self.patch_size:
      raise ValueError(f'image_size={self.image_size} must be a multiple of'
                       f' patch_size={self.patch_size}.')
    if self.hidden_size % self.num_heads:
      raise ValueError(f'hidden_size={self.hidden_size} must be a multiple'
                       f' of num_heads={self.num_heads}.')
    if self.activation not in ACTIVATIONS:
      raise ValueError(f'activation={self.activation!r} must be one of'
                       f' {ACTIVATIONS}.')

  @property
  def num_patches(self) -> int:
    """Patches (and output tokens) per image."""
    return (self.image_size // self.patch_size) ** 2

  @property
  def patch_features(self) -> int:
    """Values per flattened patch: patch_size^2 * num_channels."""
    return self.patch_size ** 2 * self.num_channels

  @classmethod
  def preset(cls, name: str, **overrides: Any) -> 'ViTConfig':
    """The named configuration ('tiny', 'vit_b16'), with field overrides."""
    if name not in cls.PRESETS:
      raise ValueError(f'ViTConfig: preset {name!r} is unknown: use one of'
                       f' {sorted(cls.PRESETS)}.')
    return cls(**{**cls.PRESETS[name], **overrides})


# SigLIP's image preprocessing: pixels / 255, less the mean, over the std.
PIXEL_MEAN = PIXEL_STD = 0.5


def normalize(pixels: Any, dtype: Any = np.float32) -> Any:
  """uint8 pixels (numpy or jax) -> (pixels / 255 - PIXEL_MEAN) /
  PIXEL_STD in dtype, in [-1, 1] (SigLIP's preprocessing)."""
  scale = 1 / (255 * PIXEL_STD)
  x = pixels.astype(np.float32) * np.float32(scale)
  return (x - np.float32(PIXEL_MEAN / PIXEL_STD)).astype(dtype)


def patchify(images: jax.Array, patch_size: int) -> jax.Array:
  """(B, H, W, C) -> (B, H/p * W/p, p * p * C): patches in row-major order
  over the grid, each flattened in (row, column, channel) order."""
  b, h, w, c = images.shape
  p = patch_size
  x = images.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(b, (h // p) * (w // p), p * p * c)


def attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
  """Non-causal multi-head attention through
  `jax.nn.dot_product_attention`: cuDNN flash attention on GPU where it
  takes the shapes (and can differentiate them: an even number of
  patches), XLA elsewhere.

  Args:
    q, k, v: (B, N, heads, head_dim).

  Returns:
    (B, N, heads, head_dim) in q.dtype; softmax scale head_dim ** -0.5.
  """
  # cuDNN has no backward for an odd number of patches (SigLIP's 729 at
  # 384 px), and jax says so only when differentiating: XLA takes those.
  if jax.default_backend() == 'gpu' and q.shape[1] % 2 == 0:
    try:
      return jax.nn.dot_product_attention(q, k, v, implementation='cudnn')
    except (ValueError, NotImplementedError, RuntimeError, TypeError):
      pass
  return jax.nn.dot_product_attention(q, k, v)


def axis_names(axes: tuple[str | None, ...]) -> dict:
  """An nnx param's metadata naming its logical axes: sharded as it is made
  under a mesh, only recorded without one (as `partitioning.make_param`)."""
  eager = (nnx.using_eager_sharding()
           and not jax.sharding.get_abstract_mesh().empty)
  return {'out_sharding': axes, 'eager_sharding': eager}


def linear_layer(in_features: int, out_features: int,
                 axes: tuple[str | None, str | None], **kwargs: Any
                 ) -> nnx.Linear:
  """nnx.Linear whose kernel and bias carry logical axis names (`axes`;
  `coat_jax.convert` keeps them)."""
  return nnx.Linear(in_features, out_features,
                    kernel_metadata=axis_names(axes),
                    bias_metadata=axis_names(axes[-1:]), **kwargs)


def gelu_fn(approximate: bool, group_size: int | None) -> Callable:
  """jax.nn.gelu, or with `group_size` coat_jax.nn.gelu saving its input
  as E4M3 groups of that size."""
  if group_size is None:
    return functools.partial(jax.nn.gelu, approximate=approximate)
  return functools.partial(coat_nn.gelu, approximate=approximate,
                           group_size=group_size)


class Attention(nnx.Module):
  """Multi-head self-attention over all tokens with biased q/k/v/out
  projections (SigLIP's `self_attn`)."""

  def __init__(self, config: ViTConfig, linear: Callable):
    d = config.hidden_size
    self.q_proj = linear(d, d, ('embed', 'heads'))
    self.k_proj = linear(d, d, ('embed', 'heads'))
    self.v_proj = linear(d, d, ('embed', 'heads'))
    self.out_proj = linear(d, d, ('heads', 'embed'))
    self.num_heads = config.num_heads

  def __call__(self, x: jax.Array) -> jax.Array:
    """(B, N, D) -> (B, N, D)."""
    b, n, d = x.shape
    split = lambda t: t.reshape(b, n, self.num_heads, d // self.num_heads)
    o = attention(split(self.q_proj(x)), split(self.k_proj(x)),
                  split(self.v_proj(x)))
    return self.out_proj(o.reshape(b, n, d))


class MLP(nnx.Module):
  """fc2(gelu(fc1(x)))."""

  def __init__(self, config: ViTConfig, linear: Callable,
               activation: Callable):
    self.fc1 = linear(config.hidden_size, config.intermediate_size,
                      ('embed', 'mlp'))
    self.fc2 = linear(config.intermediate_size, config.hidden_size,
                      ('mlp', 'embed'))
    self.activation = activation

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.fc2(self.activation(self.fc1(x)))


class EncoderLayer(nnx.Module):
  """x + attn(ln1(x)), then h + mlp(ln2(h))."""

  def __init__(self, config: ViTConfig, linear: Callable,
               layer_norm: Callable, activation: Callable):
    self.layer_norm1 = layer_norm(config.hidden_size)
    self.self_attn = Attention(config, linear)
    self.layer_norm2 = layer_norm(config.hidden_size)
    self.mlp = MLP(config, linear, activation)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.self_attn(self.layer_norm1(x))
    return x + self.mlp(self.layer_norm2(x))


class ViT(nnx.Module):
  """A ViT encoder: images (B, H, W, C) -> features (B, num_patches, D).

  Args:
    config: the architecture.
    dtype: activation dtype (bfloat16; float32 for exact comparisons).
    param_dtype: parameter dtype (float32 master weights).
    activation_group_size: None: the MLP's GELU is `jax.nn.gelu`
      (autodiff decides what it saves); an int g: `coat_jax.nn.gelu`,
      saving its input as E4M3 groups of g (a recipe's
      `activation_group_size`, where the recipe has FP8 activations).
    rngs: random number generators.

  The linear layers and LayerNorms are nnx's until `coat_jax.convert`
  replaces them. The LayerNorms compute the variance as E[(x - E[x])^2],
  as PyTorch does (`use_fast_variance=False`). Params carry logical axis
  names ('embed', 'heads', 'mlp', 'norm'; `coat_jax.nn.partitioning`).
  """

  def __init__(self, config: ViTConfig, *, dtype: Any = jnp.bfloat16,
               param_dtype: Any = jnp.float32,
               activation_group_size: int | None = None, rngs: nnx.Rngs):
    init = nnx.initializers.normal(config.init_std)
    linear = functools.partial(linear_layer, dtype=dtype,
                               param_dtype=param_dtype, kernel_init=init,
                               rngs=rngs)
    norm_axes = axis_names(('norm',))
    layer_norm = functools.partial(
        nnx.LayerNorm, epsilon=config.layer_norm_eps, dtype=dtype,
        param_dtype=param_dtype, use_fast_variance=False,
        scale_metadata=norm_axes, bias_metadata=norm_axes, rngs=rngs)
    activation = gelu_fn(config.activation == 'gelu_tanh',
                         activation_group_size)
    self.patch_embedding = linear(config.patch_features, config.hidden_size,
                                  (None, 'embed'))
    self.position_embedding = partitioning.make_param(
        init, rngs.params(), (config.num_patches, config.hidden_size),
        param_dtype, (None, 'embed'))
    self.layers = nnx.List([
        EncoderLayer(config, linear, layer_norm, activation)
        for _ in range(config.num_layers)])
    self.post_layernorm = layer_norm(config.hidden_size)
    self.config = config
    self.dtype = dtype

  def __call__(self, images: jax.Array) -> jax.Array:
    """(B, image_size, image_size, num_channels) floating images ->
    (B, num_patches, hidden_size) in dtype, after the final LayerNorm."""
    c = self.config
    want = (c.image_size, c.image_size, c.num_channels)
    if (getattr(images, 'ndim', None) != 4 or images.shape[1:] != want
        or not jnp.issubdtype(images.dtype, jnp.floating)):
      raise ValueError(
          f'images has shape {getattr(images, "shape", None)} and dtype'
          f' {getattr(images, "dtype", None)}; expected floating'
          f' (batch, {", ".join(map(str, want))}) (resize the images to'
          ' config.image_size).')
    x = self.patch_embedding(patchify(images.astype(self.dtype),
                                      c.patch_size))
    x = x + self.position_embedding[...].astype(x.dtype)
    for layer in self.layers:
      x = layer(x)
    return self.post_layernorm(x)
