"""The decoder-only transformer stack every model family shares.

One `Decoder` (embedding, a stack of `DecoderLayer`s, final norm, LM head)
covers Llama 2/3, Mistral, Qwen2/2.5, Qwen3, OLMo 2 and Gemma 3 text; a
family is a `DecoderConfig` subclass that sets its defaults (its
differences are config fields: biases, QK norms, where the norms sit, the
MLP's activation, the embedding scale, sliding-window layers) and its
Hugging Face name map (`coat_jax.models.families`).

The layers run as the model's `Recipe` says (`coat_jax.recipes`): the
residual stream, RoPE and attention (`jax.nn.dot_product_attention`: cuDNN
flash attention on GPU where it accepts the shapes, XLA elsewhere) are BF16;
embeddings, final norm, LM head and loss are BF16 with float32 statistics;
params are float32. The decoder layers are one module with stacked params
(a leading num_layers axis), applied one slice at a time (unrolled) or
under `jax.lax.scan` (`DecoderConfig.scan_layers`), each under the remat
policy of `coat_jax.models.remat`.
"""

from collections.abc import Callable
from collections.abc import Sequence
import dataclasses
import functools
import math
from typing import Any
from typing import ClassVar

from flax import nnx
import jax
from jax.experimental.layout import Layout
from jax.experimental.layout import with_layout_constraint
import jax.numpy as jnp

from coat_jax import recipes
from coat_jax.models import remat as remat_lib
from coat_jax.models.loss import chunked_cross_entropy
from coat_jax.nn import fsdp
from coat_jax.nn import linear
from coat_jax.nn import partitioning
from coat_jax.nn.mlp import CoatMLP
from coat_jax.nn.norm import CoatRMSNorm
from coat_jax.nn.residuals import xla_quantizes
from pallas_kernels import _common

QK_NORMS = (None, 'head', 'full')
NORM_PLACEMENTS = ('pre', 'post', 'sandwich')
ROPE_TYPES = ('llama3', 'linear')
FULL, SLIDING = 'full', 'sliding'


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE frequency scaling (HF rope_type 'llama3' or 'linear').

  'llama3' (Llama 3.1+): wavelengths longer than
  original_max_position_embeddings / low_freq_factor are stretched by
  `factor`, those shorter than .../ high_freq_factor kept, and the band
  between interpolated smoothly. 'linear' (Gemma 3's global layers): every
  frequency divided by `factor`.
  """

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192
  rope_type: str = 'llama3'

  def __post_init__(self):
    if self.rope_type not in ROPE_TYPES:
      raise ValueError(f'rope_scaling: rope_type={self.rope_type!r} must be'
                       f' one of {ROPE_TYPES}.')
    if self.factor <= 0:
      raise ValueError('rope_scaling: factor must be positive.')
    if self.rope_type != 'llama3':
      return
    if not self.high_freq_factor > self.low_freq_factor > 0:
      raise ValueError(
          f'rope_scaling: high_freq_factor={self.high_freq_factor} must be'
          f' greater than low_freq_factor={self.low_freq_factor} > 0.')
    if self.original_max_position_embeddings <= 0:
      raise ValueError('rope_scaling: original_max_position_embeddings must'
                       ' be positive.')


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  """A decoder-only transformer's architecture.

  The defaults are Llama's; each family's subclass sets its own
  (`coat_jax.models.families`).

  Attributes:
    vocab_size: number of token ids.
    hidden_size: model width H.
    intermediate_size: the gated MLP's width I.
    num_layers: decoder layers.
    num_heads: query heads.
    num_kv_heads: key/value heads (GQA); divides num_heads.
    max_seq_len: length of the RoPE table; longer sequences are rejected.
    head_dim: features per head, or None for hidden_size // num_heads.
    rope_theta: RoPE base (of the full-attention layers).
    rope_scaling: RoPE frequency scaling of the full-attention layers, or
      None (plain RoPE).
    rms_norm_eps: RMSNorm epsilon.
    tie_embeddings: use the embedding table as the LM head.
    init_std: std of the normal initializer of all matrices.
    qkv_bias: the Q/K/V projections have biases (Qwen2).
    qk_norm: RMSNorm of the queries and keys before RoPE: None, 'head'
      (over each head's features: Qwen3, Gemma 3) or 'full' (over all
      heads' features: OLMo 2).
    norm_placement: 'pre' (x + f(norm(x)): Llama), 'post' (x + norm(f(x)):
      OLMo 2) or 'sandwich' (x + norm(f(norm(x))): Gemma 3).
    activation: the MLP's, 'silu' (SwiGLU) or 'gelu_tanh' (GeGLU: Gemma).
    norm_scale_offset: added to every RMSNorm's scale param to make its
      gain: 0, or 1 where checkpoints store gain - 1 (Gemma).
    embed_scale: multiply the embeddings by sqrt(hidden_size) (Gemma).
    query_scale: the attention's softmax scale, or None for
      head_dim ** -0.5 (Gemma 3: query_pre_attn_scalar ** -0.5).
    sliding_window: None (every layer attends to all earlier tokens), or
      the window of the sliding-window layers: a token attends to itself
      and the sliding_window - 1 tokens before it.
    sliding_window_pattern: with sliding_window, None (every layer slides:
      Mistral v0.1) or p (every p-th layer attends fully, the others
      slide: Gemma 3's 6).
    rope_local_theta: the RoPE base of the sliding-window layers (no
      scaling), or None for rope_theta (Gemma 3: 10000).
    scan_layers: run the stacked decoder layers under `jax.lax.scan`
      (compile time independent of depth) instead of unrolled. Unrolled,
      the default, is faster in every recipe (XLA fuses and schedules
      across layers) and with FP8 keeps less (a scan's backward stacks
      every layer's weight gradient beside the stacked residuals;
      benchmarks/RESULTS.md "e2e-1b"). Layers of different kinds (sliding
      and full) run unrolled only.
    remat: the layer stack's remat policy, one of `remat.POLICIES`
      ('none', 'minimal', 'minimal_offloaded', 'full'; see
      `coat_jax.models.remat` for what each keeps), for scanned and unrolled
      layers alike, or 'auto' (the default, `remat.resolve`).
  """

  FAMILY: ClassVar[str | None] = None  # set by each family's subclass

  vocab_size: int = 32000
  hidden_size: int = 4096
  intermediate_size: int = 11008
  num_layers: int = 32
  num_heads: int = 32
  num_kv_heads: int = 32
  max_seq_len: int = 4096
  head_dim: int | None = None
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  rms_norm_eps: float = 1e-5
  tie_embeddings: bool = False
  init_std: float = 0.02
  qkv_bias: bool = False
  qk_norm: str | None = None
  norm_placement: str = 'pre'
  activation: str = 'silu'
  norm_scale_offset: float = 0.0
  embed_scale: bool = False
  query_scale: float | None = None
  sliding_window: int | None = None
  sliding_window_pattern: int | None = None
  rope_local_theta: float | None = None
  scan_layers: bool = False
  remat: str = remat_lib.DEFAULT

  def __post_init__(self):
    for name in ('vocab_size', 'hidden_size', 'intermediate_size',
                 'num_layers', 'num_heads', 'num_kv_heads', 'max_seq_len'):
      _check_positive(name, getattr(self, name))
    for name in ('head_dim', 'sliding_window', 'sliding_window_pattern'):
      if getattr(self, name) is not None:
        _check_positive(name, getattr(self, name))
    if self.head_dim is None and self.hidden_size % self.num_heads:
      raise ValueError(
          f'hidden_size={self.hidden_size} must be a multiple of'
          f' num_heads={self.num_heads} (or set head_dim).')
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f'num_heads={self.num_heads} must be a multiple of'
          f' num_kv_heads={self.num_kv_heads} (grouped-query attention).')
    if self.head_features % 2:
      raise ValueError(f'head_dim={self.head_features} must be even for'
                       ' RoPE.')
    for name, value, allowed in (
        ('qk_norm', self.qk_norm, QK_NORMS),
        ('norm_placement', self.norm_placement, NORM_PLACEMENTS),
        ('activation', self.activation, ('silu', 'gelu_tanh'))):
      if value not in allowed:
        raise ValueError(f'{name}={value!r} must be one of {allowed}.')
    if self.sliding_window_pattern is not None and self.sliding_window is None:
      raise ValueError('sliding_window_pattern needs sliding_window (the'
                       ' window of the other layers).')
    remat_lib.check_policy(self.remat)
    if not isinstance(self.scan_layers, bool):
      raise ValueError(
          f'scan_layers={self.scan_layers!r} must be True or False.')
    if self.scan_layers and len(set(self.layer_types)) > 1:
      raise ValueError(
          'scan_layers=True needs every layer alike; this model interleaves'
          f' sliding-window and full-attention layers (sliding_window='
          f'{self.sliding_window}, sliding_window_pattern='
          f'{self.sliding_window_pattern}): set scan_layers=False.')

  @property
  def head_features(self) -> int:
    """Features per head: head_dim, or hidden_size // num_heads."""
    return self.head_dim or self.hidden_size // self.num_heads

  @property
  def layer_types(self) -> tuple[str, ...]:
    """Each layer's attention, FULL or SLIDING, in order."""
    if self.sliding_window is None:
      return (FULL,) * self.num_layers
    p = self.sliding_window_pattern
    return tuple(FULL if p is not None and (i + 1) % p == 0 else SLIDING
                 for i in range(self.num_layers))

  @classmethod
  def preset(cls, name: str, **overrides: Any) -> 'DecoderConfig':
    """The family's named configuration, with optional field overrides."""
    presets = getattr(cls, 'PRESETS', {})
    if name not in presets:
      raise ValueError(
          f'{cls.__name__}: preset {name!r} is unknown: use one of'
          f' {sorted(presets)}.')
    return cls(**{**presets[name], **overrides})


def _check_positive(name: str, value: Any) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
    raise ValueError(f'{name}={value!r} must be a positive int.')


def rope_tables(
    seq_len: int, head_dim: int, theta: float,
    scaling: RopeScaling | None = None,
) -> tuple[jax.Array, jax.Array]:
  """cos and sin of the rotary angles, each (seq_len, head_dim // 2) f32."""
  inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32)
                       / head_dim)
  if scaling is not None and scaling.rope_type == 'linear':
    inv_freq = inv_freq / scaling.factor
  elif scaling is not None:
    inv_freq = _llama3_inv_freq(inv_freq, scaling)
  angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq
  return jnp.cos(angles), jnp.sin(angles)


def _llama3_inv_freq(inv_freq: jax.Array, s: RopeScaling) -> jax.Array:
  """HF transformers' `_compute_llama3_parameters`, in float32."""
  old = s.original_max_position_embeddings
  wavelen = 2 * jnp.pi / inv_freq
  scaled = jnp.where(wavelen > old / s.low_freq_factor, inv_freq / s.factor,
                     inv_freq)
  smooth = ((old / wavelen - s.low_freq_factor)
            / (s.high_freq_factor - s.low_freq_factor))
  smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
  medium = ((wavelen >= old / s.high_freq_factor)
            & (wavelen <= old / s.low_freq_factor))
  return jnp.where(medium, smoothed, scaled)


def layer_rope_tables(config: DecoderConfig, seq_len: int
                      ) -> dict[str, tuple[jax.Array, jax.Array]]:
  """{layer type: (cos, sin)} for the layer types the model has."""
  tables = {}
  for kind in set(config.layer_types):
    if kind == SLIDING and config.rope_local_theta is not None:
      tables[kind] = rope_tables(seq_len, config.head_features,
                                 config.rope_local_theta)
    else:
      tables[kind] = rope_tables(seq_len, config.head_features,
                                 config.rope_theta, config.rope_scaling)
  return tables


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotates halves of the head dimension (HF's `rotate_half`).

  Args:
    x: (B, S, N, D).
    cos: (S, D // 2).
    sin: (S, D // 2).

  Returns:
    (B, S, N, D) in x.dtype, computed in float32.
  """
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  c = cos[None, :, None, :]
  s = sin[None, :, None, :]
  out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
  return out.astype(x.dtype)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                     window: int | None = None,
                     scale: float | None = None) -> jax.Array:
  """Causal GQA attention through `jax.nn.dot_product_attention`.

  `implementation=None` there always means XLA (jax <= 0.11), which saves
  the (B, N, S, S) probabilities; on GPU this asks for cuDNN flash attention
  (saves q, k, v, o and row statistics) and falls back to XLA where cuDNN
  rejects the shapes or dtypes, or cannot differentiate them (odd lengths).

  Args:
    q: (B, S, N, D); k, v: (B, S, K, D) with N a multiple of K.
    window: None, or attend to the window - 1 tokens before each token and
      itself only (a sliding-window layer).
    scale: the softmax scale, or None for D ** -0.5.

  Returns:
    (B, S, N, D) in q.dtype.
  """
  return _causal_attention(q, k, v, window=window, scale=scale)[0]


def _causal_attention(q, k, v, *, window=None, scale=None
                      ) -> tuple[jax.Array, bool]:
  """(`causal_attention(q, k, v)`, whether its backward keeps the output:
  True for cuDNN flash attention)."""
  kwargs = dict(is_causal=True, scale=scale,
                local_window_size=None if window is None else (window - 1, 0))
  # cuDNN's flash attention has no backward for odd lengths, and jax says
  # so only when the step is differentiated, too late to fall back here.
  if jax.default_backend() == 'gpu' and not (q.shape[1] % 2
                                             or k.shape[1] % 2):
    try:
      return jax.nn.dot_product_attention(q, k, v, implementation='cudnn',
                                          **kwargs), True
    except (ValueError, NotImplementedError, RuntimeError, TypeError):
      pass
  return jax.nn.dot_product_attention(q, k, v, **kwargs), False


class Attention(nnx.Module):
  """Causal GQA self-attention with RoPE; projections are CoatLinear.

  With the recipe's fuse_qkv, q/k/v_proj run as one fused FP8 projection.
  Optional: Q/K/V biases, RMSNorm of the queries and keys (per head or over
  all heads' features), a custom softmax scale (`DecoderConfig`).
  """

  def __init__(self, config: DecoderConfig, *,
               recipe: recipes.Recipe | str, dtype: Any, param_dtype: Any,
               implementation: str | None, rngs: nnx.Rngs):
    recipe = recipes.get(recipe)
    h, d = config.hidden_size, config.head_features
    kw = dict(dtype=dtype, param_dtype=param_dtype, recipe=recipe,
              implementation=implementation,
              kernel_init=nnx.initializers.normal(config.init_std), rngs=rngs)
    qkv = dict(use_bias=config.qkv_bias, **kw)
    self.q_proj = linear.CoatLinear(
        h, config.num_heads * d, kernel_axes=('embed', 'heads'), **qkv)
    self.k_proj = linear.CoatLinear(
        h, config.num_kv_heads * d, kernel_axes=('embed', 'kv_heads'), **qkv)
    self.v_proj = linear.CoatLinear(
        h, config.num_kv_heads * d, kernel_axes=('embed', 'kv_heads'), **qkv)
    self.o_proj = linear.CoatLinear(
        config.num_heads * d, h, use_bias=False,
        kernel_axes=('heads', 'embed'), **kw)
    if config.qk_norm is not None:
      per_head = config.qk_norm == 'head'
      norm = functools.partial(
          CoatRMSNorm, epsilon=config.rms_norm_eps, dtype=dtype,
          param_dtype=param_dtype, recipe=recipe, scale_axes=('norm',),
          scale_offset=config.norm_scale_offset, rngs=rngs)
      self.q_norm = norm(d if per_head else config.num_heads * d)
      self.k_norm = norm(d if per_head else config.num_kv_heads * d)
    self.num_heads = config.num_heads
    self.num_kv_heads = config.num_kv_heads
    self.head_dim = d
    self.qk_norm = config.qk_norm
    self.query_scale = config.query_scale
    self.fuse_qkv = recipe.fuse_qkv

  def __call__(self, x: jax.Array, rope: tuple[jax.Array, jax.Array], *,
               window: int | None = None, reuse_output: bool = True,
               x_amax: jax.Array | None = None,
               residual: jax.Array | None = None,
               grad_amax_slot: bool = False):
    """(B, S, H) -> (B, S, H); rope: (cos, sin), each (S, head_dim // 2).

    window: None, or this layer's sliding window (`causal_attention`).
    reuse_output: where flash attention keeps its output o for backward,
    the out projection saves that o instead of an FP8 copy of its own.
    x_amax: max |x| if its producer computed it (`fp8_dense`). residual:
    None, or (B, S, H) added in the out projection (`CoatLinear`).
    grad_amax_slot: return (output, the out projection's slot)
    (`fp8_dense`).
    """
    b, s, _ = x.shape
    q, k, v = remat_lib.name(
        linear.fanout(x, [self.q_proj, self.k_proj, self.v_proj],
                      fused=self.fuse_qkv, x_amax=x_amax),
        remat_lib.QKV_PROJ)
    if self.qk_norm == 'full':
      q, k = self.q_norm(q), self.k_norm(k)
    q = q.reshape(b, s, self.num_heads, self.head_dim)
    k = k.reshape(b, s, self.num_kv_heads, self.head_dim)
    v = v.reshape(b, s, self.num_kv_heads, self.head_dim)
    if self.qk_norm == 'head':
      q, k = self.q_norm(q), self.k_norm(k)
    q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    o, o_kept = _causal_attention(q, k, v, window=window,
                                  scale=self.query_scale)
    o = remat_lib.name(o, remat_lib.ATTENTION)
    return remat_lib.name(
        self.o_proj(o.reshape(b, s, self.num_heads * self.head_dim),
                    reuse_input=reuse_output and o_kept, residual=residual,
                    grad_amax_slot=grad_amax_slot),
        remat_lib.OUT_PROJ)


class DecoderLayer(nnx.Module):
  """One block: attention, then the gated MLP, each with a skip connection
  and its norms where `config.norm_placement` puts them: 'pre' (x +
  attn(norm(x)), then h + mlp(norm(h))), 'post' (x + norm(attn(x)), ...) or
  'sandwich' (x + norm(attn(norm(x))), ...)."""

  def __init__(self, config: DecoderConfig, *,
               recipe: recipes.Recipe | str, dtype: Any, param_dtype: Any,
               implementation: str | None, rngs: nnx.Rngs):
    recipe = recipes.get(recipe)
    kw = dict(recipe=recipe, dtype=dtype, param_dtype=param_dtype)
    norm = functools.partial(
        CoatRMSNorm, config.hidden_size, epsilon=config.rms_norm_eps,
        scale_axes=('norm',), scale_offset=config.norm_scale_offset,
        rngs=rngs, **kw)
    placement = config.norm_placement
    if placement != 'post':
      self.attn_norm = norm()
    self.attn = Attention(config, rngs=rngs, implementation=implementation,
                          **kw)
    if placement != 'post':
      self.mlp_norm = norm()
    if placement != 'pre':
      self.attn_post_norm = norm()
      self.mlp_post_norm = norm()
    self.mlp = CoatMLP(
        config.hidden_size, config.intermediate_size,
        activation=config.activation,
        kernel_init=nnx.initializers.normal(config.init_std),
        rngs=rngs, implementation=implementation, **kw)
    self.norm_placement = placement
    # The out and down projections hand the norms after them a slot for
    # max |dx| (`coat_jax.nn.norm`), where both are FP8 with one scale and
    # the norms' kernels run (one Hopper GPU). Where XLA quantizes (several
    # devices), XLA fuses the projections' own amax passes into the norms'
    # backward fusions anyway, and with slots it kept more
    # (docs/decisions.md#comment-figures).
    self.grad_amax_slots = (recipe.fp8_matmuls and recipe.fp8_activations
                            and recipe.scaling == 'tensor'
                            and placement == 'pre' and not xla_quantizes())

  def __call__(self, x: jax.Array, rope: tuple[jax.Array, jax.Array], *,
               window: int | None = None,
               reuse_attention_output: bool = True,
               grad_amax_slot: jax.Array | None = None
               ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """(B, S, H) bf16 residual stream -> same. rope: (cos, sin) of this
    layer; window: its sliding window or None. reuse_attention_output: see
    `Attention`. grad_amax_slot (`grad_amax_slots` layers): the slot that
    came with x from the previous layer's down projection (or a float32
    zero); then returns (x, the down projection's slot), for whatever
    reads x next (the next layer, `fill_grad_amax_slot`)."""
    attn = functools.partial(self.attn, rope=rope, window=window,
                             reuse_output=reuse_attention_output)
    if self.norm_placement != 'pre':
      if self.norm_placement == 'sandwich':
        h = self.attn_post_norm(attn(self.attn_norm(x)))
      else:
        h = self.attn_post_norm(attn(x))
      x = x + h
      h = self.mlp(self.mlp_norm(x) if self.norm_placement == 'sandwich'
                   else x)
      return x + self.mlp_post_norm(h)
    # The skip connections are added in the out and down projections, in
    # their GEMMs' epilogues where the kernel has one (`CoatLinear`).
    slots = self.grad_amax_slots
    x, h, h_amax = self.attn_norm.with_input(x, grad_amax_slot=grad_amax_slot)
    out = attn(h, x_amax=h_amax, residual=x, grad_amax_slot=slots)
    x, slot = out if slots else (out, None)
    x, h, h_amax = self.mlp_norm.with_input(x, grad_amax_slot=slot)
    return self.mlp(h, x_amax=h_amax, residual=x,
                    grad_amax_slot=grad_amax_slot is not None)


class LayerFeed:
  """Where unrolled layers read their params: the in-backward step's
  carrier (`training.in_backward`).

  `read(i, source) -> (source, layer i's params tree)` runs inside layer
  i's remat. Under remat 'full', `recompute` (if given) runs the layer
  instead: `recompute(i, source, fn, stream) -> (source, fn(params,
  stream))`, with fn's backward its own (recomputing fn in backward from
  the params its source then holds). `Decoder.hidden_states` threads
  `source` through the layers in order and leaves the last one in
  `source`, a value of the caller's trace.
  """

  def __init__(self, source: Any,
               read: Callable[[int, Any], tuple[Any, Any]],
               recompute: Callable[..., tuple[Any, Any]] | None = None):
    self.source = source
    self.read = read
    self.recompute = recompute


class Decoder(nnx.Module):
  """A decoder-only language model: int tokens (B, S) -> logits (B, S, V).

  Args:
    config: the architecture (a family's `DecoderConfig`).
    recipe: a `coat_jax.Recipe` or a preset name (default `recipes.COAT`).
    dtype: activation dtype (bfloat16).
    param_dtype: parameter dtype (float32 master weights).
    implementation: `fp8_matmul` implementation ('xla', 'pallas', None).
    rngs: random number generators.
    precision: the older name of `recipe` (a preset name).

  Params: `embed` (V, H), `layers` (every layer's params stacked along a
  leading num_layers axis), `norm`, and `lm_head` (H, V) unless the
  embeddings are tied.
  """

  def __init__(self, config: DecoderConfig, *,
               recipe: recipes.Recipe | str | None = None,
               dtype: Any = jnp.bfloat16, param_dtype: Any = jnp.float32,
               implementation: str | None = None, rngs: nnx.Rngs,
               precision: str | None = None):
    recipe = recipes.from_arguments(recipe, precision)
    recipe.check_size('config.hidden_size', config.hidden_size)
    recipe.check_size('config.intermediate_size', config.intermediate_size)
    recipe.check_size('config.vocab_size', config.vocab_size, part='head')
    recipe.check_size('config.hidden_size', config.hidden_size, part='head')
    recipe.check_size('config.num_kv_heads * head_dim',
                      config.num_kv_heads * config.head_features)
    recipe.check_size('config.num_heads * head_dim',
                      config.num_heads * config.head_features)
    init = nnx.initializers.normal(config.init_std)
    self.embed = partitioning.make_param(
        init, rngs.params(), (config.vocab_size, config.hidden_size),
        param_dtype, ('vocab', 'embed'))

    @nnx.split_rngs(splits=config.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0,
              transform_metadata={nnx.PARTITION_NAME: None})
    def make_layers(rngs):
      return DecoderLayer(config, recipe=recipe, dtype=dtype,
                          param_dtype=param_dtype,
                          implementation=implementation, rngs=rngs)

    self.layers = make_layers(rngs)
    # The final norm is BF16 in every recipe (as in COAT).
    self.norm = CoatRMSNorm(
        config.hidden_size, epsilon=config.rms_norm_eps, dtype=dtype,
        param_dtype=param_dtype, recipe=recipes.BF16, scale_axes=('norm',),
        scale_offset=config.norm_scale_offset, rngs=rngs)
    if config.tie_embeddings:
      self.lm_head = nnx.data(None)
    else:
      self.lm_head = partitioning.make_param(
          init, rngs.params(), (config.hidden_size, config.vocab_size),
          param_dtype, ('embed', 'vocab'))
    self.config = config
    self.recipe = recipe
    # The policy the layer stack runs ('auto' resolved for this recipe).
    self.remat = remat_lib.resolve(config.remat, recipe, config.scan_layers)
    self.dtype = dtype

  def head_kernel(self) -> jax.Array:
    """The (H, V) output projection (the embedding's transpose if tied)."""
    if self.lm_head is None:
      return fsdp.gather_weight(self.embed[...]).T
    return fsdp.gather_weight(self.lm_head[...])

  def hidden_states(self, tokens: jax.Array,
                    layers: Sequence[Any] | LayerFeed | None = None,
                    prefix: jax.Array | None = None) -> jax.Array:
    """int tokens (B, S) -> final normed hidden states (B, S, H) in dtype.

    `layers` (unrolled layers only): num_layers trees, each one layer's
    params (the stacked params' tree, sliced), used in place of slices of
    the stacked params, so that gradients with respect to them come per
    layer and are never stacked (`fused_coat_adamw` steps each layer of the
    stack in place); or a `LayerFeed`, read inside each layer's remat.

    `prefix`: None, or (B, P, H) floating embeddings (a vision-language
    model's image tokens) placed before the token embeddings, cast to dtype
    and not scaled by `embed_scale`; the positions (RoPE, causal mask) run
    over all P + S, and the result is (B, P + S, H).
    """
    config = self.config
    seq = _check_tokens(tokens, config, prefix)
    if isinstance(layers, LayerFeed) and config.scan_layers:
      raise ValueError('layers: a LayerFeed needs scan_layers=False.')
    if layers is not None and not isinstance(layers, LayerFeed) and (
        config.scan_layers or len(layers) != config.num_layers):
      raise ValueError(
          f'layers: {len(layers)} per-layer param trees given; they need'
          f' scan_layers=False (got {config.scan_layers}) and one tree'
          f' per layer ({config.num_layers}).')
    # Under an FSDP mesh the residual stream stays batch-sharded, so each
    # layer gathers its weights rather than moving activations.
    x = _embed(self.embed[...], tokens, self.dtype)
    if config.embed_scale:
      x = x * jnp.asarray(math.sqrt(config.hidden_size), self.dtype)
    if prefix is not None:
      x = jnp.concatenate([prefix.astype(self.dtype), x], axis=1)
    x = fsdp.shard_batch(x)
    ropes = layer_rope_tables(config, seq)

    # Unrolled, the residual stream travels with the slot of the
    # projection that wrote it last (`DecoderLayer`); the first layer's is
    # a zero whose cotangent nothing takes, the last layer's is filled
    # before the final (BF16) norm. Scanned layers use slots only within a
    # layer: one in the scan's carry made XLA keep more
    # (docs/decisions.md#comment-figures).
    slots = self.layers.grad_amax_slots and not config.scan_layers
    stream = (x, jnp.zeros((), jnp.float32) if slots else None)
    graphdef, stacked = nnx.split(self.layers)
    if config.scan_layers:
      stream = self._scan_layers(
          graphdef, stacked, stream,
          _layer_kwargs(config, ropes, config.layer_types[0]))
    elif isinstance(layers, LayerFeed):
      stream = self._fed_layers(graphdef, layers, stream, ropes)
    else:
      # One function per layer type, so that remat traces each once.
      apply_layer = {
          kind: remat_lib.apply(
              _apply_layer(**_layer_kwargs(config, ropes, kind)), self.remat,
              in_scan=False)
          for kind in ropes}
      for i, kind in enumerate(config.layer_types):
        layer = nnx.merge(graphdef, jax.tree.map(lambda a: a[i], stacked)
                          if layers is None else layers[i])
        stream = _shard_batch(apply_layer[kind](layer, stream))
    x, slot = stream
    return self.norm(x if slot is None
                     else linear.fill_grad_amax_slot(x, slot))

  def _fed_layers(self, graphdef, feed: LayerFeed, stream, ropes):
    """The unrolled layers applied to the stream, each reading its params
    from `feed` inside its remat (traced once per layer: `feed.read` takes
    a static index); the last source is left in `feed.source`."""
    config = self.config
    runs = {kind: _apply_layer(**_layer_kwargs(config, ropes, kind))
            for kind in ropes}

    def layer(i, run):
      if self.remat == 'full' and feed.recompute is not None:
        fn = lambda params, stream: run(nnx.merge(graphdef, params), stream)
        return lambda source, stream: feed.recompute(i, source, fn, stream)

      def apply(source, stream):
        source, params = feed.read(i, source)
        return source, run(nnx.merge(graphdef, params), stream)
      return remat_lib.apply(apply, self.remat, in_scan=False)

    source = feed.source
    for i, kind in enumerate(config.layer_types):
      source, stream = layer(i, runs[kind])(source, stream)
      stream = _shard_batch(stream)
    feed.source = source
    return stream

  def _scan_layers(self, graphdef, stacked, stream, layer_kwargs):
    """The stacked layers applied to the stream (x, slot or None) under
    `jax.lax.scan`.

    Scan's backward stacks every layer's param gradients (L x params),
    allocated whole while every residual is live (the train step's peak;
    unrolled layers hold a few layers' gradients there). So each param
    enters the scan twice: float32 without gradient (what each layer reads)
    and as a bf16 copy that only carries the gradient (`_cast_param` never
    reads its value; XLA drops it). Backward then stacks bf16 gradients,
    cast to float32 after the loop: half the stack. Without FP8 matmuls
    they are bf16-valued anyway (same bits); with them the wgrads are
    rounded to bf16 (8 bits of mantissa, as a BF16 model's; the FP8 moments
    keep 3). docs/decisions.md#comment-figures has the temp sizes.

    The out projections save their own FP8 copy of the attention output:
    saving flash attention's o instead stacks o a second time under scan.

    With FP8 matmuls each layer reads its weights row-major on one device
    (`_row_major_weights`).
    """
    xs = (jax.lax.stop_gradient(stacked),
          jax.tree.map(lambda a: a.astype(self.dtype), stacked))
    if not self.recipe.fp8_matmuls:
      params = lambda xs: jax.tree.map(
          lambda w, c: _cast_param(w, c, c.dtype), *xs)
    else:
      params = lambda xs: _row_major_weights(jax.tree.map(
          lambda w, c: _cast_param(w, c, w.dtype), *xs))
    run = _apply_layer(reuse_attention_output=False, **layer_kwargs)
    apply_layer = remat_lib.apply(
        lambda xs, stream: run(nnx.merge(graphdef, params(xs)), stream),
        self.remat, in_scan=True)

    def body(stream, xs):
      return _shard_batch(apply_layer(xs, stream)), None

    return jax.lax.scan(body, stream, xs)[0]

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """int tokens (B, S) -> float32 logits (B, S, V)."""
    h = self.hidden_states(tokens)
    return jnp.dot(h, self.head_kernel().astype(self.dtype),
                   preferred_element_type=jnp.float32)


def _layer_kwargs(config: DecoderConfig, ropes: dict, kind: str) -> dict:
  """The static call arguments of a layer of type `kind`: its RoPE tables
  and window."""
  return dict(rope=ropes[kind],
              window=config.sliding_window if kind == SLIDING else None)


def _apply_layer(**kwargs):
  """(layer, (x, slot or None)) -> the same pair after the layer."""
  def apply(layer, stream):
    x, slot = stream
    if slot is None:
      return layer(x, **kwargs), None
    return layer(x, grad_amax_slot=slot, **kwargs)
  return apply


def _shard_batch(stream):
  """(x, slot) with x batch-sharded under an FSDP mesh (`fsdp.shard_batch`)."""
  x, slot = stream
  return fsdp.shard_batch(x), slot


def _embed(table: jax.Array, tokens: jax.Array, dtype) -> jax.Array:
  """table[tokens] in dtype: (B, S, H) rows of the (V, H) table.

  Under an FSDP mesh each device looks its rows up in its slice of the
  table (`fsdp.embed_lookup`). Under Explicit mesh axes the table is
  gathered whole first and the rows take the tokens' sharding (jax asks
  for the gather's out_sharding there); elsewhere a plain `jnp.take`.
  """
  rows = fsdp.embed_lookup(table, tokens, dtype)
  if rows is not None:
    return rows
  table = fsdp.gather_weight(table)
  spec = _common.explicit_spec(tokens)
  if spec is None:
    return jnp.take(table, tokens, axis=0).astype(dtype)
  return table.at[tokens].get(
      mode='fill', out_sharding=jax.sharding.PartitionSpec(*spec, None)
  ).astype(dtype)


def _row_major_weights(params):
  """A scanned layer's params with each matrix (its weights) laid out
  row-major where the layer reads them (an XLA layout constraint), on one
  device (no mesh, or a mesh of one); unchanged on several.

  Without it XLA lays the stacked float32 weights out transposed for the
  whole loop, so that its FP8 weight quantizer writes W^T in order: a
  transposed copy of every stacked weight before the loop, alive through
  it (docs/decisions.md#comment-figures). On several devices the SPMD
  partitioner would gather each weight whole for the constraint (a custom
  call), so the scan does without it there.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if not (mesh.empty or mesh.size == 1):
    return params

  def row_major(a):
    if a.ndim < 2 or not jnp.issubdtype(a.dtype, jnp.floating):
      return a
    return with_layout_constraint(a, Layout(tuple(range(a.ndim))))
  return jax.tree.map(row_major, params)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _cast_param(w: jax.Array, carrier: jax.Array, dtype) -> jax.Array:
  """w cast to dtype; the tangent is carrier's, cast to dtype (w's is
  dropped), and carrier's value is never read."""
  del carrier
  return w.astype(dtype)


@_cast_param.defjvp
def _cast_param_jvp(dtype, primals, tangents):
  w, _ = primals
  return w.astype(dtype), tangents[1].astype(dtype)


def _check_tokens(tokens: Any, config: DecoderConfig,
                  prefix: Any = None) -> int:
  """The sequence length of tokens, after the prefix if one is given (P +
  S); raises on bad tokens or prefix."""
  dtype = getattr(tokens, 'dtype', None)
  if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(
        f'tokens has dtype {dtype}; it must be an integer array of token ids'
        ' (e.g. tokens.astype(jnp.int32)).')
  if tokens.ndim != 2:
    raise ValueError(
        f'tokens has shape {tokens.shape}; expected (batch, seq) (add a batch'
        ' axis with tokens[None]).')
  seq = tokens.shape[1]
  if prefix is not None:
    batch, hidden = tokens.shape[0], config.hidden_size
    if (getattr(prefix, 'ndim', None) != 3
        or (prefix.shape[0], prefix.shape[2]) != (batch, hidden)
        or not jnp.issubdtype(prefix.dtype, jnp.floating)):
      raise ValueError(
          f'prefix has shape {getattr(prefix, "shape", None)} and dtype'
          f' {getattr(prefix, "dtype", None)}; expected floating embeddings'
          f' of shape (batch={batch}, prefix length, hidden_size={hidden}).')
    seq += prefix.shape[1]
  if seq > config.max_seq_len:
    what = 'tokens' if prefix is None else 'prefix + tokens'
    raise ValueError(
        f'{what} has sequence length {seq}, longer than the RoPE table'
        f' (config.max_seq_len={config.max_seq_len}); shorten the sequence or'
        f' raise max_seq_len (e.g. dataclasses.replace(config,'
        f' max_seq_len={seq})).')
  return seq


def lm_loss(model: Decoder, tokens: jax.Array, targets: jax.Array, *,
            chunk_size: int = 2048,
            layers: Sequence[Any] | LayerFeed | None = None) -> jax.Array:
  """Mean next-token cross entropy, without materializing all logits.

  Args:
    model: a Decoder.
    tokens: (B, S) integer inputs.
    targets: (B, S) integer next tokens; negative ids are ignored.
    chunk_size: tokens per chunk of (chunk_size, V) float32 logits.
    layers: per-layer params of unrolled layers, or a `LayerFeed`
      (`Decoder.hidden_states`).

  Returns:
    float32 scalar: summed loss / number of targets >= 0 (0 if none).
  """
  if getattr(targets, 'shape', None) != getattr(tokens, 'shape', None):
    raise ValueError(
        f'targets has shape {getattr(targets, "shape", None)}; expected the'
        f' shape of tokens {getattr(tokens, "shape", None)}.')
  hidden = model.hidden_states(tokens, layers)
  loss_sum, count = chunked_cross_entropy(
      hidden, model.head_kernel(), targets, chunk_size=chunk_size,
      dtype=model.dtype, fp8_grad_dtype=model.recipe.head_grad_dtype)
  return loss_sum / jnp.maximum(count, 1.0)
