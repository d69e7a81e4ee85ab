"""The baseline of RESULTS.md "e2e-1b" and "e2e-7b": a plain Flax NNX +
optax BF16 Llama, e2e.py's mode 'plain':

  PYTHONPATH=. python benchmarks/e2e.py --preset 1b --modes plain

What a user writes without coat_jax: `nnx.Embed`, `nnx.RMSNorm`,
`nnx.Linear` (float32 params, BF16 compute), RoPE (HF's rotate_half, in
float32), grouped-query attention through `jax.nn.dot_product_attention`
(cuDNN flash attention on GPU, XLA elsewhere), SwiGLU, unrolled layers,
BF16 logits with a float32 softmax cross entropy, `optax.adamw` after
global-norm clipping at 1.0, one jitted step with the state donated.

The architecture and matmul FLOPs are those of `coat_jax.models.Decoder`
for the same config (the params use the same names, so a test can load one
model's weights into the other and compare losses); for Qwen3's shape it
adds the per-head RMSNorm of the queries and keys.

`build(cfg, recipe=...)` is e2e.py's mode 'converted': what a user of
coat_jax does to this model, the one line of its MLP switched to the
FP8-saving `coat_jax.nn.swiglu`, `coat_jax.convert(model, recipe)`, and
`coat_jax.coat_adamw` in the optimizer. `build(cfg, recipe=...,
fused=True)` is mode 'converted_fused': the same with the optimizer a
`coat_jax.FusedCoatAdamW` (nnx.Optimizer's state, updated in one fused pass
in place) in an `nnx.split` / `nnx.merge` step.
"""

from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
import optax

import coat_jax
from coat_jax.models import DecoderConfig


def rope(x: jax.Array, positions: int, theta: float) -> jax.Array:
  """Rotary embedding of x (B, S, N, D) over its first S positions."""
  d = x.shape[-1]
  inv_freq = 1.0 / theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
  angles = jnp.outer(jnp.arange(positions, dtype=jnp.float32), inv_freq)
  cos = jnp.cos(angles)[None, :, None, :]
  sin = jnp.sin(angles)[None, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin],
                         axis=-1).astype(x.dtype)


def attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
  """Causal GQA: q (B, S, N, D), k and v (B, S, K, D) -> (B, S, N, D)."""
  impl = 'cudnn' if jax.default_backend() == 'gpu' else None
  return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                      implementation=impl)


def _linear(n_in: int, n_out: int, cfg: DecoderConfig, rngs: nnx.Rngs):
  return nnx.Linear(n_in, n_out, use_bias=False, dtype=jnp.bfloat16,
                    param_dtype=jnp.float32, rngs=rngs,
                    kernel_init=nnx.initializers.normal(cfg.init_std))


def _norm(cfg: DecoderConfig, rngs: nnx.Rngs, size: int | None = None):
  return nnx.RMSNorm(size or cfg.hidden_size, epsilon=cfg.rms_norm_eps,
                     dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=rngs)


class Attention(nnx.Module):

  def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
    h, d = cfg.hidden_size, cfg.head_features
    self.q_proj = _linear(h, cfg.num_heads * d, cfg, rngs)
    self.k_proj = _linear(h, cfg.num_kv_heads * d, cfg, rngs)
    self.v_proj = _linear(h, cfg.num_kv_heads * d, cfg, rngs)
    self.o_proj = _linear(cfg.num_heads * d, h, cfg, rngs)
    if cfg.qk_norm == 'head':  # Qwen3
      self.q_norm = _norm(cfg, rngs, d)
      self.k_norm = _norm(cfg, rngs, d)
    self.cfg = cfg

  def __call__(self, x: jax.Array) -> jax.Array:
    b, s, _ = x.shape
    c = self.cfg
    d = c.head_features
    q = self.q_proj(x).reshape(b, s, c.num_heads, d)
    k = self.k_proj(x).reshape(b, s, c.num_kv_heads, d)
    v = self.v_proj(x).reshape(b, s, c.num_kv_heads, d)
    if c.qk_norm == 'head':
      q, k = self.q_norm(q), self.k_norm(k)
    o = attention(rope(q, s, c.rope_theta), rope(k, s, c.rope_theta), v)
    return self.o_proj(o.reshape(b, s, c.num_heads * d))


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
  return nnx.silu(gate) * up


class MLP(nnx.Module):

  def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs, glu=swiglu):
    h, i = cfg.hidden_size, cfg.intermediate_size
    self.gate_proj = _linear(h, i, cfg, rngs)
    self.up_proj = _linear(h, i, cfg, rngs)
    self.down_proj = _linear(i, h, cfg, rngs)
    self.glu = glu

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down_proj(self.glu(self.gate_proj(x), self.up_proj(x)))


class Block(nnx.Module):

  def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs, glu=swiglu):
    self.attn_norm = _norm(cfg, rngs)
    self.attn = Attention(cfg, rngs)
    self.mlp_norm = _norm(cfg, rngs)
    self.mlp = MLP(cfg, rngs, glu)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attn(self.attn_norm(x))
    return x + self.mlp(self.mlp_norm(x))


class PlainLlama(nnx.Module):
  """int tokens (B, S) -> BF16 logits (B, S, V); float32 params. glu:
  the MLP's silu(gate) * up (`swiglu`, or coat_jax.nn.swiglu)."""

  def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs, glu=swiglu):
    self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden_size,
                           dtype=jnp.bfloat16, param_dtype=jnp.float32,
                           embedding_init=nnx.initializers.normal(
                               cfg.init_std), rngs=rngs)
    self.layers = nnx.List([Block(cfg, rngs, glu)
                            for _ in range(cfg.num_layers)])
    self.norm = _norm(cfg, rngs)
    self.lm_head = (None if cfg.tie_embeddings
                    else _linear(cfg.hidden_size, cfg.vocab_size, cfg, rngs))

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.embed(tokens)
    for layer in self.layers:
      x = layer(x)
    x = self.norm(x)
    if self.lm_head is None:
      return self.embed.attend(x)
    return self.lm_head(x)


def loss_fn(model: PlainLlama, tokens: jax.Array,
            targets: jax.Array) -> jax.Array:
  """Mean next-token cross entropy (softmax in float32)."""
  logits = model(tokens).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, targets).mean()


def make_optimizer(learning_rate: float = 3e-4, *,
                   coat: bool = False) -> optax.GradientTransformation:
  """Clip at global norm 1.0, then AdamW (b2 0.95, weight decay 0.1 on
  matrices), as coat_jax's train step: optax's, or with coat COAT's FP8
  moments (`coat_jax.coat_adamw`)."""
  adamw = coat_jax.coat_adamw if coat else optax.adamw
  return optax.chain(
      optax.clip_by_global_norm(1.0),
      adamw(learning_rate, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1,
            mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)))


def make_model(cfg: DecoderConfig, seed: int = 0,
               recipe: Any = None) -> PlainLlama:
  """The plain model; with a recipe, as a coat_jax user converts it: the
  MLP's SwiGLU switched to `coat_jax.nn.swiglu`, then
  `coat_jax.convert(model, recipe)`."""
  if recipe is None:
    return PlainLlama(cfg, nnx.Rngs(seed))
  model = PlainLlama(cfg, nnx.Rngs(seed), glu=coat_jax.nn.swiglu)
  coat_jax.convert(model, recipe)
  return model


def build(cfg: DecoderConfig, seed: int = 0, learning_rate: float = 3e-4,
          recipe: Any = None, fused: bool = False) -> tuple[Any, Any]:
  """(init_state, train_step) for the plain BF16 Llama, or with a recipe
  for it converted (`make_model`) and trained with coat_adamw (fused: by
  `coat_jax.FusedCoatAdamW`).

  init_state() -> {'params': pure dict of float32 arrays, 'opt_state'}
  (fused: the nnx.State of (model, optimizer)); train_step(state, inputs,
  targets) -> (state, {'loss'}) is jitted with the state donated. inputs
  and targets: int32 (B, S).
  """
  if fused:
    return _build_fused(cfg, seed, learning_rate, recipe)
  graphdef, _ = nnx.split(nnx.eval_shape(
      lambda: make_model(cfg, seed, recipe)))
  tx = make_optimizer(learning_rate, coat=recipe is not None)

  def init_state():
    params = nnx.to_pure_dict(nnx.state(make_model(cfg, seed, recipe),
                                        nnx.Param))
    return {'params': params, 'opt_state': jax.jit(tx.init)(params)}

  def train_step(state, inputs, targets):
    loss, grads = jax.value_and_grad(
        lambda p: loss_fn(nnx.merge(graphdef, p), inputs, targets))(
            state['params'])
    updates, opt_state = tx.update(grads, state['opt_state'],
                                   state['params'])
    params = optax.apply_updates(state['params'], updates)
    return {'params': params, 'opt_state': opt_state}, {'loss': loss}

  return init_state, jax.jit(train_step, donate_argnums=0)


def _build_fused(cfg, seed, learning_rate, recipe):
  """`build(..., fused=True)`: the converted model and its FusedCoatAdamW
  (make_optimizer's clipping and AdamW settings), split into one state."""
  if recipe is None:
    raise ValueError('fused=True needs a recipe: FusedCoatAdamW keeps FP8'
                     ' moments, a converted model\'s optimizer.')

  def model_and_optimizer():
    model = make_model(cfg, seed, recipe)
    return model, coat_jax.FusedCoatAdamW(
        model, learning_rate, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1,
        mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p), clip_norm=1.0)

  graphdef, _ = nnx.split(nnx.eval_shape(model_and_optimizer))

  def init_state():
    return nnx.state(model_and_optimizer())

  def train_step(state, inputs, targets):
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(loss_fn)(model, inputs, targets)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), {'loss': loss}

  return init_state, jax.jit(train_step, donate_argnums=0)
