"""coat_jax.convert on models this project did not write.

Three models: a GPT-2-style decoder (LayerNorm, causal attention with
biased q/k/v/o projections, a tanh-GELU MLP with biases, float32 compute as
nnx's defaults give), a ViT encoder (a patch-embedding linear layer,
LayerNorm, attention, an exact-GELU MLP, bfloat16 compute, a 10-class head)
and benchmarks/plain_llama.py's PlainLlama (RMSNorm, bfloat16). Each,
converted with the default recipe (COAT), keeps its loss and gradients
within FP8 tolerance, compiles to a smaller backward pass, and trains with
nnx.Optimizer and coat_adamw under nnx.jit. Then: the Params kept by
identity, an optimizer state made before the conversion, filters, every
skip reason, the report, converting twice, a sharded model on 8 CPU
devices, and orbax checkpoints.
"""

from collections.abc import Callable
import functools
from typing import NamedTuple
from unittest import mock

from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from benchmarks import plain_llama
import coat_jax
from coat_jax import recipes
from coat_jax.conversion import Converted
from coat_jax.conversion import Skipped
from coat_jax.models import LlamaConfig
from coat_jax.nn import CoatLayerNorm
from coat_jax.nn import CoatLinear
from coat_jax.nn import CoatRMSNorm
from coat_jax.nn import residuals
from tests import compiled_step

# --- The models -------------------------------------------------------------


def _linear(n_in, n_out, rngs, axes=None, **kw):
  """nnx.Linear, with logical axis names on its params when `axes`."""
  if axes is not None:
    kw.update(kernel_metadata={'out_sharding': axes},
              bias_metadata={'out_sharding': axes[-1:]})
  return nnx.Linear(n_in, n_out, rngs=rngs, **kw)


def _layer_norm(d, eps, rngs, partitioned, **kw):
  if partitioned:
    kw.update(scale_metadata={'out_sharding': ('norm',)},
              bias_metadata={'out_sharding': ('norm',)})
  return nnx.LayerNorm(d, epsilon=eps, rngs=rngs, **kw)


class Attention(nnx.Module):
  """Multi-head self-attention with biased q/k/v/o projections."""

  def __init__(self, d, heads, causal, rngs, partitioned=False, **kw):
    qkv_axes, o_axes = ((('embed', 'heads'), ('heads', 'embed'))
                        if partitioned else (None, None))
    self.q, self.k, self.v = (_linear(d, d, rngs, qkv_axes, **kw)
                              for _ in range(3))
    self.o = _linear(d, d, rngs, o_axes, **kw)
    self.heads, self.causal = heads, causal

  def __call__(self, x):
    b, s, d = x.shape
    split = lambda t: t.reshape(b, s, self.heads, d // self.heads)
    o = jax.nn.dot_product_attention(split(self.q(x)), split(self.k(x)),
                                     split(self.v(x)), is_causal=self.causal)
    return self.o(o.reshape(b, s, d))


class MLP(nnx.Module):

  def __init__(self, d, act, rngs, partitioned=False, **kw):
    fc_axes, proj_axes = ((('embed', 'mlp'), ('mlp', 'embed'))
                          if partitioned else (None, None))
    self.fc = _linear(d, 4 * d, rngs, fc_axes, **kw)
    self.proj = _linear(4 * d, d, rngs, proj_axes, **kw)
    self.act = act

  def __call__(self, x):
    return self.proj(self.act(self.fc(x)))


class Block(nnx.Module):
  """A pre-norm transformer block (GPT-2's and ViT's)."""

  def __init__(self, d, heads, causal, act, eps, rngs, partitioned=False,
               **kw):
    self.ln_1 = _layer_norm(d, eps, rngs, partitioned, **kw)
    self.attn = Attention(d, heads, causal, rngs, partitioned, **kw)
    self.ln_2 = _layer_norm(d, eps, rngs, partitioned, **kw)
    self.mlp = MLP(d, act, rngs, partitioned, **kw)

  def __call__(self, x):
    x = x + self.attn(self.ln_1(x))
    return x + self.mlp(self.ln_2(x))


GELU_TANH = functools.partial(jax.nn.gelu, approximate=True)
GELU_EXACT = functools.partial(jax.nn.gelu, approximate=False)


class GPT2(nnx.Module):
  """GPT-2's architecture, small: int tokens (B, S) -> float32 logits."""

  def __init__(self, *, vocab=128, seq=64, d=64, heads=4, layers=2,
               act=GELU_TANH, partitioned=False, rngs):
    self.wte = nnx.Embed(vocab, d, rngs=rngs)
    self.wpe = nnx.Embed(seq, d, rngs=rngs)
    self.h = nnx.List([Block(d, heads, True, act, 1e-5, rngs, partitioned)
                       for _ in range(layers)])
    self.ln_f = _layer_norm(d, 1e-5, rngs, partitioned)

  def __call__(self, tokens):
    x = self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[1]))
    for block in self.h:
      x = block(x)
    return self.wte.attend(self.ln_f(x))


def gpt2_loss(model, tokens):
  logits = model(tokens[:, :-1]).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, tokens[:, 1:]).mean()


class ViT(nnx.Module):
  """A ViT encoder, small: images (B, 32, 32, 3) -> class logits (B, 10)."""

  def __init__(self, *, patch=4, d=64, heads=4, layers=2, classes=10,
               act=GELU_EXACT, rngs):
    kw = dict(dtype=jnp.bfloat16)
    self.patch = patch
    self.embed = nnx.Linear(patch * patch * 3, d, rngs=rngs, **kw)
    self.cls = nnx.Param(jnp.zeros((1, 1, d)))
    self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(),
                                                  (1, 65, d)))
    self.blocks = nnx.List([Block(d, heads, False, act, 1e-6, rngs, **kw)
                            for _ in range(layers)])
    self.norm = nnx.LayerNorm(d, epsilon=1e-6, rngs=rngs, **kw)
    self.head = nnx.Linear(d, classes, rngs=rngs, **kw)

  def __call__(self, images):
    b, h, w, c = images.shape
    p = self.patch
    x = images.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5)
    x = self.embed(x.reshape(b, -1, p * p * c))
    cls = jnp.broadcast_to(self.cls[...], (b, 1, x.shape[-1]))
    x = jnp.concatenate([cls.astype(x.dtype), x], axis=1)
    x = x + self.pos[...].astype(x.dtype)
    for block in self.blocks:
      x = block(x)
    return self.head(self.norm(x)[:, 0])


def vit_loss(model, batch):
  images, labels = batch
  logits = model(images).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits,
                                                         labels).mean()


class SwiGLUMLP(plain_llama.MLP):
  """PlainLlama's MLP with the one line a user edits."""

  def __call__(self, x):
    return self.down_proj(coat_jax.nn.swiglu(self.gate_proj(x),
                                             self.up_proj(x)))


LLAMA = LlamaConfig.preset('tiny', hidden_size=64, intermediate_size=192,
                           head_dim=16, vocab_size=128)


def plain_llama_model(drop_ins, seed):
  mlp = SwiGLUMLP if drop_ins else plain_llama.MLP
  with mock.patch.object(plain_llama, 'MLP', mlp):
    return plain_llama.PlainLlama(LLAMA, nnx.Rngs(seed))


def llama_loss(model, tokens):
  return plain_llama.loss_fn(model, tokens[:, :-1], tokens[:, 1:])


def _tokens(seed, batch=16, seq=65):
  return jax.random.randint(jax.random.key(seed), (batch, seq), 0, 128)


def _images(seed, batch=16):
  k = jax.random.split(jax.random.key(seed))
  return (jax.random.normal(k[0], (batch, 32, 32, 3)),
          jax.random.randint(k[1], (batch,), 0, 10))


class Case(NamedTuple):
  """A model of the tests: make(drop_ins) builds it unconverted (drop_ins:
  with coat_jax.nn's activation in its own code instead of jax.nn's);
  what convert does to it; the least gradient cosines (all params, each
  param) that FP8 keeps against the unconverted model."""
  make: Callable[[bool], nnx.Module]
  loss: Callable
  batch: Callable
  conversions: dict
  skips: list
  min_cosines: tuple[float, float]


CASES = {
    'gpt2': Case(
        lambda drop_ins: GPT2(
            act=(functools.partial(coat_jax.nn.gelu, approximate=True)
                 if drop_ins else GELU_TANH), rngs=nnx.Rngs(6301)),
        gpt2_loss, lambda: _tokens(6302),
        {('Linear', 'CoatLinear'): 12, ('LayerNorm', 'CoatLayerNorm'): 5},
        [], (0.98, 0.97)),
    # The ViT's loss is 32 class tokens': its gradients average the FP8
    # error over fewer rows (over seeds: cosines 0.979-0.994 for all
    # params, worst params 0.967-0.984, nearly all from the attention
    # projections' per-tensor FP8; its LayerNorms and GELUs alone: 0.9999).
    'vit': Case(
        lambda drop_ins: ViT(
            act=(functools.partial(coat_jax.nn.gelu, approximate=False)
                 if drop_ins else GELU_EXACT), rngs=nnx.Rngs(6303)),
        vit_loss, lambda: _images(6304, batch=32),
        {('Linear', 'CoatLinear'): 13, ('LayerNorm', 'CoatLayerNorm'): 5},
        [(('head',), nnx.Linear, 'out_features=10 is not a multiple of 16')],
        (0.97, 0.95)),
    'plain_llama': Case(
        lambda drop_ins: plain_llama_model(drop_ins, 6305),
        llama_loss, lambda: _tokens(6306),
        {('Linear', 'CoatLinear'): 15, ('RMSNorm', 'CoatRMSNorm'): 5}, [],
        (0.98, 0.97)),
}


# --- Helpers ----------------------------------------------------------------


def _compiled_loss_and_grads(model, loss, batch):
  """(temp bytes, loss, grads) of value_and_grad(loss) compiled as the GPU
  compiler keeps it (`compiled_step.gpu_like_options`)."""
  graph, state = nnx.split(model)
  fn = jax.jit(jax.value_and_grad(
      lambda s, b: loss(nnx.merge(graph, s), b)))
  compiled = fn.lower(state, batch).compile(compiled_step.gpu_like_options())
  return compiled.memory_analysis().temp_size_in_bytes, *compiled(state,
                                                                  batch)


def _activation_bytes(model, loss, batch):
  """Bytes of the activations jax.vjp keeps for backward (those that grow
  with the batch)."""
  graph, state = nnx.split(model)
  fn = lambda s, b: loss(nnx.merge(graph, s), b)
  doubled = jax.tree.map(lambda x: jnp.concatenate([x, x]), batch)
  return residuals.nbytes(residuals.activation_residuals(
      fn, (state, batch), (state, doubled)))


def _cos(a, b):
  a, b = (np.asarray(t, np.float64).ravel() for t in (a, b))
  return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _flat(tree):
  return np.concatenate([np.ravel(np.asarray(x, np.float64))
                         for x in jax.tree.leaves(tree)])


def _variables(model):
  """{path: Variable} of every Variable in the model (the objects)."""
  return {path: v for path, v in nnx.iter_graph(model)
          if isinstance(v, nnx.Variable)}


def _train_step(loss):
  @nnx.jit
  def step(model, optimizer, batch):
    value, grads = nnx.value_and_grad(loss)(model, batch)
    optimizer.update(model, grads)
    return value
  return step


# --- The three models -------------------------------------------------------


@pytest.mark.parametrize('name', CASES)
def test_converted_model_keeps_loss_and_gradients_and_saves_memory(name):
  """Converted (and with coat_jax.nn's activation in the model's code): the
  loss within 2% and the gradients within FP8 tolerance of the unconverted
  model's (the cosine over all params and the least over the params, at
  least the case's min_cosines), and a backward pass that keeps fewer
  bytes: compiled temp bytes (GPU-like options) and the activation
  residuals of jax.vjp (converted: < 0.85x; with the drop-in: less again).

  Measured on this CPU (converted / with the drop-in):
    GPT-2: loss +-0.02%; cosine 0.993 / 0.993, least 0.981 / 0.982;
      temp 20.1 -> 14.9 -> 11.5 MiB; residuals 26.2 -> 20.3 -> 10.9 MiB.
    ViT: loss +-0.06%; cosine 0.979 / 0.985, least 0.978 / 0.978;
      temp 40.2 -> 30.9 -> 26.0 MiB; residuals 25.5 -> 17.1 -> 12.1 MiB.
    PlainLlama: loss +-0.01%; cosine 0.998 / 0.998, least 0.994 / 0.994;
      temp 18.4 -> 13.2 -> 11.4 MiB; residuals 15.7 -> 11.9 -> 8.9 MiB.

  An attention key bias has no gradient in exact arithmetic (softmax is
  invariant to q . b_k): its gradient is rounding noise in both models, so
  its cosine is no measure; its size is asserted instead.
  """
  make, loss, batch, conversions, skips, min_cosines = CASES[name]
  batch = batch()
  model = make(False)
  temp_ref, loss_ref, grads_ref = _compiled_loss_and_grads(model, loss,
                                                           batch)
  act_ref = _activation_bytes(model, loss, batch)
  report = coat_jax.convert(model)
  counts = {}
  for row in report.converted:
    key = (row.from_type.__name__, row.to_type.__name__)
    counts[key] = counts.get(key, 0) + 1
  assert counts == conversions
  assert [(s.path, s.type, s.reason) for s in report.skipped] == skips
  temp, loss_fp8, grads = _compiled_loss_and_grads(model, loss, batch)
  act = _activation_bytes(model, loss, batch)
  drop_ins = make(True)
  coat_jax.convert(drop_ins)
  temp_drop, loss_drop, grads_drop = _compiled_loss_and_grads(
      drop_ins, loss, batch)
  act_drop = _activation_bytes(drop_ins, loss, batch)
  print(f'{name}: loss {float(loss_ref):.5f} -> {float(loss_fp8):.5f}'
        f' (drop-ins {float(loss_drop):.5f}); temp'
        f' {temp_ref / 2**20:.2f} -> {temp / 2**20:.2f}'
        f' -> {temp_drop / 2**20:.2f} MiB; activation residuals'
        f' {act_ref / 2**20:.2f} -> {act / 2**20:.2f}'
        f' -> {act_drop / 2**20:.2f} MiB')
  ref_leaves = jax.tree_util.tree_leaves_with_path(grads_ref)
  for got_loss, got in ((loss_fp8, grads), (loss_drop, grads_drop)):
    assert abs(float(got_loss) - float(loss_ref)) < 0.02 * float(loss_ref)
    overall = _cos(_flat(got), _flat(grads_ref))
    assert overall >= min_cosines[0], overall
    norm = np.linalg.norm(_flat(got))
    cosines = {}
    for (path, want), have in zip(ref_leaves, jax.tree.leaves(got),
                                  strict=True):
      key = jax.tree_util.keystr(path)
      if "['k']['bias']" in key:
        assert max(np.linalg.norm(want), np.linalg.norm(have)) < 1e-3 * norm
        continue
      cosines[key] = _cos(have, want)
    worst = min(cosines, key=cosines.get)
    print(f'  gradient cosine overall {overall:.4f}, worst {worst}'
          f' {cosines[worst]:.4f}')
    assert cosines[worst] >= min_cosines[1]
  assert temp < 0.85 * temp_ref and temp_drop < temp
  assert act < 0.85 * act_ref and act_drop < act


@pytest.mark.parametrize('name', CASES)
def test_converted_model_trains_with_an_optimizer_made_before(name):
  """nnx.Optimizer with coat_adamw, made on the unconverted model; convert;
  a few jitted steps on one batch lower the loss."""
  make, loss, batch = CASES[name][:3]
  batch = batch()
  model = make(True)
  optimizer = nnx.Optimizer(model, coat_jax.coat_adamw(3e-3),
                            wrt=nnx.Param)
  coat_jax.convert(model)
  step = _train_step(loss)
  losses = [float(step(model, optimizer, batch)) for _ in range(6)]
  print(f'{name}: losses {np.round(losses, 4).tolist()}')
  assert np.isfinite(losses).all()
  assert losses[-1] < 0.9 * losses[0]
  assert int(optimizer.step[...]) == 6


# --- What convert keeps -----------------------------------------------------


def test_params_kept_by_identity_with_their_metadata():
  """Every Variable of the model is the same object at the same path after
  the conversion: values, dtypes, sharding metadata and the state tree
  unchanged; the new layers keep the old layers' settings."""
  with jax.set_mesh(_mesh()), nnx.logical_axis_rules(
      coat_jax.nn.LOGICAL_AXIS_RULES):
    model = GPT2(layers=1, partitioned=True, rngs=nnx.Rngs(6307))
  model.h[0].mlp.fc = nnx.Linear(64, 256, use_bias=False,
                                 dtype=jnp.bfloat16,
                                 param_dtype=jnp.bfloat16,
                                 rngs=nnx.Rngs(6308))
  model.h[0].ln_2 = nnx.LayerNorm(64, epsilon=1e-3, use_scale=False,
                                  use_fast_variance=False,
                                  dtype=jnp.bfloat16, rngs=nnx.Rngs(6309))
  before = _variables(model)
  values = {path: v[...] for path, v in before.items()}
  state_tree = jax.tree.structure(nnx.state(model))
  coat_jax.convert(model)
  after = _variables(model)
  assert after.keys() == before.keys()
  for path, v in before.items():
    assert after[path] is v
    assert v[...] is values[path]
  assert jax.tree.structure(nnx.state(model)) == state_tree
  q = model.h[0].attn.q
  assert type(q) is CoatLinear and q.recipe == recipes.COAT
  assert q.kernel_axes == ('embed', 'heads') and q.dtype is None
  assert q.kernel.get_metadata()['out_sharding'] == ('embed', 'heads')
  assert q.bias.get_metadata()['out_sharding'] == ('heads',)
  assert q.kernel[...].sharding.spec == P('fsdp', 'tensor')
  fc = model.h[0].mlp.fc
  assert (type(fc) is CoatLinear and fc.bias is None and not fc.use_bias
          and fc.dtype == jnp.bfloat16 and fc.param_dtype == jnp.bfloat16
          and fc.kernel_axes is None)
  ln = model.h[0].ln_2
  assert (type(ln) is CoatLayerNorm and ln.scale is None
          and ln.epsilon == 1e-3 and not ln.use_fast_variance
          and ln.dtype == jnp.bfloat16 and ln.bias is before[
              ('h', 0, 'ln_2', 'bias')])


def test_optimizer_made_before_the_conversion_lines_up():
  """An nnx.Optimizer made on the unconverted model steps the converted
  model exactly as one made after the conversion: its state's tree is the
  converted model's param tree, each state on its own param."""
  tokens = _tokens(6312, batch=4, seq=33)
  step = _train_step(gpt2_loss)
  params = []
  for before in (True, False):
    model = GPT2(layers=1, rngs=nnx.Rngs(6313))
    if before:
      optimizer = nnx.Optimizer(model, coat_jax.coat_adamw(1e-3),
                                wrt=nnx.Param)
    coat_jax.convert(model)
    if not before:
      optimizer = nnx.Optimizer(model, coat_jax.coat_adamw(1e-3),
                                wrt=nnx.Param)
    for _ in range(2):
      step(model, optimizer, tokens)
    params.append(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  made_before, made_after = params
  assert jax.tree.structure(made_before) == jax.tree.structure(made_after)
  for a, b in zip(jax.tree.leaves(made_before), jax.tree.leaves(made_after),
                  strict=True):
    np.testing.assert_array_equal(a, b)


# --- Filters, skips, the report ----------------------------------------------


def test_filter_sees_each_layer_and_leaves_out_what_it_rejects():
  model = GPT2(layers=2, rngs=nnx.Rngs(6314))
  seen = []

  def no_attention(path, module):
    seen.append((path, type(module)))
    return 'attn' not in path

  report = coat_jax.convert(model, filter=no_attention)
  linears = [(('h', i, 'attn', n), nnx.Linear)
             for i in range(2) for n in 'kovq']
  assert sorted(seen, key=str) == sorted(
      linears
      + [(('h', i, n), nnx.LayerNorm) for i in range(2)
         for n in ('ln_1', 'ln_2')]
      + [(('h', i, 'mlp', n), nnx.Linear) for i in range(2)
         for n in ('fc', 'proj')]
      + [(('ln_f',), nnx.LayerNorm)], key=str)
  assert sorted(report.skipped, key=str) == sorted(
      [Skipped(p, t, 'left out by the filter') for p, t in linears],
      key=str)
  assert len(report.converted) == 9
  assert type(model.h[1].attn.q) is nnx.Linear
  assert type(model.h[1].mlp.fc) is CoatLinear


class _MyLinear(nnx.Linear):
  """A user's subclass (convert cannot know what it changes)."""


class _Zoo(nnx.Module):
  """One layer per reason convert skips a layer, and three it takes."""

  def __init__(self, rngs):
    r = rngs
    self.ok_linear = nnx.Linear(32, 16, rngs=r)
    self.ok_rms = nnx.RMSNorm(32, dtype=jnp.bfloat16, rngs=r)
    self.ok_ln = nnx.LayerNorm(16, use_scale=False, rngs=r)
    self.narrow_out = nnx.Linear(16, 10, rngs=r)
    self.narrow_in = nnx.Linear(24, 16, rngs=r)
    self.dot = nnx.Linear(16, 16, dot_general=_my_dot_general, rngs=r)
    self.promote = nnx.Linear(16, 16, promote_dtype=_my_promote, rngs=r)
    self.precise = nnx.Linear(16, 16, precision=jax.lax.Precision.HIGHEST,
                              rngs=r)
    self.preferred = nnx.Linear(16, 16, preferred_element_type=jnp.float32,
                                rngs=r)
    self.int_linear = nnx.Linear(16, 16, dtype=jnp.int32, rngs=r)
    self.half = nnx.Linear(16, 16, dtype=jnp.float16, rngs=r)
    self.half_params = nnx.Linear(16, 16, param_dtype=jnp.float16, rngs=r)
    self.rms_axes = nnx.RMSNorm(16, reduction_axes=(-2, -1), rngs=r)
    self.ln_features = nnx.LayerNorm(16, feature_axes=-2, rngs=r)
    self.synced = nnx.LayerNorm(16, axis_name='batch', rngs=r)
    self.no_scale = nnx.RMSNorm(16, use_scale=False, rngs=r)
    self.narrow_norm = nnx.LayerNorm(24, rngs=r)
    self.ln_promote = nnx.LayerNorm(16, promote_dtype=_my_promote, rngs=r)
    self.subclass = _MyLinear(16, 16, rngs=r)
    self.held = nnx.data((nnx.Linear(16, 16, rngs=r),))
    self.twice = nnx.Linear(16, 16, rngs=r)
    self.z_alias = nnx.data((self.twice,))


def _my_dot_general(*args, **kwargs):
  return jax.lax.dot_general(*args, **kwargs)


def _my_promote(args, *, dtype=None):
  return args


ZOO_SKIPS = [
    (('dot',), nnx.Linear, 'a custom dot_general (_my_dot_general)'),
    (('half',), nnx.Linear, 'computes in float16; FP8 layers compute in'
     ' bfloat16 or float32'),
    (('half_params',), nnx.Linear, 'computes in float16; FP8 layers compute'
     ' in bfloat16 or float32'),
    (('held', 0), nnx.Linear, 'held in a tuple, which cannot be changed in'
     ' place (an nnx.List can)'),
    (('int_linear',), nnx.Linear, 'dtype int32 is not floating'),
    (('ln_features',), nnx.LayerNorm, 'feature_axes=-2: only the last axis'),
    (('ln_promote',), nnx.LayerNorm, 'a custom promote_dtype (_my_promote)'),
    (('narrow_in',), nnx.Linear, 'in_features=24 is not a multiple of 16'),
    (('narrow_norm',), nnx.LayerNorm,
     'num_features=24 is not a multiple of 16'),
    (('narrow_out',), nnx.Linear, 'out_features=10 is not a multiple of 16'),
    (('no_scale',), nnx.RMSNorm, 'use_scale=False (CoatRMSNorm has a scale)'),
    (('precise',), nnx.Linear, 'precision=HIGHEST'),
    (('preferred',), nnx.Linear, 'preferred_element_type=float32'),
    (('promote',), nnx.Linear, 'a custom promote_dtype (_my_promote)'),
    (('rms_axes',), nnx.RMSNorm,
     'reduction_axes=(-2, -1): only the last axis'),
    (('subclass',), _MyLinear,
     'a subclass of nnx.Linear: its own code would be lost'),
    (('synced',), nnx.LayerNorm,
     "axis_name='batch' (statistics across devices)"),
    (('twice',), nnx.Linear, 'also at z_alias.0, in a tuple, which cannot'
     ' be changed in place (an nnx.List can)'),
]


def test_every_skip_reason():
  zoo = _Zoo(nnx.Rngs(6315))
  layers = dict(nnx.iter_modules(zoo))
  report = coat_jax.convert(zoo)
  assert sorted(report.skipped) == sorted(Skipped(*s) for s in ZOO_SKIPS)
  assert sorted(report.converted) == sorted([
      Converted(('ok_linear',), nnx.Linear, CoatLinear),
      Converted(('ok_ln',), nnx.LayerNorm, CoatLayerNorm),
      Converted(('ok_rms',), nnx.RMSNorm, CoatRMSNorm)])
  for path, _, _ in ZOO_SKIPS:  # each skipped layer is where it was
    assert dict(nnx.iter_modules(zoo))[path] is layers[path]
  assert zoo.z_alias[0] is zoo.twice  # replaced everywhere, or nowhere


def test_recipes_without_an_fp8_part_skip_its_layers():
  """FP8_LINEAR: the norms stay (nothing to save in FP8); BF16: all stay."""
  model = GPT2(layers=1, rngs=nnx.Rngs(6316))
  report = coat_jax.convert(model, 'bf16')
  assert not report.converted
  assert {s.reason for s in report.skipped} == {
      'the recipe has no FP8 matmuls', 'the recipe has no FP8 activations'}
  report = coat_jax.convert(model, recipes.FP8_LINEAR)
  assert {r.to_type for r in report.converted} == {CoatLinear}
  assert [s.path for s in report.skipped] == [
      ('h', 0, 'ln_1'), ('h', 0, 'ln_2'), ('ln_f',)]
  assert model.h[0].attn.q.recipe == recipes.FP8_LINEAR


def test_report_table():
  zoo = _Zoo(nnx.Rngs(6317))
  text = str(coat_jax.convert(zoo, filter=lambda p, m: p != ('dot',)))
  lines = text.splitlines()
  assert lines[:4] == [
      'coat_jax.convert (recipe coat): 3 converted, 18 skipped',
      '  converted  1 Linear -> CoatLinear',
      '             1 LayerNorm -> CoatLayerNorm',
      '             1 RMSNorm -> CoatRMSNorm']
  assert lines[4] == ('  skipped    dot          Linear     left out by the'
                      ' filter')
  assert lines[5] == ('             half         Linear     computes in'
                      ' float16; FP8 layers compute in bfloat16 or float32')
  assert len(lines) == 4 + 18
  many = coat_jax.ConversionReport(
      recipes.COAT_BLOCK, (),
      tuple(Skipped(('x', i), nnx.Linear, 'r') for i in range(25)))
  assert str(many).splitlines()[0] == (
      'coat_jax.convert (recipe coat_block): 0 converted, 25 skipped')
  assert str(many).splitlines()[-1] == (
      '             ... 5 more (report.skipped lists all)')
  assert len(str(many).splitlines()) == 1 + 20 + 1


def test_convert_twice_is_a_no_op_whatever_the_recipe():
  """COAT layers (converted, or built so) are left as they are: a second
  conversion changes nothing, with another recipe neither."""
  model = GPT2(layers=1, rngs=nnx.Rngs(6318))
  first = coat_jax.convert(model)
  graph = nnx.graphdef(model)
  for recipe in (recipes.COAT, recipes.FP8_LINEAR):
    again = coat_jax.convert(model, recipe)
    assert not again.converted
    assert sorted(again.skipped) == sorted(
        Skipped(r.path, r.to_type, 'already a COAT layer (recipe coat)')
        for r in first.converted)
    assert nnx.graphdef(model) == graph
  assert model.h[0].attn.q.recipe == recipes.COAT


def test_containers_and_shared_layers():
  """Layers in nnx.List, nnx.Dict, nnx.Sequential, lists and dicts are
  converted where they are; a layer held twice is replaced at both places
  (one new layer); the model itself cannot be."""
  r = nnx.Rngs(6319)

  class Holder(nnx.Module):

    def __init__(self):
      self.seq = nnx.Sequential(nnx.Linear(16, 32, rngs=r), nnx.relu,
                                nnx.Linear(32, 16, rngs=r))
      self.by_name = nnx.Dict({'norm': nnx.RMSNorm(16, rngs=r)})
      self.in_list = nnx.data([nnx.Linear(16, 16, rngs=r)])
      self.in_dict = nnx.data({'ln': nnx.LayerNorm(16, rngs=r)})
      self.shared = self.seq.layers[0]

    def __call__(self, x):
      x = self.by_name['norm'](self.seq(x))
      return self.in_dict['ln'](self.in_list[0](x)) + self.shared(x).sum()

  model = Holder()
  x = jax.random.normal(jax.random.key(6320), (32, 16))
  ref = model(x)
  report = coat_jax.convert(model)
  assert not report.skipped and len(report.converted) == 5
  assert type(model.seq.layers[0]) is CoatLinear
  assert model.shared is model.seq.layers[0]
  assert type(model.by_name['norm']) is CoatRMSNorm
  assert type(model.in_list[0]) is CoatLinear
  assert type(model.in_dict['ln']) is CoatLayerNorm
  got = nnx.jit(lambda m, x: m(x))(model, x)
  assert np.linalg.norm(got - ref) < 0.05 * np.linalg.norm(ref)
  linear = nnx.Linear(16, 16, rngs=r)
  report = coat_jax.convert(linear)
  assert report.skipped == (Skipped(
      (), nnx.Linear, 'the model itself: convert a module that holds it'),)
  assert '(the model)' in str(report)


def test_abstract_model():
  """An nnx.eval_shape model converts too (nothing is allocated)."""
  model = nnx.eval_shape(lambda: GPT2(layers=1, rngs=nnx.Rngs(0)))
  report = coat_jax.convert(model)
  assert len(report.converted) == 9
  kernel = model.h[0].attn.q.kernel
  assert isinstance(kernel.get_raw_value(), jax.ShapeDtypeStruct)


def test_bad_arguments():
  model = GPT2(layers=1, rngs=nnx.Rngs(6321))
  with pytest.raises(TypeError, match='model must be an nnx.Module; got'
                     ' dict'):
    coat_jax.convert({'layer': model})
  with pytest.raises(ValueError, match="recipe='fp9' is not a recipe: pass"
                     ' a coat_jax.Recipe or one of the preset names'):
    coat_jax.convert(model, 'fp9')
  with pytest.raises(ValueError, match='recipe=None is not a recipe'):
    coat_jax.convert(model, None)
  with pytest.raises(TypeError, match='filter must be None or a callable'
                     r' filter\(path, module\) -> bool; got str'):
    coat_jax.convert(model, filter='attn')
  assert all(type(m) is not CoatLinear for _, m in nnx.iter_modules(model))


# --- Sharding and checkpoints -------------------------------------------------


def _mesh():
  return jax.make_mesh((2, 2, 2), ('data', 'fsdp', 'tensor'),
                       axis_types=(AxisType.Auto,) * 3)


def test_sharded_model_on_eight_devices():
  """A GPT-2 whose params are sharded by their logical axis names, on a
  (2, 2, 2) mesh of the fake CPU devices: converted, it trains under
  nnx.jit with the batch sharded, its params keep their shardings, and its
  first loss is the single-device converted model's (same init)."""
  tokens = _tokens(6322, batch=8, seq=33)
  plain = GPT2(layers=1, rngs=nnx.Rngs(6323))
  coat_jax.convert(plain)
  want = float(nnx.jit(gpt2_loss)(plain, tokens))
  mesh = _mesh()
  with jax.set_mesh(mesh), nnx.logical_axis_rules(
      coat_jax.nn.LOGICAL_AXIS_RULES):
    model = GPT2(layers=1, partitioned=True, rngs=nnx.Rngs(6323))
    shardings = {p: v[...].sharding for p, v in _variables(model).items()}
    assert shardings[('h', 0, 'mlp', 'fc', 'kernel')].spec == P('fsdp',
                                                               'tensor')
    report = coat_jax.convert(model)
    assert len(report.converted) == 9 and not report.skipped
    optimizer = nnx.Optimizer(model, coat_jax.coat_adamw(3e-3),
                              wrt=nnx.Param)
    batch = jax.device_put(tokens, NamedSharding(mesh, P(('data', 'fsdp'))))
    step = _train_step(gpt2_loss)
    losses = [float(step(model, optimizer, batch)) for _ in range(4)]
  print(f'sharded losses {np.round(losses, 4).tolist()}, single device'
        f' {want:.4f}')
  assert abs(losses[0] - want) < 1e-3 * want
  assert losses[-1] < losses[0]
  for path, v in _variables(model).items():
    assert v[...].sharding.is_equivalent_to(shardings[path], v[...].ndim)


def test_orbax_checkpoints_round_trip(tmp_path):
  """The converted model's state saved with orbax restores into an abstract
  converted model; a checkpoint written before the conversion restores
  into it too (the state tree is the same)."""
  model = GPT2(layers=1, rngs=nnx.Rngs(6324))
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / 'unconverted', nnx.state(model))
  coat_jax.convert(model)
  optimizer = nnx.Optimizer(model, coat_jax.coat_adamw(3e-3), wrt=nnx.Param)
  _train_step(gpt2_loss)(model, optimizer, _tokens(6325, batch=4, seq=33))
  checkpointer.save(tmp_path / 'converted', nnx.state(model))
  checkpointer.wait_until_finished()
  tokens = _tokens(6326, batch=4, seq=33)
  for name, source in (('converted', model),
                       ('unconverted', GPT2(layers=1, rngs=nnx.Rngs(6324)))):
    abstract = nnx.eval_shape(lambda: GPT2(layers=1, rngs=nnx.Rngs(0)))
    coat_jax.convert(abstract)
    graph, abstract_state = nnx.split(abstract)
    restored = nnx.merge(graph, checkpointer.restore(tmp_path / name,
                                                     abstract_state))
    assert type(restored.h[0].mlp.fc) is CoatLinear
    for a, b in zip(jax.tree.leaves(nnx.state(restored)),
                    jax.tree.leaves(nnx.state(source)), strict=True):
      np.testing.assert_array_equal(a, b)
    if name == 'converted':
      np.testing.assert_array_equal(
          nnx.jit(gpt2_loss)(restored, tokens),
          nnx.jit(gpt2_loss)(model, tokens))
