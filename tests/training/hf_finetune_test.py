"""train.py from a Hugging Face checkpoint: model.init_from, resume, export."""

import importlib.util
import json
import os
import shutil

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coat_jax import export
from coat_jax import recipes
from coat_jax import training
import coat_jax.models as cm
from coat_jax.training import config as config_lib
from coat_jax.training import tasks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


@pytest.fixture(scope='module')
def hf_dir(tmp_path_factory, seed) -> str:
  """A tiny Llama 3 style checkpoint (GQA, tied, rope_scaling), bf16."""
  config = cm.LlamaConfig.preset(
      'tiny', tie_embeddings=True, rope_theta=500000.0,
      rope_scaling=cm.RopeScaling(original_max_position_embeddings=16))
  model = cm.Llama(config, recipe='bf16', rngs=nnx.Rngs(seed))
  path = str(tmp_path_factory.mktemp('hf'))
  cm.save_hf(model, path, dtype='bfloat16', max_shard_size=40_000)
  return path


def _params(tree):
  return jax.tree.map(np.asarray, tree)


def _losses(run_dir):
  with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
    return [r['loss'] for r in map(json.loads, f) if 'loss' in r]


def test_starts_from_the_checkpoint_on_the_fsdp_mesh(tiny_config, hf_dir):
  config = tiny_config(model={'init_from': hf_dir},
                       mesh={'data': 1, 'fsdp': 8, 'tensor': 1},
                       optim={'group_size': 8})
  setup = training.build(config, jax.devices())
  with jax.set_mesh(setup.mesh):
    state = setup.init_state()
  want = _params(nnx.to_pure_dict(nnx.state(
      cm.load_hf(hf_dir, 'coat'), nnx.Param)))
  jax.tree.map(np.testing.assert_array_equal, _params(state['params']), want)
  jax.tree.map(lambda x, s: x.sharding.is_equivalent_to(s, x.ndim)
               or pytest.fail(f'{x.sharding} != {s}'),
               state['params'], setup.state_shardings['params'])
  assert state['params']['embed'].sharding.spec[1] == 'fsdp'
  cfg = config_lib.architecture(config.model)
  assert cfg == setup.architecture and type(cfg) is cm.LlamaConfig
  assert cfg.tie_embeddings and cfg.rope_scaling is not None
  assert cfg.rope_theta == 500000.0 and cfg.num_kv_heads == 2


def test_finetune_lowers_the_loss_resumes_and_exports(tiny_config, hf_dir,
                                                      tmp_path):
  run = str(tmp_path / 'run')
  config = tiny_config(model={'init_from': hf_dir, 'recipe': 'coat'},
                       train={'steps': 4, 'checkpoint_every': 2,
                              'run_dir': run})
  summary = training.train(config, devices=jax.devices()[:1])
  losses = _losses(run)
  assert summary['resumed_from'] is None and summary['step'] == 4
  assert np.isfinite(losses).all() and losses[-1] < losses[0]
  # The random init would start near ln(256) = 5.5 too; a loaded model's
  # first loss is its own, so compare with the checkpoint's loss directly.
  model = cm.load_hf(hf_dir, 'coat')
  x, y = _first_batch(config)
  np.testing.assert_allclose(  # jitted as train.py's: the same fusions
      losses[0],
      float(nnx.jit(cm.lm_loss)(model, jnp.asarray(x), jnp.asarray(y))),
      rtol=1e-5)

  # Resume from step 2 (drop step 4): the same steps 3 and 4 follow.
  shutil.rmtree(os.path.join(run, 'checkpoints', '4'))
  os.remove(os.path.join(run, 'metrics.jsonl'))
  summary = training.train(config, devices=jax.devices()[:1])
  assert summary['resumed_from'] == 2 and summary['step'] == 4
  assert _losses(run) == losses[2:]

  shutil.copyfile(os.path.join(ROOT, 'pyproject.toml'),
                  os.path.join(hf_dir, 'tokenizer.json'))  # any file
  out = str(tmp_path / 'export')
  try:
    assert export.main([run, out, '--dtype', 'float32']) == 0
  finally:
    os.remove(os.path.join(hf_dir, 'tokenizer.json'))
  assert os.path.isfile(os.path.join(out, 'tokenizer.json'))
  exported = cm.load_hf(out, 'coat')
  assert exported.config == config_lib.architecture(config.model)
  setup = training.build(config, jax.devices()[:1])
  checkpointer = training.trainer.Checkpointer(run, config)
  template = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      setup.abstract_state, setup.state_shardings)
  with jax.set_mesh(setup.mesh):
    final = checkpointer.restore(4, template)
  checkpointer.close()
  jax.tree.map(np.testing.assert_array_equal,
               _params(nnx.to_pure_dict(nnx.state(exported, nnx.Param))),
               _params(final['params']))


def _first_batch(config):
  from coat_jax.training import data as data_lib  # noqa: PLC0415
  dataset = data_lib.load_dataset(tasks.data_config(config), 256)
  t = config.train
  return dataset.batch('train', t.seed, 0, t.batch_size, config.data.seq_len)


def test_conflicting_dimension_is_an_error(tiny_config, hf_dir, tmp_path):
  config = tiny_config(model={'init_from': hf_dir, 'hidden_size': 128})
  with pytest.raises(ValueError, match=r'model.hidden_size=128 conflicts'
                     r' with the checkpoint \(config.json hidden_size=64\)'):
    training.build(config, jax.devices()[:1])
  same = tiny_config(model={'init_from': hf_dir, 'vocab_size': 256,
                            'max_seq_len': 64})
  assert config_lib.architecture(same.model).max_seq_len == 64
  missing = tiny_config(model={'init_from': str(tmp_path / 'nope')})
  with pytest.raises(FileNotFoundError, match='config.json: no such file'):
    training.build(missing, jax.devices()[:1])


def test_text_data_uses_the_checkpoint_tokenizer(tiny_config, tmp_path):
  hf = tmp_path / 'hf'
  hf.mkdir()
  config = tiny_config(model={'init_from': str(hf)})
  assert tasks.data_config(config).tokenizer is None  # no tokenizer.json
  (hf / 'tokenizer.json').write_text('{}')
  assert tasks.data_config(config).tokenizer == str(hf / 'tokenizer.json')
  config.data.tokenizer = 'mine.json'
  assert tasks.data_config(config).tokenizer == 'mine.json'
  config.data.tokenizer = None
  config.data.source = 'stdlib'
  assert tasks.data_config(config).tokenizer is None


def test_finetune_config_and_command_line(hf_dir, corpus, tmp_path, capsys):
  sets = [f'model.init_from={hf_dir}', 'data.source=text',
          f'data.paths={corpus}',
          'data.seq_len=32', f'train.run_dir={tmp_path}']
  config = training.apply_overrides(training.load_config(
      os.path.join(ROOT, 'configs', 'finetune_hf.py')), sets)
  training.validate(config, 8)
  assert config_lib.recipe(config.model) == recipes.COAT
  assert config.data.source == 'text'
  assert config.optim.learning_rate < training.OptimConfig().learning_rate
  assert config_lib.architecture(config.model).num_kv_heads == 2
  spec = importlib.util.spec_from_file_location(
      'train_main', os.path.join(ROOT, 'train.py'))
  train_main = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(train_main)
  argv = ['--config', os.path.join(ROOT, 'configs', 'finetune_hf.py'),
          '--set', *sets, 'model.num_layers=3']
  assert train_main.main(argv) == 2
  assert 'model.num_layers=3 conflicts' in capsys.readouterr().err
