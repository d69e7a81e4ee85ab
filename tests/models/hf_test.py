"""Hugging Face Llama checkpoints: load_hf / save_hf against transformers.

transformers (and torch) are the oracle: the test extra installs them, and
a machine without them fails here rather than skipping the comparison."""

import json
import os

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors
import torch
import transformers

import coat_jax.models as cm
from coat_jax.models import decoder
from coat_jax.models import hf
from coat_jax.training import config as config_lib
from coat_jax.training import trainer

SEQ = 100  # > the Llama 3 config's original_max_position_embeddings
LLAMA2 = dict(vocab_size=256, hidden_size=64, intermediate_size=176,
              num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=4, max_position_embeddings=256,
              rope_theta=10000.0, rms_norm_eps=1e-5,
              tie_word_embeddings=False)
LLAMA3 = dict(LLAMA2, num_key_value_heads=2, rope_theta=500000.0,
              rms_norm_eps=1e-6, tie_word_embeddings=True,
              rope_scaling=dict(rope_type='llama3', factor=8.0,
                                low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_position_embeddings=64))


def _tokens(seed, batch=2, seq=SEQ):
  return np.random.default_rng(seed).integers(0, 256, (batch, seq))


def _hf_logits(model, tokens):
  with torch.no_grad():
    return model(torch.tensor(tokens)).logits.float().numpy()


def _logits(model, tokens):
  return np.asarray(model(jnp.asarray(tokens, jnp.int32)))


@pytest.fixture(scope='module')
def hf_dirs(tmp_path_factory, seed):
  """{'llama2', 'llama2_float16', 'llama3'}: (dir, the float32 transformers
  model of it).

  Llama 2: MHA, untied, one model.safetensors, float32 or float16 (how most
  Llama 2 checkpoints ship). Llama 3: GQA, rope_scaling llama3, tied
  embeddings, bfloat16 in sharded files.
  """
  torch.manual_seed(seed)
  out = {}
  for name, kwargs, dtype, shard in (
      ('llama2', LLAMA2, torch.float32, '5GB'),
      ('llama2_float16', LLAMA2, torch.float16, '5GB'),
      ('llama3', LLAMA3, torch.bfloat16, '40KB')):
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs))
    path = str(tmp_path_factory.mktemp(name))
    model.to(dtype).save_pretrained(path, max_shard_size=shard)
    # Reloaded: .to(bfloat16) also rounded the rotary inv_freq buffer.
    out[name] = (path, transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32).eval())
  for name in ('llama2', 'llama2_float16'):
    assert os.path.isfile(os.path.join(out[name][0], hf.SINGLE_FILE))
  assert os.path.isfile(os.path.join(out['llama3'][0], hf.INDEX_FILE))
  return out


@pytest.mark.parametrize('name', ['llama2', 'llama2_float16', 'llama3'])
def test_float32_logits_equal_transformers(hf_dirs, name, seed):
  path, reference = hf_dirs[name]
  tokens = _tokens(seed)
  want = _hf_logits(reference, tokens)
  model = cm.load_hf(path, 'bf16', dtype=jnp.float32)
  assert model.config.tie_embeddings == (name == 'llama3')
  assert (model.config.num_kv_heads < model.config.num_heads) == (
      name == 'llama3')
  np.testing.assert_allclose(_logits(model, tokens), want, rtol=0,
                             atol=1e-5 * np.abs(want).max())


def test_float16_checkpoint_loads_its_values(hf_dirs):
  """A float16 model.safetensors (transformers' save of a float16 model):
  every param is the file's float16 value, exactly, in float32."""
  path, reference = hf_dirs['llama2_float16']
  with safetensors.safe_open(os.path.join(path, hf.SINGLE_FILE), 'np') as f:
    dtypes = {f.get_tensor(k).dtype for k in f.keys()}
  assert dtypes == {np.dtype(np.float16)}
  params = nnx.to_pure_dict(nnx.state(cm.load_hf(path, 'bf16'), nnx.Param))
  want = {k: v.numpy() for k, v in reference.state_dict().items()}
  layers = params['layers']
  for i in range(LLAMA2['num_hidden_layers']):
    prefix = f'model.layers.{i}.'
    for got, name in (
        (layers['attn']['q_proj']['kernel'][i].T, 'self_attn.q_proj.weight'),
        (layers['attn']['v_proj']['kernel'][i].T, 'self_attn.v_proj.weight'),
        (layers['mlp']['down_proj']['kernel'][i].T, 'mlp.down_proj.weight'),
        (layers['mlp_norm']['scale'][i], 'post_attention_layernorm.weight')):
      assert got.dtype == jnp.float32
      np.testing.assert_array_equal(got, want[prefix + name], err_msg=name)
  np.testing.assert_array_equal(params['embed'],
                                want['model.embed_tokens.weight'])
  np.testing.assert_array_equal(params['lm_head'], want['lm_head.weight'].T)
  # Not all of them zero or a constant: float16 values, read as float16.
  assert np.unique(want['lm_head.weight']).size > 1000


def test_llama3_rope_scaling_is_applied(hf_dirs, seed):
  path, reference = hf_dirs['llama3']
  tokens = _tokens(seed, 1)
  want = _hf_logits(reference, tokens)
  plain = cm.load_hf(path, 'bf16', dtype=jnp.float32, rope_scaling=None)
  # Without the scaling the far positions differ: the test above can tell.
  assert np.abs(_logits(plain, tokens) - want).max() > 1e-3 * np.abs(
      want).max()


@pytest.mark.parametrize('name', ['llama2', 'llama3'])
def test_bf16_mode_logits_within_bf16_tolerance(hf_dirs, name, seed):
  path, reference = hf_dirs[name]
  tokens = _tokens(seed)
  want = _hf_logits(reference, tokens)
  got = _logits(cm.load_hf(path, 'bf16'), tokens)
  err = np.abs(got - want)
  scale = np.abs(want).max()
  assert err.max() < 3e-2 * scale and err.mean() < 4e-3 * scale
  assert np.isfinite(got).all()


def test_coat_mode_loads_and_runs(hf_dirs, seed):
  path, reference = hf_dirs['llama2']
  tokens = _tokens(seed, 1, 32)
  want = _hf_logits(reference, tokens)
  got = _logits(cm.load_hf(path, 'coat'), tokens)
  cos = (got * want).sum() / np.linalg.norm(got) / np.linalg.norm(want)
  assert cos > 0.99  # FP8 linears: close, not equal


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_save_hf_round_trips_through_transformers(hf_dirs, tmp_path, dtype,
                                                 seed):
  path, reference = hf_dirs['llama3']
  model = cm.load_hf(path, 'bf16', dtype=jnp.float32)
  out = str(tmp_path / 'out')
  sharded = dtype == 'bfloat16'
  cm.save_hf(model, out, dtype=dtype,
             max_shard_size=30_000 if sharded else 2**30)
  assert os.path.isfile(os.path.join(out, hf.INDEX_FILE)) == sharded
  loaded = transformers.AutoModelForCausalLM.from_pretrained(
      out, dtype=torch.float32).eval()
  tokens = _tokens(seed)
  want = _hf_logits(reference, tokens)
  # The checkpoint holds bf16 weights, so either save is exact.
  np.testing.assert_array_equal(_hf_logits(loaded, tokens), want)
  again = cm.load_hf(out, 'bf16', dtype=jnp.float32)
  assert again.config == model.config
  jax.tree.map(np.testing.assert_array_equal,
               nnx.to_pure_dict(nnx.state(again, nnx.Param)),
               nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def test_save_then_load_untied_float32_is_exact(tmp_path, seed):
  config = cm.LlamaConfig.preset('tiny', num_kv_heads=4,
                                 rope_scaling=cm.RopeScaling(
                                     original_max_position_embeddings=64))
  model = cm.Llama(config, recipe='bf16', rngs=nnx.Rngs(seed))
  cm.save_hf(model, tmp_path, max_shard_size=20_000)
  cm.save_hf(model, tmp_path)  # over the sharded one: no stale shards left
  assert sorted(os.listdir(tmp_path)) == ['config.json', hf.SINGLE_FILE]
  again = cm.load_hf(tmp_path, 'bf16')
  assert again.config == config
  jax.tree.map(np.testing.assert_array_equal,
               nnx.to_pure_dict(nnx.state(again, nnx.Param)),
               nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def test_loads_onto_the_fsdp_sharding_of_train_py(tmp_path, seed):
  model = cm.Llama(cm.LlamaConfig.preset('tiny'), recipe='coat',
                   rngs=nnx.Rngs(seed))
  cm.save_hf(model, tmp_path, dtype='bfloat16', max_shard_size=30_000)
  config = config_lib.Config()
  config.model.init_from = str(tmp_path)
  config.mesh = config_lib.MeshConfig(data=1, fsdp=8, tensor=1)
  config.optim.group_size = 8  # lets the fsdp axis split more params
  setup = trainer.build(config, jax.devices())
  want = setup.state_shardings['params']
  reads, read = [], hf._Tensors.read

  def recorded(self, name, index):
    x = read(self, name, index)
    reads.append((name, x.shape))
    return x

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(hf._Tensors, 'read', recorded)
    loaded = cm.load_hf(tmp_path, 'coat', shardings=want)
  # Each device's shard is read, once per distinct shard, not the tensor.
  embed = [shape for name, shape in reads
           if name == 'model.embed_tokens.weight']
  assert embed == [(256, 8)] * 8
  # Stacked params: one layer's shard at a time ((out, in) slices).
  q = [shape for name, shape in reads if name.endswith('q_proj.weight')]
  assert q == [(64, 8)] * 16
  got = nnx.to_pure_dict(nnx.state(loaded, nnx.Param))
  jax.tree.map(lambda x, s: x.sharding.is_equivalent_to(s, x.ndim)
               or pytest.fail(f'{x.sharding} != {s}'), got, want)
  assert got['layers']['attn']['q_proj']['kernel'].sharding.spec[1] == 'fsdp'
  assert got['embed'].sharding.spec == jax.sharding.PartitionSpec(None, 'fsdp')
  assert len(got['embed'].addressable_shards) == 8
  reference = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  jax.tree.map(
      lambda a, b: np.testing.assert_array_equal(
          np.asarray(a), np.asarray(b.astype(jnp.bfloat16), np.float32)),
      got, reference)


def _write(tmp_path, **changes):
  """A tiny checkpoint written by save_hf, its config.json edited."""
  model = cm.Llama(cm.LlamaConfig.preset('tiny'), recipe='bf16',
                   rngs=nnx.Rngs(0))
  cm.save_hf(model, tmp_path, max_shard_size=30_000)
  file = os.path.join(tmp_path, 'config.json')
  with open(file) as f:
    config = json.load(f)
  config.update(changes)
  with open(file, 'w') as f:
    json.dump(config, f)
  return str(tmp_path)


@pytest.mark.parametrize('changes, error', [
    (dict(model_type='gpt2'), "model_type='gpt2' is not supported"),
    (dict(rope_scaling=dict(rope_type='yarn', factor=4.0)),
     'config.json: rope_scaling.rope_type="yarn" is not supported'),
    (dict(rope_parameters=dict(rope_type='dynamic', factor=2.0)),
     'config.json: rope_parameters.rope_type="dynamic" is not'
     ' supported'),
    (dict(attention_bias=True), 'attention_bias=true is not supported'),
    (dict(mlp_bias=True), 'mlp_bias=true is not supported'),
    (dict(hidden_act='gelu'), 'hidden_act="gelu" is not supported'),
    (dict(head_dim=32),
     r"'model.layers.0.self_attn.k_proj.weight' has shape \(32, 64\);"
     r' config.json implies \(64, 64\)'),
    (dict(intermediate_size=192),
     r"'model.layers.0.mlp.down_proj.weight' has shape \(64, 176\);"
     r' config.json implies \(64, 192\)'),
])
def test_unsupported_or_inconsistent_config_is_refused(tmp_path, changes,
                                                       error):
  path = _write(tmp_path, **changes)
  with pytest.raises(ValueError, match=error):
    cm.load_hf(path)


def test_missing_files_are_named(tmp_path):
  path = _write(tmp_path)
  with open(os.path.join(path, hf.INDEX_FILE)) as f:
    shard = json.load(f)['weight_map']['model.norm.weight']
  os.remove(os.path.join(path, shard))
  with pytest.raises(FileNotFoundError, match=f'{shard}: missing shard'):
    cm.load_hf(path)
  os.remove(os.path.join(path, hf.INDEX_FILE))
  with pytest.raises(FileNotFoundError, match='neither model.safetensors'):
    cm.load_hf(path)
  os.remove(os.path.join(path, 'config.json'))
  with pytest.raises(FileNotFoundError, match='config.json: no such file'):
    cm.load_hf(path)


def test_override_that_changes_the_weights_is_refused(tmp_path):
  path = _write(tmp_path)
  with pytest.raises(ValueError, match=r'hidden_size=128 conflicts with the'
                     r' checkpoint \(config.json hidden_size=64\)'):
    cm.load_hf(path, hidden_size=128)
  model = cm.load_hf(path, 'bf16', max_seq_len=64, scan_layers=False)
  assert model.config.max_seq_len == 64 and not model.config.scan_layers


def test_save_hf_bad_arguments(tmp_path):
  model = cm.Llama(cm.LlamaConfig.preset('tiny'), recipe='bf16',
                   rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="dtype='float16' must be"):
    cm.save_hf(model, tmp_path, dtype='float16')
  with pytest.raises(ValueError, match='max_shard_size=0'):
    cm.save_hf(model, tmp_path, max_shard_size=0)


def test_rope_scaling_arguments_are_checked():
  with pytest.raises(ValueError, match='high_freq_factor=1.0 must be'):
    cm.RopeScaling(low_freq_factor=1.0, high_freq_factor=1.0)
  with pytest.raises(ValueError, match='factor must be positive'):
    cm.RopeScaling(factor=0.0)
  with pytest.raises(ValueError,
                     match='original_max_position_embeddings must be'):
    cm.RopeScaling(original_max_position_embeddings=0)
  cos, sin = decoder.rope_tables(8, 16, 500000.0)
  cos3, sin3 = decoder.rope_tables(
      8, 16, 500000.0, cm.RopeScaling(original_max_position_embeddings=64))
  # High frequencies are kept, the lowest are divided by the factor.
  np.testing.assert_array_equal(cos3[:, 0], cos[:, 0])
  assert not np.allclose(sin3[:, -1], sin[:, -1], rtol=0.5)


@pytest.mark.gpu
@pytest.mark.parametrize('recipe', ['bf16', 'coat'])
def test_gpu_logits_follow_transformers(hf_dirs, recipe, seed):
  """On a Hopper GPU (cuDNN attention, FP8 GEMMs), against CPU torch."""
  for name in ('llama2', 'llama3'):
    path, reference = hf_dirs[name]
    tokens = _tokens(seed, 4, 64)
    want = _hf_logits(reference, tokens)
    got = _logits(cm.load_hf(path, recipe), tokens)
    assert np.isfinite(got).all()
    cos = (got * want).sum() / np.linalg.norm(got) / np.linalg.norm(want)
    assert cos > (0.9999 if recipe == 'bf16' else 0.99), (name, cos)


def test_config_json_variants():
  base = dict(model_type='llama', vocab_size=256, hidden_size=64,
              intermediate_size=176, num_hidden_layers=2,
              num_attention_heads=4)
  llama3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=8192)
  plain = hf.config_from_hf(base)  # transformers' defaults
  assert type(plain) is cm.LlamaConfig
  assert plain.num_kv_heads == 4 and plain.rope_theta == 10000.0
  assert plain.rope_scaling is None and not plain.tie_embeddings
  for rope in (dict(rope_scaling=None),
               dict(rope_scaling=dict(rope_type='default')),
               dict(rope_parameters=dict(rope_type='default',
                                         rope_theta=5e5))):
    assert hf.config_from_hf({**base, **rope}).rope_scaling is None
  v4 = hf.config_from_hf({**base, 'rope_theta': 5e5, 'rope_scaling': {
      'type': 'llama3', **llama3}})  # the older 'type' key
  v5 = hf.config_from_hf({**base, 'rope_parameters': {
      'rope_type': 'llama3', 'rope_theta': 5e5, **llama3}})
  assert v4 == v5 and v4.rope_theta == 5e5
  assert v4.rope_scaling == cm.RopeScaling(**llama3)
  with pytest.raises(ValueError, match="rope_type 'llama3' lacks 'factor'"):
    hf.config_from_hf({**base, 'rope_scaling': {'rope_type': 'llama3'}})
