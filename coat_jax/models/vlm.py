"""A vision-language model: a ViT, a projector MLP and a decoder.

images (B, H, W, C) -> `ViT` -> (B, P, Dv) -> projector (Linear, GELU,
Linear) -> P image tokens (B, P, H), placed before the text's token
embeddings in a `Decoder` of the shared stack (`Decoder.hidden_states`'s
`prefix`), which attends causally over all P + S positions. The loss
(`vlm_loss`) is the next-token cross entropy on the text positions whose
`loss_mask` is set (the answer's); the image tokens have no targets.

The vision tower and the projector are plain Flax NNX layers
(`nnx.Linear`, `nnx.LayerNorm`) that `coat_jax.convert` turns into FP8
layers as the recipe says, their GELUs switched to the FP8-saving
`coat_jax.nn.gelu` where the recipe has FP8 activations; the decoder is
built with the recipe. `VLM.conversion` is the conversion's report.
"""

from collections.abc import Sequence
import dataclasses
import functools
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp

from coat_jax import conversion
from coat_jax import recipes
from coat_jax.models import vit
from coat_jax.models.decoder import Decoder
from coat_jax.models.decoder import DecoderConfig
from coat_jax.models.decoder import LayerFeed
from coat_jax.models.llama import LlamaConfig
from coat_jax.models.loss import chunked_cross_entropy


@dataclasses.dataclass(frozen=True)
class VLMConfig:
  """A VLM's architecture (recipe-independent).

  Attributes:
    vision: the ViT encoder's.
    decoder: the language model's (a family's `DecoderConfig`); its
      max_seq_len holds the image tokens and the text.
    projector_size: the projector MLP's hidden width.
  """

  vision: vit.ViTConfig
  decoder: DecoderConfig
  projector_size: int

  def __post_init__(self):
    if (isinstance(self.projector_size, bool)
        or not isinstance(self.projector_size, int)
        or self.projector_size <= 0):
      raise ValueError(f'projector_size={self.projector_size!r} must be a'
                       ' positive int.')
    if self.num_image_tokens >= self.decoder.max_seq_len:
      raise ValueError(
          f'decoder.max_seq_len={self.decoder.max_seq_len} leaves no room'
          f' for text after the {self.num_image_tokens} image tokens: raise'
          ' it.')

  @property
  def num_image_tokens(self) -> int:
    """Image tokens before the text: the ViT's patches."""
    return self.vision.num_patches

  @classmethod
  def preset(cls, name: str, **overrides: Any) -> 'VLMConfig':
    """'vlm_tiny' (CPU tests) or 'vlm_1b' (a ViT-B/16 encoder at 224 px and
    Llama '1b'), with field overrides."""
    if name not in PRESETS:
      raise ValueError(f'VLMConfig: preset {name!r} is unknown: use one of'
                       f' {sorted(PRESETS)}.')
    return dataclasses.replace(PRESETS[name], **overrides)


PRESETS = {
    'vlm_tiny': VLMConfig(vision=vit.ViTConfig.preset('tiny'),
                          decoder=LlamaConfig.preset('tiny'),
                          projector_size=128),
    'vlm_1b': VLMConfig(vision=vit.ViTConfig.preset('vit_b16'),
                        decoder=LlamaConfig.preset('1b'),
                        projector_size=2048),
}


class Projector(nnx.Module):
  """fc2(gelu(fc1(x))): vision features (..., Dv) -> decoder embeddings
  (..., H)."""

  def __init__(self, in_features: int, hidden: int, out_features: int, *,
               activation: Any, dtype: Any, param_dtype: Any,
               init_std: float, rngs: nnx.Rngs):
    linear = functools.partial(
        vit.linear_layer, dtype=dtype, param_dtype=param_dtype,
        kernel_init=nnx.initializers.normal(init_std), rngs=rngs)
    self.fc1 = linear(in_features, hidden, ('embed', 'mlp'))
    self.fc2 = linear(hidden, out_features, ('mlp', 'embed'))
    self.activation = activation

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.fc2(self.activation(self.fc1(x)))


class VLM(nnx.Module):
  """images (B, H, W, C) and text tokens (B, S) -> logits of the text.

  Args:
    config: the architecture.
    recipe: a `coat_jax.Recipe` or a preset name (default `recipes.COAT`):
      the decoder's, and what `coat_jax.convert` makes of the vision tower
      and the projector.
    dtype: activation dtype (bfloat16).
    param_dtype: parameter dtype (float32 master weights).
    implementation: the decoder's `fp8_matmul` implementation.
    rngs: random number generators.

  Params: `vision` (a `vit.ViT`), `projector`, `decoder` (a `Decoder`).
  `conversion`: the `coat_jax.ConversionReport` of `vision` and
  `projector` (with BF16, every layer skipped).
  """

  def __init__(self, config: VLMConfig, *,
               recipe: recipes.Recipe | str | None = None,
               dtype: Any = jnp.bfloat16, param_dtype: Any = jnp.float32,
               implementation: str | None = None, rngs: nnx.Rngs):
    recipe = recipes.get(recipes.DEFAULT if recipe is None else recipe)
    group = (recipe.activation_group_size if recipe.fp8_activations
             else None)
    self.vision = vit.ViT(config.vision, dtype=dtype,
                          param_dtype=param_dtype,
                          activation_group_size=group, rngs=rngs)
    self.projector = Projector(
        config.vision.hidden_size, config.projector_size,
        config.decoder.hidden_size,
        activation=vit.gelu_fn(approximate=True, group_size=group),
        dtype=dtype, param_dtype=param_dtype,
        init_std=config.vision.init_std, rngs=rngs)
    # Converted before the decoder is attached: the report lists the
    # vision tower and the projector, not the decoder's own FP8 layers.
    self.conversion = conversion.convert(self, recipe)
    self.decoder = Decoder(config.decoder, recipe=recipe, dtype=dtype,
                           param_dtype=param_dtype,
                           implementation=implementation, rngs=rngs)
    self.config = config
    self.recipe = recipe

  def image_tokens(self, images: jax.Array) -> jax.Array:
    """(B, image_size, image_size, C) -> (B, P, H) in the decoder's dtype.
    uint8 images are pixels, normalized here (`vit.normalize`)."""
    if images.dtype == jnp.uint8:
      images = vit.normalize(images, self.decoder.dtype)
    return self.projector(self.vision(images)).astype(self.decoder.dtype)

  def hidden_states(self, images: jax.Array, tokens: jax.Array,
                    layers: Sequence[Any] | LayerFeed | None = None) -> jax.Array:
    """The decoder's final hidden states of the text positions, (B, S, H).
    `layers`: the decoder's per-layer params (`Decoder.hidden_states`)."""
    prefix = self.image_tokens(images)
    return self.decoder.hidden_states(tokens, layers=layers, prefix=prefix)[
        :, prefix.shape[1]:]

  def __call__(self, images: jax.Array, tokens: jax.Array) -> jax.Array:
    """images (B, H, W, C), int tokens (B, S) -> float32 logits (B, S, V)
    of the text positions (position t predicts token t + 1)."""
    h = self.hidden_states(images, tokens)
    return jnp.dot(h, self.decoder.head_kernel().astype(h.dtype),
                   preferred_element_type=jnp.float32)


def vlm_loss(model: VLM, images: jax.Array, tokens: jax.Array,
             targets: jax.Array, loss_mask: jax.Array, *,
             chunk_size: int = 2048,
             layers: Sequence[Any] | LayerFeed | None = None) -> jax.Array:
  """Mean next-token cross entropy over the masked text positions.

  Args:
    model: a VLM.
    images: (B, H, W, C) floating images, or uint8 pixels
      (`VLM.image_tokens`).
    tokens: (B, S) integer text inputs.
    targets: (B, S) integer next tokens.
    loss_mask: (B, S) bool: the positions that count (an answer's tokens
      and its end); the image tokens never do.
    chunk_size: tokens per chunk of float32 logits (`lm_loss`).
    layers: the decoder's per-layer params of unrolled layers, or a
      `LayerFeed` (`Decoder.hidden_states`).

  Returns:
    float32 scalar: summed loss / number of masked positions (0 if none).
  """
  for name, x in (('targets', targets), ('loss_mask', loss_mask)):
    if getattr(x, 'shape', None) != getattr(tokens, 'shape', None):
      raise ValueError(
          f'{name} has shape {getattr(x, "shape", None)}; expected the shape'
          f' of tokens {getattr(tokens, "shape", None)}.')
  if loss_mask.dtype != jnp.bool_:
    raise TypeError(f'loss_mask has dtype {loss_mask.dtype}; it must be'
                    ' bool (True where a target counts).')
  hidden = model.hidden_states(images, tokens, layers)
  loss_sum, count = chunked_cross_entropy(
      hidden, model.decoder.head_kernel(), jnp.where(loss_mask, targets, -1),
      chunk_size=chunk_size, dtype=model.decoder.dtype,
      fp8_grad_dtype=model.decoder.recipe.head_grad_dtype)
  return loss_sum / jnp.maximum(count, 1.0)


@functools.partial(jax.jit, static_argnames=('graphdef', 'num_tokens',
                                             'vocab_limit'))
def _greedy(graphdef, state, images, prompt, *, num_tokens: int,
            vocab_limit: int | None):
  model = nnx.merge(graphdef, state)
  prefix = model.image_tokens(images)
  start = prompt.shape[1]
  buffer = jnp.pad(prompt, ((0, 0), (0, num_tokens)))

  def step(i, carry):
    buffer, state = carry
    # The params ride in the carry: nnx refuses values of an outer trace.
    decoder = nnx.merge(graphdef, state).decoder
    h = decoder.hidden_states(buffer, prefix=prefix)
    h = jax.lax.dynamic_index_in_dim(h, prefix.shape[1] + start + i - 1,
                                     axis=1, keepdims=False)
    logits = jnp.dot(h, decoder.head_kernel().astype(h.dtype),
                     preferred_element_type=jnp.float32)[:, :vocab_limit]
    token = jnp.argmax(logits, axis=-1).astype(buffer.dtype)
    buffer = jax.lax.dynamic_update_slice_in_dim(
        buffer, token[:, None], start + i, axis=1)
    return buffer, state

  buffer, _ = jax.lax.fori_loop(0, num_tokens, step, (buffer, state))
  return buffer[:, start:]


def greedy_decode(model: VLM, images: jax.Array, prompt: jax.Array,
                  num_tokens: int, *,
                  vocab_limit: int | None = None) -> jax.Array:
  """The `num_tokens` most likely ids after each prompt, one at a time.

  No KV cache: each new id runs the decoder over the image tokens, the
  prompt and a zero-filled buffer of num_tokens (compiled once per shape);
  the image tokens are computed once.

  Args:
    model: a VLM.
    images: (B, H, W, C) floating images.
    prompt: (B, L) integer ids, every row of the same length (pad on the
      left).
    num_tokens: ids to generate (>= 1).
    vocab_limit: only ids below it are generated (the data's vocabulary,
      when the model's is larger); None: all of the model's.

  Returns:
    (B, num_tokens) int32 ids.
  """
  if num_tokens < 1:
    raise ValueError(f'num_tokens={num_tokens} must be >= 1.')
  graphdef, state = nnx.split(model)
  return _greedy(graphdef, state, images, jnp.asarray(prompt, jnp.int32),
                 num_tokens=num_tokens, vocab_limit=vocab_limit)
