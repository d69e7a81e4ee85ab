"""Every model family against `transformers` on tiny random checkpoints:
logits, recipes, save_hf round trips and the errors of what is unsupported.

The oracle is the real library: each checkpoint is written by
`transformers` from a tiny random model (its norms and biases randomized
too, so that a wrong name map or a wrong norm formula shows), and
`coat_jax.models.load_hf` must reproduce its logits.
"""

import dataclasses
import json
import os

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import coat_jax
import coat_jax.models as cm
from coat_jax.models import families

SEED = 0
_BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96,
             num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)


def _hf_config(name: str):
  """A tiny transformers config of each family, with its peculiarities
  switched on (Llama 3 RoPE, Mistral's window and explicit head_dim, Qwen2's
  biases and tied embeddings, Qwen3's head_dim != hidden / heads, Gemma 3's
  interleaved layers, linear RoPE and query_pre_attn_scalar)."""
  if name == 'llama':
    return transformers.LlamaConfig(
        **_BASE, rms_norm_eps=1e-5, rope_scaling=dict(
            rope_type='llama3', factor=8.0, low_freq_factor=1.0,
            high_freq_factor=4.0, original_max_position_embeddings=32))
  if name == 'mistral':
    return transformers.MistralConfig(**_BASE, head_dim=32, sliding_window=8)
  if name == 'qwen2':
    return transformers.Qwen2Config(**_BASE, tie_word_embeddings=True)
  if name == 'qwen3':
    return transformers.Qwen3Config(**_BASE, head_dim=32)
  if name == 'olmo2':
    return transformers.Olmo2Config(**_BASE, eos_token_id=1, pad_token_id=0)
  assert name == 'gemma3'
  return transformers.Gemma3TextConfig(
      **{**_BASE, 'num_hidden_layers': 4}, head_dim=32,
      query_pre_attn_scalar=24, sliding_window=8,
      layer_types=['sliding_attention', 'full_attention'] * 2,
      rope_parameters={
          'full_attention': dict(rope_type='linear', factor=4.0,
                                 rope_theta=1e6),
          'sliding_attention': dict(rope_type='default', rope_theta=1e4)})


NAMES = ('llama', 'mistral', 'qwen2', 'qwen3', 'olmo2', 'gemma3')


def _hf_model(name: str):
  torch.manual_seed(SEED)
  model = transformers.AutoModelForCausalLM.from_config(
      _hf_config(name)).eval()
  with torch.no_grad():
    for param_name, p in model.named_parameters():
      if 'norm' in param_name:  # Gemma stores gain - 1
        p.uniform_(-0.5, 0.5) if name == 'gemma3' else p.uniform_(0.5, 1.5)
      elif 'bias' in param_name:
        p.normal_(0.0, 0.1)
  return model


@pytest.fixture(scope='module', params=NAMES)
def checkpoint(request, tmp_path_factory):
  """(family name, the transformers model, its float32 checkpoint dir)."""
  model = _hf_model(request.param)
  path = str(tmp_path_factory.mktemp(request.param))
  model.save_pretrained(path)
  return request.param, model, path


def _tokens(seq: int = 40) -> np.ndarray:
  return np.random.default_rng(SEED).integers(0, 256, (2, seq))


def _hf_logits(model, tokens) -> np.ndarray:
  with torch.no_grad():
    return model(torch.tensor(tokens)).logits.numpy()


def _rel(got, want) -> float:
  return float(np.abs(np.asarray(got, np.float32) - want).max()
               / np.abs(want).max())


def test_float32_logits_match_transformers(checkpoint):
  """The family's config, name map and layers are HF's: float32 logits
  within 1e-4 of transformers' (longer than the sliding windows)."""
  name, hf_model, path = checkpoint
  model = cm.load_hf(path, recipe='bf16', dtype=jnp.float32)
  assert families.of_config(model.config).name == name
  tokens = _tokens()
  got = model(jnp.asarray(tokens, jnp.int32))
  assert _rel(got, _hf_logits(hf_model, tokens)) < 1e-4


# Relative error of the logits against transformers' float32 ones. Over
# the families it was measured at most 0.022 with BF16 and 0.10-0.20 with
# FP8 matmuls (Gemma 3's and OLMo 2's tiny random models amplify the noise
# most: 8-10x their BF16 error, as for the others); a wrong scale or a
# wrong map gives errors near 1 or NaN.
TOLERANCES = {'bf16': 0.03, 'fp8_linear': 0.25, 'coat': 0.25,
              'coat_block': 0.25}


@pytest.mark.parametrize('recipe', tuple(TOLERANCES))
def test_recipes_track_transformers(checkpoint, recipe):
  name, hf_model, path = checkpoint
  model = cm.load_hf(path, recipe=recipe)
  tokens = _tokens()
  got = nnx.jit(lambda m, t: m(t))(model, jnp.asarray(tokens, jnp.int32))
  err = _rel(got, _hf_logits(hf_model, tokens))
  print(name, recipe, err)
  assert err < TOLERANCES[recipe]


def test_save_hf_round_trips_through_from_pretrained(checkpoint, tmp_path):
  """load_hf then save_hf gives transformers the same tensors, bit for
  bit, and a config it reads as the same architecture."""
  name, hf_model, path = checkpoint
  out = str(tmp_path / 'out')
  cm.save_hf(cm.load_hf(path, recipe='coat'), out)
  again = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  want = hf_model.state_dict()
  got = again.state_dict()
  assert set(got) == set(want)
  for key, tensor in want.items():
    assert torch.equal(got[key], tensor), key
  tokens = _tokens()
  np.testing.assert_array_equal(_hf_logits(again, tokens),
                                _hf_logits(hf_model, tokens))
  # And back: the saved config reads as the same family config.
  assert cm.load_hf(out).config == cm.load_hf(path).config


def test_family_configs_round_trip_through_hf_config():
  """Every preset's config survives to_hf -> from_hf (the fields HF
  checkpoints express)."""
  for name, family in families.presets().items():
    config = family.config_class.preset(name)
    hf = coat_jax.models.hf.hf_config(config)
    back = coat_jax.models.hf.config_from_hf(
        json.loads(json.dumps(hf)),
        {'init_std': config.init_std, 'remat': config.remat})
    assert back == config, name


def test_bf16_checkpoint_loads_and_saves_in_bfloat16(tmp_path):
  """A bfloat16 checkpoint (as most ship): its values load exactly (the
  float32 logits of the bf16-rounded weights) and save back bit for bit."""
  model = _hf_model('qwen3')
  with torch.no_grad():
    for p in model.parameters():
      p.copy_(p.bfloat16().float())
  tokens = _tokens()
  want = _hf_logits(model, tokens)
  model.to(torch.bfloat16).save_pretrained(str(tmp_path / 'bf16'))
  ours = cm.load_hf(str(tmp_path / 'bf16'), recipe='bf16', dtype=jnp.float32)
  assert ours.embed.dtype == jnp.float32
  assert _rel(ours(jnp.asarray(tokens, jnp.int32)), want) < 1e-4
  cm.save_hf(ours, str(tmp_path / 'out'), dtype='bfloat16')
  again = transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path / 'out'), dtype=torch.bfloat16)
  for key, tensor in model.state_dict().items():
    assert torch.equal(again.state_dict()[key], tensor), key


@pytest.mark.parametrize('change,match', [
    (dict(model_type='gpt2'), "model_type='gpt2' is not supported"),
    (dict(model_type='gemma3'), "model_type 'gemma3_text'"),
])
def test_unsupported_model_type_names_it(tmp_path, change, match):
  path = tmp_path / 'ckpt'
  path.mkdir()
  (path / 'config.json').write_text(json.dumps(
      {**_BASE, 'model_type': 'llama', **change}))
  with pytest.raises(ValueError, match=match):
    cm.load_hf(str(path))


@pytest.mark.parametrize('model_type,change,field', [
    ('llama', dict(mlp_bias=True), 'mlp_bias'),
    ('llama', dict(hidden_act='gelu'), 'hidden_act'),
    ('qwen3', dict(attention_bias=True), 'attention_bias'),
    ('olmo2', dict(attention_bias=True), 'attention_bias'),
    ('gemma3_text', dict(final_logit_softcapping=30.0),
     'final_logit_softcapping'),
    ('gemma3_text', dict(attn_logit_softcapping=50.0),
     'attn_logit_softcapping'),
    ('gemma3_text', dict(layer_types=['sliding_attention', 'full_attention',
                                      'full_attention', 'sliding_attention']),
     'layer_types'),
    ('llama', dict(rope_scaling=dict(rope_type='yarn', factor=2.0)),
     'rope_scaling.rope_type'),
])
def test_unsupported_options_name_the_field(model_type, change, field):
  hf = {**_BASE, 'num_hidden_layers': 4, 'model_type': model_type, **change}
  with pytest.raises(ValueError, match=f'config.json: {field}'):
    coat_jax.models.hf.config_from_hf(hf)


def test_save_hf_refuses_what_the_family_cannot_express(tmp_path):
  config = cm.LlamaConfig.preset('tiny', qk_norm='head')
  model = cm.Decoder(config, recipe='bf16', rngs=nnx.Rngs(SEED))
  with pytest.raises(ValueError, match='qk_norm'):
    cm.save_hf(model, str(tmp_path / 'out'))
  assert not os.path.exists(tmp_path / 'out')
  bare = cm.Decoder(cm.DecoderConfig(**cm.LlamaConfig.PRESETS['tiny']),
                    recipe='bf16', rngs=nnx.Rngs(SEED))
  with pytest.raises(ValueError, match='no model family'):
    cm.save_hf(bare, str(tmp_path / 'bare'))


def test_presets_of_every_family():
  assert isinstance(cm.preset('qwen3_1.7b'), cm.Qwen3Config)
  assert cm.preset('qwen3_1.7b').head_features == 128
  assert cm.preset('gemma3_1b').layer_types.count('full') == 4  # 26 / 6
  assert cm.preset('olmo2_1b').norm_placement == 'post'
  assert cm.preset('1b', num_layers=3).num_layers == 3
  with pytest.raises(ValueError, match="preset 'qwen9' is unknown"):
    cm.preset('qwen9')
  with pytest.raises(ValueError, match='scan_layers=True needs every layer'):
    cm.preset('gemma3_tiny', scan_layers=True)


def test_scanned_layers_equal_unrolled_for_a_family():
  """The stack's two layouts agree for a non-Llama family too (Qwen3:
  per-head QK norms and biases in the scanned body)."""
  config = cm.preset('qwen3_tiny')
  tokens = jnp.asarray(_tokens(32), jnp.int32)
  losses = []
  for scan in (False, True):
    model = cm.Decoder(dataclasses.replace(config, scan_layers=scan),
                       recipe='bf16', dtype=jnp.float32,
                       rngs=nnx.Rngs(SEED))
    losses.append(float(cm.lm_loss(model, tokens, tokens)))
  np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)


def test_every_family_trains_a_step_in_every_recipe():
  for name in ('qwen3_tiny', 'olmo2_tiny', 'gemma3_tiny', 'mistral_tiny',
               'qwen2_tiny'):
    config = cm.preset(name)
    tokens = jnp.asarray(_tokens(32), jnp.int32)
    for recipe in ('coat', 'coat_block'):
      model = cm.Decoder(config, recipe=recipe, rngs=nnx.Rngs(SEED))
      graph, state = nnx.split(model)
      loss, grads = jax.jit(jax.value_and_grad(
          lambda s: cm.lm_loss(nnx.merge(graph, s), tokens, tokens)))(state)
      assert np.isfinite(float(loss)), (name, recipe)
      norms = [float(jnp.linalg.norm(g)) for g in jax.tree.leaves(grads)]
      assert all(np.isfinite(norms)) and min(norms) > 0, (name, recipe)
