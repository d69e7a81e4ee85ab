"""Recipes: every choice of the FP8 training path in one frozen object.

A `Recipe` is what the layers, the models, `load_hf`, `convert` and
train.py take where a precision is chosen. The presets:

  BF16        BF16 matmuls, plain jnp non-linear layers: the baseline.
  FP8_LINEAR  FP8 matmuls whose layers save FP8 inputs, BF16 non-linear
              layers (what TransformerEngine-JAX and Flax's fp8_ops do).
  COAT        FP8 matmuls, and the norms and activations save their inputs
              as FP8 1x16 groups (COAT's mixed-granularity flow; the
              default).
  COAT_BLOCK  COAT with DeepSeek-V3 block scaling in the linear layers.

A preset's name ('bf16', 'fp8_linear', 'coat', 'coat_block') is accepted
wherever a recipe is (`get`); a variant is `dataclasses.replace(COAT, ...)`.

  model = coat_jax.models.Llama(config, recipe=coat_jax.recipes.COAT_BLOCK,
                                rngs=nnx.Rngs(0))
"""

import dataclasses

import jax.numpy as jnp

SCALINGS = ('tensor', 'block')
GRAD_DTYPES = ('e5m2', 'e4m3')

# Storage dtype of the 1x16 activation scales: one byte, a power of two
# (MX's E8M0), so an FP8 group tensor costs 1.0625 bytes/element (bf16
# scales: 1.125, fp32: 1.25). The scale is rounded up to a power of two, so
# codes never clip and (de)quantization is exact; a group's max then lands
# anywhere in [fp8_max / 2, fp8_max] (docs/decisions.md).
ACTIVATION_SCALE_DTYPE = jnp.float8_e8m0fnu

# Feature sizes of FP8 layers: multiples of 16 tile both the 1x16 groups
# and the FP8 GEMMs.
FP8_MULTIPLE = 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recipe:
  """The FP8 path of a model: what runs in FP8, how it is scaled and stored.

  Attributes:
    fp8_matmuls: linear layers run FP8 GEMMs (E4M3 forward, `grad_dtype`
      gradients, float32 accumulation) and save their inputs in FP8.
    fp8_activations: norms and activations (RMSNorm, LayerNorm, SwiGLU,
      GeGLU, SiLU, GELU) save their inputs as E4M3 groups of
      `activation_group_size` along the last axis with E8M0 scales, and
      recompute what they need in backward.
    scaling: the linear layers' scaling: 'tensor' (per-tensor current
      scaling, COAT's paper) or 'block' (1x128 activation and gradient
      tiles, 128x128 weight blocks: DeepSeek-V3's granularity).
    grad_dtype: the FP8 format of the output gradients that feed the
      backward GEMMs: 'e5m2' (range) or 'e4m3' (precision).
    activation_group_size: elements per FP8 group of a saved non-linear
      input (16 in COAT; a power of two).
    fuse_qkv: the built-in attention runs Q/K/V as one FP8 projection, one
      GEMM each way (with 'tensor' scaling one scale for the three weights
      and one for their gradients; False gives each its own, as COAT's
      paper). The params are the same either way.
    fp8_weight_gather: under an FSDP mesh, all-gather the FP8 codes of the
      weights (1 byte a param) instead of their float32 shards.
    fp8_head: the built-in models' LM head and loss run their three GEMMs
      in FP8 (`coat_jax.models.chunked_cross_entropy`'s fp8_grad_dtype:
      E4M3 hidden states and head, `grad_dtype` d loss / d logits). Off in
      every preset: the head's accuracy in FP8 is not established.
  """

  fp8_matmuls: bool = True
  fp8_activations: bool = True
  scaling: str = 'tensor'
  grad_dtype: str = 'e5m2'
  activation_group_size: int = 16
  fuse_qkv: bool = True
  fp8_weight_gather: bool = False
  fp8_head: bool = False

  def __post_init__(self):
    for field in ('fp8_matmuls', 'fp8_activations', 'fuse_qkv',
                  'fp8_weight_gather', 'fp8_head'):
      if not isinstance(getattr(self, field), bool):
        raise TypeError(f'Recipe.{field}={getattr(self, field)!r} must be'
                        ' True or False.')
    if self.scaling not in SCALINGS:
      raise ValueError(f'Recipe.scaling={self.scaling!r} must be one of'
                       f' {SCALINGS}.')
    if self.grad_dtype not in GRAD_DTYPES:
      raise ValueError(f'Recipe.grad_dtype={self.grad_dtype!r} must be one'
                       f' of {GRAD_DTYPES}.')
    g = self.activation_group_size
    if (isinstance(g, bool) or not isinstance(g, int) or g <= 0
        or g & (g - 1) or g > 128):
      raise ValueError(
          f'Recipe.activation_group_size={g!r} must be a power of two in'
          ' [1, 128] (16 in COAT).')

  @property
  def head_grad_dtype(self) -> str | None:
    """The FP8 format of the LM head's logit gradients; None: a BF16 head."""
    return self.grad_dtype if self.fp8_head else None

  @property
  def uses_fp8(self) -> bool:
    """Whether any layer runs or saves anything in FP8."""
    return self.fp8_matmuls or self.fp8_activations or self.fp8_head

  def check_size(self, name: str, size: int, *,
                 part: str = 'matmul') -> None:
    """Raises ValueError if `size` cannot be tiled by 16 where this recipe
    puts it in FP8.

    Args:
      name: the argument's name, for the message.
      size: a feature size (hidden, intermediate, projection width).
      part: 'matmul' (a linear layer's size: checked with fp8_matmuls),
        'activation' (a norm's or activation's: with fp8_activations) or
        'head' (the LM head's: with fp8_head).
    """
    on = {'matmul': self.fp8_matmuls, 'activation': self.fp8_activations,
          'head': self.fp8_head}[part]
    if not on or size % FP8_MULTIPLE == 0:
      return
    raise ValueError(
        f'{name}={size} must be a multiple of {FP8_MULTIPLE} for FP8'
        f' {part}s (recipe {name_of(self) or self}): pad it to'
        f' {size + (-size) % FP8_MULTIPLE}, or use a recipe without FP8'
        f" {part}s (e.g. coat_jax.recipes.BF16), or let coat_jax.convert"
        ' skip the layer.')


BF16 = Recipe(fp8_matmuls=False, fp8_activations=False)
FP8_LINEAR = Recipe(fp8_activations=False)
COAT = Recipe()
COAT_BLOCK = Recipe(scaling='block')

PRESETS = {'bf16': BF16, 'fp8_linear': FP8_LINEAR, 'coat': COAT,
           'coat_block': COAT_BLOCK}
DEFAULT = COAT


def get(recipe: 'Recipe | str', argname: str = 'recipe') -> Recipe:
  """`recipe` itself, or the preset it names ('bf16', 'fp8_linear', 'coat',
  'coat_block': the precision modes of earlier versions are these names).

  Raises:
    ValueError: a name that is no preset, or another type.
  """
  if isinstance(recipe, Recipe):
    return recipe
  if isinstance(recipe, str) and recipe in PRESETS:
    return PRESETS[recipe]
  raise ValueError(
      f'{argname}={recipe!r} is not a recipe: pass a coat_jax.Recipe or one'
      f' of the preset names {tuple(PRESETS)}.')


def name_of(recipe: Recipe) -> str | None:
  """The preset name whose recipe equals `recipe`, else None."""
  for name, preset in PRESETS.items():
    if preset == recipe:
      return name
  return None


def from_arguments(recipe: 'Recipe | str | None', precision: str | None,
                   default: Recipe = DEFAULT) -> Recipe:
  """The recipe of a layer's or model's `recipe=` and its older alias
  `precision=` (a preset name); `default` when neither is given.

  Raises:
    ValueError: both given, or a name that is no preset.
  """
  if precision is not None:
    if recipe is not None:
      raise ValueError(
          f'recipe={recipe!r} and precision={precision!r} are both given;'
          ' precision is the older name of recipe: pass recipe only.')
    return get(precision, 'precision')
  return default if recipe is None else get(recipe)
