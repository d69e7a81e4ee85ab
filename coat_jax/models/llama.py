"""Llama (RMSNorm, RoPE, GQA, SwiGLU) in three precision modes.

The modes ('bf16', 'fp8_linear', 'coat'; see `coat_jax.nn.precision`) share
this code; only the layer implementations differ. Residual stream, RoPE and
attention (`jax.nn.dot_product_attention`: cuDNN flash attention on GPU where
it accepts the shapes, XLA elsewhere) are BF16; embeddings, final norm, LM
head and loss are BF16 with float32 statistics; params are float32.
"""

from collections.abc import Sequence
import dataclasses
import functools
from typing import Any

from flax import nnx
import jax
from jax.experimental.layout import Layout
from jax.experimental.layout import with_layout_constraint
import jax.numpy as jnp

from coat_jax.models import remat as remat_lib
from coat_jax.models.loss import chunked_cross_entropy
from coat_jax.nn import fsdp
from coat_jax.nn import linear
from coat_jax.nn import partitioning
from coat_jax.nn import precision as precision_lib
from coat_jax.nn.mlp import CoatMLP
from coat_jax.nn.norm import CoatRMSNorm
from coat_jax.nn.residuals import xla_quantizes
from pallas_kernels import _common

_PRESETS = {
    'tiny': dict(vocab_size=256, hidden_size=64, intermediate_size=176,
                 num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=256),
    '125m': dict(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                 num_layers=12, num_heads=12, num_kv_heads=12,
                 max_seq_len=2048, tie_embeddings=True),
    '1b': dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
               num_layers=22, num_heads=32, num_kv_heads=4, max_seq_len=2048),
    'llama2_7b': dict(vocab_size=32000, hidden_size=4096,
                      intermediate_size=11008, num_layers=32, num_heads=32,
                      num_kv_heads=32, max_seq_len=4096),
    'llama2_13b': dict(vocab_size=32000, hidden_size=5120,
                       intermediate_size=13824, num_layers=40, num_heads=40,
                       num_kv_heads=40, max_seq_len=4096),
}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama 3's RoPE frequency scaling (HF rope_type 'llama3').

  Wavelengths longer than original_max_position_embeddings / low_freq_factor
  are stretched by `factor`, those shorter than .../ high_freq_factor kept,
  and the band between interpolated smoothly.
  """

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

  def __post_init__(self):
    if not self.high_freq_factor > self.low_freq_factor > 0:
      raise ValueError(
          f'rope_scaling: high_freq_factor={self.high_freq_factor} must be'
          f' greater than low_freq_factor={self.low_freq_factor} > 0.')
    if self.factor <= 0 or self.original_max_position_embeddings <= 0:
      raise ValueError('rope_scaling: factor and'
                       ' original_max_position_embeddings must be positive.')


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Llama architecture.

  Attributes:
    vocab_size: number of token ids.
    hidden_size: model width H.
    intermediate_size: SwiGLU width I.
    num_layers: decoder layers.
    num_heads: query heads; H must be a multiple of it.
    num_kv_heads: key/value heads (GQA); divides num_heads.
    max_seq_len: length of the RoPE table; longer sequences are rejected.
    rope_theta: RoPE base.
    rope_scaling: Llama 3 frequency scaling, or None (plain RoPE).
    rms_norm_eps: RMSNorm epsilon.
    tie_embeddings: use the embedding table as the LM head.
    init_std: std of the normal initializer of all matrices.
    scan_layers: run the stacked decoder layers under `jax.lax.scan`
      (compile time independent of depth) instead of unrolled. Unrolled,
      the default, is faster in every precision (XLA fuses and schedules
      across layers) and in the FP8 modes keeps less (a scan's backward
      stacks every layer's weight gradient beside the stacked residuals);
      1b on an H200: benchmarks/RESULTS.md "e2e-1b".
    remat: the layer stack's remat policy, one of `remat.POLICIES`
      ('none', 'minimal', 'minimal_offloaded', 'full'; see
      `coat_jax.models.remat` for what each keeps), for scanned and unrolled
      layers alike, or 'auto' (the default): 'full' for scanned layers,
      'none' for unrolled layers in 'coat' mode, 'minimal' for the other
      unrolled ones (`remat.resolve`).
  """

  vocab_size: int = 32000
  hidden_size: int = 4096
  intermediate_size: int = 11008
  num_layers: int = 32
  num_heads: int = 32
  num_kv_heads: int = 32
  max_seq_len: int = 4096
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  rms_norm_eps: float = 1e-5
  tie_embeddings: bool = False
  init_std: float = 0.02
  scan_layers: bool = False
  remat: str = remat_lib.DEFAULT

  def __post_init__(self):
    for name in ('vocab_size', 'hidden_size', 'intermediate_size',
                 'num_layers', 'num_heads', 'num_kv_heads', 'max_seq_len'):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f'{name}={value!r} must be a positive int.')
    if self.hidden_size % self.num_heads:
      raise ValueError(
          f'hidden_size={self.hidden_size} must be a multiple of'
          f' num_heads={self.num_heads}.')
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f'num_heads={self.num_heads} must be a multiple of'
          f' num_kv_heads={self.num_kv_heads} (grouped-query attention).')
    if self.head_dim % 2:
      raise ValueError(f'head_dim={self.head_dim} must be even for RoPE.')
    remat_lib.check_policy(self.remat)
    if not isinstance(self.scan_layers, bool):
      raise ValueError(
          f'scan_layers={self.scan_layers!r} must be True or False.')

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_heads

  @classmethod
  def preset(cls, name: str, **overrides: Any) -> 'LlamaConfig':
    """A named configuration ('tiny', '125m', '1b', 'llama2_7b',
    'llama2_13b'), with optional field overrides."""
    if name not in _PRESETS:
      raise ValueError(
          f'preset {name!r} is unknown: use one of {sorted(_PRESETS)}.')
    return cls(**{**_PRESETS[name], **overrides})


def rope_tables(
    seq_len: int, head_dim: int, theta: float,
    scaling: RopeScaling | None = None,
) -> tuple[jax.Array, jax.Array]:
  """cos and sin of the rotary angles, each (seq_len, head_dim // 2) f32."""
  inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32)
                       / head_dim)
  if scaling is not None:
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


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotates halves of the head dimension (HF Llama's `rotate_half`).

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


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
  """Causal GQA attention through `jax.nn.dot_product_attention`.

  `implementation=None` there always means XLA (jax <= 0.11), which saves
  the (B, N, S, S) probabilities; on GPU this asks for cuDNN flash attention
  (saves q, k, v, o and row statistics) and falls back to XLA where cuDNN
  rejects the shapes or dtypes.

  Args:
    q: (B, S, N, D); k, v: (B, S, K, D) with N a multiple of K.

  Returns:
    (B, S, N, D) in q.dtype.
  """
  return _causal_attention(q, k, v)[0]


def _causal_attention(q, k, v) -> tuple[jax.Array, bool]:
  """(`causal_attention(q, k, v)`, whether its backward keeps the output:
  True for cuDNN flash attention)."""
  if jax.default_backend() == 'gpu':
    try:
      return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                          implementation='cudnn'), True
    except (ValueError, NotImplementedError, RuntimeError, TypeError):
      pass
  return jax.nn.dot_product_attention(q, k, v, is_causal=True), False


class Attention(nnx.Module):
  """Causal GQA self-attention with RoPE; projections are CoatLinear.

  fuse_qkv: in FP8 modes q/k/v_proj run as one fused projection (see
  `Llama`)."""

  def __init__(self, config: LlamaConfig, *, precision: str, dtype: Any,
               param_dtype: Any, implementation: str | None,
               fp8_weight_gather: bool = False, rngs: nnx.Rngs,
               scaling: str = 'tensor', fuse_qkv: bool = True):
    h, d = config.hidden_size, config.head_dim
    kw = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype,
              precision=precision, implementation=implementation,
              scaling=scaling, fp8_weight_gather=fp8_weight_gather,
              kernel_init=nnx.initializers.normal(config.init_std), rngs=rngs)
    self.q_proj = linear.CoatLinear(
        h, config.num_heads * d, kernel_axes=('embed', 'heads'), **kw)
    self.k_proj = linear.CoatLinear(
        h, config.num_kv_heads * d, kernel_axes=('embed', 'kv_heads'), **kw)
    self.v_proj = linear.CoatLinear(
        h, config.num_kv_heads * d, kernel_axes=('embed', 'kv_heads'), **kw)
    self.o_proj = linear.CoatLinear(
        config.num_heads * d, h, kernel_axes=('heads', 'embed'), **kw)
    self.num_heads = config.num_heads
    self.num_kv_heads = config.num_kv_heads
    self.head_dim = d
    self.fuse_qkv = fuse_qkv

  def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, *,
               reuse_output: bool = True, x_amax: jax.Array | None = None,
               residual: jax.Array | None = None,
               grad_amax_slot: bool = False):
    """(B, S, H) -> (B, S, H); cos/sin (S, head_dim // 2).

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
    q = apply_rope(q.reshape(b, s, self.num_heads, self.head_dim), cos, sin)
    k = apply_rope(k.reshape(b, s, self.num_kv_heads, self.head_dim), cos, sin)
    v = v.reshape(b, s, self.num_kv_heads, self.head_dim)
    o, o_kept = _causal_attention(q, k, v)
    o = remat_lib.name(o, remat_lib.ATTENTION)
    return remat_lib.name(
        self.o_proj(o.reshape(b, s, self.num_heads * self.head_dim),
                    reuse_input=reuse_output and o_kept, residual=residual,
                    grad_amax_slot=grad_amax_slot),
        remat_lib.OUT_PROJ)


class DecoderLayer(nnx.Module):
  """Pre-norm block: x + attn(norm(x)), then h + mlp(norm(h))."""

  def __init__(self, config: LlamaConfig, *, precision: str, dtype: Any,
               param_dtype: Any, implementation: str | None,
               fp8_weight_gather: bool = False, rngs: nnx.Rngs,
               scaling: str = 'tensor', fuse_qkv: bool = True):
    kw = dict(precision=precision, dtype=dtype, param_dtype=param_dtype)
    gather = dict(implementation=implementation,
                  fp8_weight_gather=fp8_weight_gather)
    self.attn_norm = CoatRMSNorm(
        config.hidden_size, epsilon=config.rms_norm_eps, scale_axes=('norm',),
        rngs=rngs, **kw)
    self.attn = Attention(config, rngs=rngs, scaling=scaling,
                          fuse_qkv=fuse_qkv, **gather, **kw)
    self.mlp_norm = CoatRMSNorm(
        config.hidden_size, epsilon=config.rms_norm_eps, scale_axes=('norm',),
        rngs=rngs, **kw)
    self.mlp = CoatMLP(
        config.hidden_size, config.intermediate_size,
        kernel_init=nnx.initializers.normal(config.init_std),
        rngs=rngs, scaling=scaling, **gather, **kw)
    # The out and down projections hand the norms after them a slot for
    # max |dx| (`coat_jax.nn.norm`), where both are FP8 with one scale and
    # the norms' kernels run (one Hopper GPU). Where XLA quantizes (several
    # devices), XLA fuses the projections' own amax passes into the norms'
    # backward fusions anyway, and with slots it kept more: 1b, FSDP on 2
    # H200s, compiled: temp 8.12 -> 9.63 GiB per device (measured before
    # the norms' kernels ran on several GPUs, per shard: `fsdp.row_wise`).
    self.grad_amax_slots = (precision_lib.uses_fp8_activations(precision)
                            and scaling == 'tensor' and not xla_quantizes())

  def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, *,
               reuse_attention_output: bool = True,
               grad_amax_slot: jax.Array | None = None
               ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """(B, S, H) bf16 residual stream -> same. reuse_attention_output: see
    `Attention`. grad_amax_slot ('coat' mode with 'tensor' scaling): the
    slot that came with x from the previous layer's down projection (or a
    float32 zero); then returns (x, the down projection's slot), for
    whatever reads x next (the next layer, `fill_grad_amax_slot`)."""
    # The skip connections are added in the out and down projections, in
    # their GEMMs' epilogues where the kernel has one (`CoatLinear`).
    slots = self.grad_amax_slots
    x, h, h_amax = self.attn_norm.with_input(x, grad_amax_slot=grad_amax_slot)
    out = self.attn(h, cos, sin, reuse_output=reuse_attention_output,
                    x_amax=h_amax, residual=x, grad_amax_slot=slots)
    x, slot = out if slots else (out, None)
    x, h, h_amax = self.mlp_norm.with_input(x, grad_amax_slot=slot)
    return self.mlp(h, x_amax=h_amax, residual=x,
                    grad_amax_slot=grad_amax_slot is not None)


class Llama(nnx.Module):
  """Llama decoder-only language model.

  Args:
    config: the architecture.
    precision: 'bf16', 'fp8_linear' or 'coat'.
    dtype: activation dtype (bfloat16).
    param_dtype: parameter dtype (float32 master weights).
    implementation: `fp8_matmul` implementation ('xla', 'pallas',
      'triton', None).
    fp8_weight_gather: under an FSDP mesh, all-gather the FP8 codes of the
      weights, not their float32 shards (FP8 modes; `coat_jax.nn.fsdp`).
    rngs: random number generators.
    scaling: FP8 scaling of the linear layers, 'tensor' or 'block'.
    fuse_qkv: in FP8 modes, run Q/K/V as one fused projection, one GEMM
      each way (`fp8_dense`'s fused): with 'tensor' scaling one scale for
      the three weights and one for their output gradients (False gives
      each its own, as COAT's paper); with 'block' the same tiles and
      blocks as apart (the head widths are multiples of 128). The params
      are the same either way.
  """

  def __init__(self, config: LlamaConfig, *, precision: str = 'coat',
               dtype: Any = jnp.bfloat16, param_dtype: Any = jnp.float32,
               implementation: str | None = None,
               fp8_weight_gather: bool = False, rngs: nnx.Rngs,
               scaling: str = 'tensor', fuse_qkv: bool = True):
    precision_lib.check_precision(precision)
    precision_lib.check_scaling(scaling)
    if precision_lib.uses_fp8_matmuls(precision):
      precision_lib.check_fp8_size('config.hidden_size', config.hidden_size,
                                   precision)
      precision_lib.check_fp8_size('config.intermediate_size',
                                   config.intermediate_size, precision)
      precision_lib.check_fp8_size(
          'config.num_kv_heads * config.head_dim',
          config.num_kv_heads * config.head_dim, precision)
    init = nnx.initializers.normal(config.init_std)
    self.embed = partitioning.make_param(
        init, rngs.params(), (config.vocab_size, config.hidden_size),
        param_dtype, ('vocab', 'embed'))

    # The decoder layers are one module with stacked params (a leading
    # num_layers axis), applied one slice at a time or under jax.lax.scan
    # (config.scan_layers).
    @nnx.split_rngs(splits=config.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0,
              transform_metadata={nnx.PARTITION_NAME: None})
    def make_layers(rngs):
      return DecoderLayer(config, precision=precision, dtype=dtype,
                          param_dtype=param_dtype,
                          implementation=implementation,
                          fp8_weight_gather=fp8_weight_gather, rngs=rngs,
                          scaling=scaling, fuse_qkv=fuse_qkv)

    self.layers = make_layers(rngs)
    # The final norm is BF16 in every mode (as in COAT).
    self.norm = CoatRMSNorm(
        config.hidden_size, epsilon=config.rms_norm_eps, dtype=dtype,
        param_dtype=param_dtype, precision='bf16', scale_axes=('norm',),
        rngs=rngs)
    if config.tie_embeddings:
      self.lm_head = nnx.data(None)
    else:
      self.lm_head = partitioning.make_param(
          init, rngs.params(), (config.hidden_size, config.vocab_size),
          param_dtype, ('embed', 'vocab'))
    self.config = config
    self.precision = precision
    # The policy the layer stack runs ('auto' resolved for this precision).
    self.remat = remat_lib.resolve(config.remat, precision,
                                   config.scan_layers)
    self.dtype = dtype

  def head_kernel(self) -> jax.Array:
    """The (H, V) output projection (the embedding's transpose if tied)."""
    if self.lm_head is None:
      return fsdp.gather_weight(self.embed[...]).T
    return fsdp.gather_weight(self.lm_head[...])

  def hidden_states(self, tokens: jax.Array,
                    layers: Sequence[Any] | None = None) -> jax.Array:
    """int tokens (B, S) -> final normed hidden states (B, S, H) in dtype.

    `layers` (unrolled layers only): num_layers trees, each one layer's
    params (the stacked params' tree, sliced), used in place of slices of
    the stacked params, so that gradients with respect to them come per
    layer and are never stacked (`fused_coat_adamw` steps each layer of the
    stack in place).
    """
    seq = _check_tokens(tokens, self.config)
    if layers is not None and (self.config.scan_layers
                               or len(layers) != self.config.num_layers):
      raise ValueError(
          f'layers: {len(layers)} per-layer param trees given; they need'
          f' scan_layers=False (got {self.config.scan_layers}) and one tree'
          f' per layer ({self.config.num_layers}).')
    # Under an FSDP mesh the residual stream stays batch-sharded, so each
    # layer gathers its weights rather than moving activations.
    x = fsdp.shard_batch(
        _embed(self.embed[...], tokens, self.dtype))
    cos, sin = rope_tables(seq, self.config.head_dim, self.config.rope_theta,
                           self.config.rope_scaling)

    # Unrolled, the residual stream travels with the slot of the
    # projection that wrote it last (`DecoderLayer`); the first layer's is
    # a zero whose cotangent nothing takes, the last layer's is filled
    # before the final (BF16) norm. Scanned layers use slots only within a
    # layer: one in the scan's carry made XLA keep more (1b, batch 8, remat
    # minimal, compiled for an H200: temp 17.30 -> 17.43 GiB).
    slots = self.layers.grad_amax_slots and not self.config.scan_layers
    stream = (x, jnp.zeros((), jnp.float32) if slots else None)
    graphdef, stacked = nnx.split(self.layers)
    if self.config.scan_layers:
      stream = self._scan_layers(graphdef, stacked, stream, cos, sin)
    else:
      apply_layer = remat_lib.apply(_apply_layer(cos, sin), self.remat,
                                    in_scan=False)
      for i in range(self.config.num_layers):
        layer = nnx.merge(graphdef, jax.tree.map(lambda a: a[i], stacked)
                          if layers is None else layers[i])
        stream = _shard_batch(apply_layer(layer, stream))
    x, slot = stream
    return self.norm(x if slot is None
                     else linear.fill_grad_amax_slot(x, slot))

  def _scan_layers(self, graphdef, stacked, stream, cos, sin):
    """The stacked layers applied to the stream (x, slot or None) under
    `jax.lax.scan`.

    Scan's backward stacks every layer's param gradients (L x params),
    allocated whole while every residual is live (the train step's peak;
    unrolled layers hold a few layers' gradients there). So each param
    enters the scan twice: float32 without gradient (what each layer reads)
    and as a bf16 copy that only carries the gradient (`_cast_param` never
    reads its value; XLA drops it). Backward then stacks bf16 gradients,
    cast to float32 after the loop: half the stack. In 'bf16' mode they
    are bf16-valued anyway (same bits). In the FP8 modes the
    wgrads are rounded to bf16 (8 bits of mantissa, as a BF16 model's; the
    FP8 moments keep 3): 1b, batch 8, compiled for an H200, temp 17.30 ->
    15.50 GiB with remat 'minimal', 6.45 -> 4.65 with 'full' (unrolled:
    13.86, 6.41; benchmarks/RESULTS.md "gpu-compile").

    The out projections save their own FP8 copy of the attention output:
    saving flash attention's o instead stacks o a second time under scan
    (1b, batch 8, remat minimal, H100: 24.6 against 23.9 GiB).

    In the FP8 modes each layer reads its weights row-major on one device
    (`_row_major_weights`).
    """
    xs = (jax.lax.stop_gradient(stacked),
          jax.tree.map(lambda a: a.astype(self.dtype), stacked))
    if self.precision == 'bf16':
      params = lambda xs: jax.tree.map(
          lambda w, c: _cast_param(w, c, c.dtype), *xs)
    else:
      params = lambda xs: _row_major_weights(jax.tree.map(
          lambda w, c: _cast_param(w, c, w.dtype), *xs))
    run = _apply_layer(cos, sin, reuse_attention_output=False)
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


def _apply_layer(cos, sin, **kwargs):
  """(layer, (x, slot or None)) -> the same pair after the layer."""
  def apply(layer, stream):
    x, slot = stream
    if slot is None:
      return layer(x, cos, sin, **kwargs), None
    return layer(x, cos, sin, grad_amax_slot=slot, **kwargs)
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
  it (Llama-2-7B, remat full, batch 16 on an H200: peak 95.3 -> 76.5 GiB
  without the copy; 1b, remat full, compiled: temp 9.11 -> 6.45 GiB,
  unrolled 6.41; RESULTS.md "gpu-compile"). On several devices the SPMD
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


def _check_tokens(tokens: Any, config: LlamaConfig) -> int:
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
  if seq > config.max_seq_len:
    raise ValueError(
        f'tokens has sequence length {seq}, longer than the RoPE table'
        f' (config.max_seq_len={config.max_seq_len}); shorten the sequence or'
        f' raise max_seq_len (LlamaConfig.preset(..., max_seq_len={seq})).')
  return seq


def lm_loss(model: Llama, tokens: jax.Array, targets: jax.Array, *,
            chunk_size: int = 2048,
            layers: Sequence[Any] | None = None) -> jax.Array:
  """Mean next-token cross entropy, without materializing all logits.

  Args:
    model: a Llama.
    tokens: (B, S) integer inputs.
    targets: (B, S) integer next tokens; negative ids are ignored.
    chunk_size: tokens per chunk of (chunk_size, V) float32 logits.
    layers: per-layer params of unrolled layers (`Llama.hidden_states`).

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
      dtype=model.dtype)
  return loss_sum / jnp.maximum(count, 1.0)
