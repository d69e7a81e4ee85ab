"""benchmarks/plain_llama.py: the same model and FLOPs as coat_jax's Llama."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import plain_llama
from coat_jax import models
import coat_jax.nn as cnn


def _coat_params_as_plain(coat_params: dict, num_layers: int) -> dict:
  """coat_jax's stacked-layer params renamed to PlainLlama's."""
  plain = {'embed': {'embedding': coat_params['embed']},
           'norm': coat_params['norm'],
           'layers': {i: jax.tree.map(lambda a: a[i], coat_params['layers'])
                      for i in range(num_layers)}}
  if coat_params.get('lm_head') is not None:
    plain['lm_head'] = {'kernel': coat_params['lm_head']}
  return plain


@pytest.mark.parametrize('tie', [False, True])
def test_loss_matches_coat_bf16_llama_on_the_same_weights(tie):
  cfg = models.LlamaConfig.preset('tiny', tie_embeddings=tie)
  coat = models.Llama(cfg, precision='bf16', rngs=nnx.Rngs(1))
  graph, coat_params = nnx.split(coat, nnx.Param)
  coat_params = nnx.to_pure_dict(coat_params)
  # Larger weights than init, so that a wrong layer changes the loss a lot.
  coat_params = jax.tree.map(
      lambda a: a * 4 if a.ndim >= 2 else a + 0.3 * np.random.default_rng(
          a.size).standard_normal(a.shape), coat_params)
  tokens = jax.random.randint(jax.random.key(2), (2, 33), 0, cfg.vocab_size)
  x, y = tokens[:, :-1], tokens[:, 1:]
  plain = nnx.eval_shape(lambda: plain_llama.PlainLlama(cfg, nnx.Rngs(0)))
  plain_graph, plain_state = nnx.split(plain, nnx.Param)
  want_paths = {p for p, _ in nnx.to_flat_state(plain_state)}
  mapped = _coat_params_as_plain(coat_params, cfg.num_layers)
  got_paths = {p for p, _ in nnx.to_flat_state(nnx.State(mapped))}
  assert got_paths == want_paths
  nnx.replace_by_pure_dict(plain_state, mapped)
  plain = nnx.merge(plain_graph, plain_state)
  coat = nnx.merge(graph, coat_params)
  want = np.asarray(coat(x))
  got = np.asarray(plain(x)).astype(np.float32)
  assert np.isfinite(got).all()
  # BF16 logits here, float32 there, and the norms round differently: the
  # logits differ by ~1% of their spread on average (a wrong RoPE sign, a
  # non-causal mask or a missing norm gives 10% or more).
  err = np.abs(got - want)
  assert err.mean() < 0.02 * want.std() and err.max() < 0.15 * want.std()
  np.testing.assert_allclose(float(plain_llama.loss_fn(plain, x, y)),
                             float(models.lm_loss(coat, x, y)), rtol=5e-3)


@pytest.mark.parametrize('preset', ['1b', 'llama2_7b'])
def test_param_count_matches_coat_llama(preset):
  cfg = models.LlamaConfig.preset(preset)
  count = lambda m: sum(x.size for x in jax.tree.leaves(nnx.state(
      nnx.eval_shape(m), nnx.Param)))
  assert count(lambda: plain_llama.PlainLlama(cfg, nnx.Rngs(0))) == count(
      lambda: models.Llama(cfg, precision='bf16', rngs=nnx.Rngs(0)))


def test_train_step_lowers_loss_and_donates():
  cfg = models.LlamaConfig.preset('tiny')
  init_state, step = plain_llama.build(cfg, learning_rate=1e-2)
  state = init_state()
  assert all(x.dtype == jnp.float32
             for x in jax.tree.leaves(state['params']))
  tokens = jax.random.randint(jax.random.key(0), (4, 17), 0, cfg.vocab_size)
  losses = []
  for _ in range(8):
    old = state
    state, metrics = step(state, tokens[:, :-1], tokens[:, 1:])
    losses.append(float(metrics['loss']))
  assert jax.tree.leaves(old['params'])[0].is_deleted()
  assert np.isfinite(losses).all() and losses[-1] < losses[0] - 0.5


@pytest.mark.gpu
def test_attention_is_cudnn_flash_attention_on_gpu():
  """The baseline must not fall back to XLA attention (it would be slow)."""
  cfg = models.LlamaConfig.preset('tiny', hidden_size=256, num_heads=4,
                                  num_kv_heads=2, intermediate_size=512)
  init_state, step = plain_llama.build(cfg)
  tokens = jax.random.randint(jax.random.key(0), (2, 129), 0, cfg.vocab_size)
  hlo = step.lower(init_state(), tokens[:, :-1], tokens[:, 1:]).compile(
  ).as_text()
  assert 'cudnn$fmha' in hlo


def test_converted_build_trains_with_fp8_layers_and_moments():
  """e2e.py's mode 'converted': the plain model as a user converts it (the
  SwiGLU drop-in, coat_jax.convert, coat_adamw) has the plain model's params
  and trains."""
  cfg = models.preset('qwen3_tiny')  # head_dim != hidden / heads, QK norms
  model = plain_llama.make_model(cfg, recipe='coat')
  assert isinstance(model.layers[0].mlp.up_proj, cnn.CoatLinear)
  assert isinstance(model.layers[0].attn.q_norm, cnn.CoatRMSNorm)
  plain = nnx.state(plain_llama.make_model(cfg), nnx.Param)
  converted = nnx.state(model, nnx.Param)
  assert (jax.tree.structure(plain) == jax.tree.structure(converted))
  init_state, step = plain_llama.build(cfg, recipe='coat',
                                       learning_rate=3e-3)
  state = init_state()
  tokens = jax.random.randint(jax.random.key(3), (2, 33), 0, cfg.vocab_size)
  losses = []
  for _ in range(4):
    state, metrics = step(state, tokens[:, :-1], tokens[:, 1:])
    losses.append(float(metrics['loss']))
  assert np.isfinite(losses).all() and losses[-1] < losses[0], losses


def test_converted_fused_build_steps_as_converted():
  """e2e.py's mode 'converted_fused': the converted model with
  FusedCoatAdamW takes the steps of the optax chain (clip, coat_adamw) up
  to float rounding, and refuses a model without a recipe."""
  cfg = models.preset('qwen3_tiny')
  tokens = jax.random.randint(jax.random.key(3), (2, 33), 0, cfg.vocab_size)
  runs = {}
  for fused in (False, True):
    init_state, step = plain_llama.build(cfg, recipe='coat',
                                         learning_rate=3e-3, fused=fused)
    state, losses = init_state(), []
    for _ in range(3):
      state, metrics = step(state, tokens[:, :-1], tokens[:, 1:])
      losses.append(float(metrics['loss']))
    params = (nnx.to_pure_dict(state[0]) if fused
              else state['params'])
    runs[fused] = losses, params
  np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=1e-4)
  got, want = runs[True][1], runs[False][1]
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    a, b = np.asarray(a), np.asarray(b)
    # An FP8 moment rounded the other way at a tie moves its element by
    # less than a step (lr 3e-3); the rest agree to float rounding.
    assert np.mean(~np.isclose(a, b, rtol=1e-4, atol=1e-5)) < 1e-3
    np.testing.assert_allclose(a, b, atol=3e-3)
  with pytest.raises(ValueError, match='fused=True needs a recipe'):
    plain_llama.build(cfg, fused=True)
