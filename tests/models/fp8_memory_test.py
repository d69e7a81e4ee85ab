"""coat's compiled step keeps what its FP8 residuals promise, not more.

XLA fused the forward's 1x16 quantization into the backward's
dequantization (keeping the bfloat16 inputs across the layers instead of
the FP8 codes) and scheduled float32 dequantized copies in the forward pass
(`coat_jax.nn.residuals.after_grads` stops both). XLA:CPU drops
optimization barriers before fusion, XLA:GPU only after scheduling: on CPU
these tests keep them (`xla_disable_hlo_passes`) to compile what the GPU
compiler sees.
"""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coat_jax import recipes
import coat_jax.models as cm
from coat_jax.models import decoder
from coat_jax.models import remat
from coat_jax.models.decoder import DecoderLayer
from coat_jax.models.decoder import rope_tables
import coat_jax.nn as cnn
from coat_jax.nn import residuals
from tests import compiled_step

DIMS = dict(hidden_size=256, intermediate_size=704, num_heads=4,
            num_kv_heads=2)
BATCH, SEQ = 8, 128


def _step_temp(cfg, recipe):
  return compiled_step.temp_bytes(cfg, recipe, BATCH, SEQ,
                                  compiled_step.gpu_like_options())


def _layer_residual_bytes(cfg, recipe, policy):
  """Bytes of one decoder layer's activation residuals (jax.vjp's)."""
  layer = nnx.eval_shape(lambda: DecoderLayer(
      cfg, recipe=recipes.get(recipe), dtype=jnp.bfloat16,
      param_dtype=jnp.float32, implementation=None, rngs=nnx.Rngs(0)))
  graph, state = nnx.split(layer)
  cos, sin = rope_tables(SEQ, cfg.head_features, cfg.rope_theta)
  body = remat.apply(lambda lay, x: lay(x, (cos, sin)), policy,
                     in_scan=False)
  fn = lambda s, x: body(nnx.merge(graph, s), x)
  x = lambda b: jax.ShapeDtypeStruct((b, SEQ, cfg.hidden_size), jnp.bfloat16)
  return residuals.nbytes(cnn.activation_residuals(
      fn, (state, x(BATCH)), (state, x(2 * BATCH))))


def test_unrolled_coat_step_keeps_its_residuals_per_layer():
  # Measured on this CPU (unrolled layers, remat 'none'): what 2 more layers
  # add, per layer, against one layer's residuals (10.09 MiB): 24.11 MiB
  # without the barriers (2.39x: bf16 gate, up and norm inputs, float32
  # dequantized copies), 11.51 MiB with them (1.14x), 10.97 MiB (1.09x)
  # with a one-GEMM fan-out backward (not kept). Larger widths (512, batch 16):
  # 42.1 -> 15.8 U per layer against 14.6 U of residuals. On an H200 (its
  # own fusion and cuDNN attention): 7.07 MiB per layer against 5.07 MiB of
  # residuals (1.39x); the 1b step's peak went from 26.2 to 21.1 GiB.
  # Scanned layers stack the residuals as while-loop outputs, where XLA
  # cannot fuse through them (and XLA:CPU converts stacked FP8 to f16).
  cfg = lambda n: cm.LlamaConfig.preset(
      'tiny', num_layers=n, scan_layers=False, remat='none', **DIMS)
  per_layer = (_step_temp(cfg(4), 'coat') - _step_temp(cfg(2), 'coat')) / 2
  saved = _layer_residual_bytes(cfg(1), 'coat', 'none')
  print(f'coat: {per_layer / 2**20:.2f} MiB per layer, residuals'
        f' {saved / 2**20:.2f} MiB')
  bound = 1.3 if jax.default_backend() == 'cpu' else 1.5
  assert 0 < per_layer <= bound * saved


def _grads(cfg, tokens):
  model = cm.Llama(cfg, recipe='coat', rngs=nnx.Rngs(0))
  graph, state = nnx.split(model)
  loss_fn = lambda s: cm.lm_loss(nnx.merge(graph, s), tokens,
                                 jnp.roll(tokens, -1, axis=1))
  return jax.jit(jax.grad(loss_fn))(state)


@pytest.mark.gpu
def test_out_projection_reuses_flash_attention_output(monkeypatch, seed):
  """cuDNN flash attention keeps its output o for its backward; the out
  projection saves that o rather than an FP8 copy: H bytes per token less
  per layer at the backward's start, the same gradients, bit for bit (but
  the embedding's, summed in no fixed order)."""
  layers, batch, seq = 4, 4, 512
  cfg = cm.LlamaConfig.preset(
      'tiny', num_layers=layers, scan_layers=False, remat='none',
      hidden_size=1024, intermediate_size=2816, num_heads=8, num_kv_heads=2,
      max_seq_len=seq)
  q = jnp.zeros((batch, seq, cfg.num_heads, cfg.head_features), jnp.bfloat16)
  k = jnp.zeros((batch, seq, cfg.num_kv_heads, cfg.head_features), jnp.bfloat16)
  assert decoder._causal_attention(q, k, k)[1]  # cuDNN takes these shapes
  temp = lambda: compiled_step.temp_bytes(cfg, 'coat', batch, seq)
  tokens = jax.random.randint(jax.random.key(seed), (batch, seq), 0, 256)
  reused, grads = temp(), _grads(cfg, tokens)
  attend = decoder._causal_attention
  monkeypatch.setattr(decoder, '_causal_attention',
                      lambda q, k, v, **kw: (attend(q, k, v, **kw)[0], False))
  copied, grads_copied = temp(), _grads(cfg, tokens)
  o_fp8 = batch * seq * cfg.hidden_size  # one layer's E4M3 o^T
  print(f'step temp: {reused / 2**20:.1f} MiB reusing o, {copied / 2**20:.1f}'
        f' MiB with FP8 copies ({o_fp8 / 2**20:.1f} MiB a layer)')
  assert copied - reused >= 0.9 * (layers - 1) * o_fp8
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads),
                          jax.tree.leaves(grads_copied)):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.isfinite(a).all()
    if 'embed' in jax.tree_util.keystr(path):
      # The embedding's gradient is a scatter-add, which the GPU sums in
      # no fixed order (1-4 of its 262144 elements differed by an ulp).
      np.testing.assert_allclose(a, b, rtol=1e-5,
                                 atol=1e-6 * np.abs(b).max())
    else:
      np.testing.assert_array_equal(a, b)


def test_forward_barrier_only_where_xla_quantizes(pick_pallas):
  """Where XLA quantizes (here: CPU; under FSDP on GPUs), each FP8 forward
  rule returns its outputs and FP8 residuals through one optimization
  barrier (`residuals.with_residuals`: FSDP, 1b, 2 GPUs compiled, 9.97 ->
  7.54 GiB per device); where the Pallas kernels quantize (one Hopper GPU)
  it does not (there it cost 1.6% of the step)."""
  x = jnp.ones((32, 64), jnp.bfloat16)
  w = jnp.ones((64, 48), jnp.float32)
  mlp = cnn.CoatMLP(64, 96, rngs=nnx.Rngs(0))
  norm = cnn.CoatRMSNorm(64, rngs=nnx.Rngs(0))

  def barriers():
    count = lambda f, *a: str(jax.make_jaxpr(f)(*a)).count(
        'optimization_barrier')
    return (count(lambda x, w: cnn.fp8_dense(x, [w]), x, w),
            count(lambda x: mlp(x), x), count(lambda x: norm(x), x))

  assert residuals.xla_quantizes()
  # fp8_dense; gate/up + SwiGLU + down; the norm.
  assert barriers() == (1, 3, 1)
  pick_pallas()  # the layers' Pallas kernels, as on one Hopper GPU
  assert not residuals.xla_quantizes()
  assert barriers() == (0, 0, 0)


def test_norm_backward_barrier_only_where_xla_quantizes(monkeypatch,
                                                        pick_pallas, seed):
  """Where XLA quantizes, the norm's backward returns its gradients through
  one more barrier (`residuals.reduced_now`), so that the gain's sum over
  the tokens is taken where its terms are computed (Llama-2-7B, FSDP on 4
  H200s, compiled: XLA kept each norm's float32 terms g * x_hat until the
  end of backward, 60 x 64 MiB per device; temp 15.38 -> 13.24 GiB). Not
  where the Pallas kernel sums in its own pass. The gradients are the
  same."""
  from coat_jax.nn import norm as norm_lib  # pylint: disable=g-import-not-at-top
  graph, state = nnx.split(cnn.CoatRMSNorm(64, rngs=nnx.Rngs(0)))
  x = jax.random.normal(jax.random.key(seed), (32, 64), jnp.bfloat16)

  def grads():  # a new function each time: no cached trace
    loss = lambda s, x: jnp.sum(
        nnx.merge(graph, s)(x).astype(jnp.float32) ** 2)
    return jax.grad(loss, argnums=(0, 1))

  def barriers():
    return str(jax.make_jaxpr(grads())(state, x)).count(
        'optimization_barrier')

  assert residuals.xla_quantizes()
  # forward's outputs, backward's inputs (after_grads), backward's outputs.
  assert barriers() == 3
  want = jax.jit(grads())(state, x)
  monkeypatch.setattr(norm_lib, 'reduced_now', lambda grads: grads)
  assert barriers() == 2
  got = jax.jit(grads())(state, x)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.isfinite(b).all() and np.abs(b).max() > 0
    np.testing.assert_array_equal(a, b)
  monkeypatch.undo()
  pick_pallas()
  assert not residuals.xla_quantizes()
  assert barriers() == 1


@pytest.mark.gpu
@pytest.mark.parametrize('recipe', ['fp8_linear', 'coat', 'coat_block'])
@pytest.mark.parametrize('policy', ['minimal', 'full'])
def test_scanned_layers_keep_float32_weights_in_their_layout(recipe, policy):
  """Under a layer scan XLA:GPU laid the stacked float32 weights out
  transposed for the FP8 quantizer: a copy of every weight before the loop
  (Llama-2-7B, remat full, batch 16, compiled for an H200: 56.6 -> 37.9 GiB
  of temp without it). The layers ask for them row-major
  (`coat_jax.models.decoder._row_major_weights`). XLA:CPU never made the
  copy."""
  layers = 3  # no other size of the model
  cfg = cm.LlamaConfig.preset('tiny', scan_layers=True, num_layers=layers,
                              remat=policy, **DIMS)
  hlo = compiled_step.compile_loss_step(cfg, recipe, BATCH, SEQ).as_text()
  copies = compiled_step.transposed_weight_stacks(hlo, layers)
  assert not copies, copies[:4]
