"""train.py trains a VLM on the shapes data: configs, the step, evaluation,
resume, sharding, and the errors of a model and data of different tasks."""

import json
import os
import threading
import time

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coat_jax import training
from coat_jax.models import hf
from coat_jax.training import config as config_lib
from coat_jax.training import data as data_lib
from coat_jax.training import planning
from coat_jax.training import sharding
from coat_jax.training import tasks
from coat_jax.training import trainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def _vlm_config(tmp_path, **train) -> training.Config:
  config = training.load_config(os.path.join(ROOT, 'configs', 'vlm_tiny.py'))
  config.optim.warmup_steps = 2
  fields = dict(steps=6, batch_size=8, log_every=1, eval_every=3,
                eval_batches=1, run_dir=str(tmp_path / 'run'),
                progress_bar=False, compilation_cache_dir='')
  fields.update(train)
  for k, v in fields.items():
    setattr(config.train, k, v)
  return config


def _records(run_dir):
  with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def test_the_vlm_config_trains_evaluates_answers_and_resumes(tmp_path):
  """Six steps evaluated at 3 and 6; a rerun; a run stopped at 3 and
  resumed logs the same losses."""
  config = _vlm_config(tmp_path)
  summary = training.train(config, devices=jax.devices()[:1])
  records = _records(config.train.run_dir)
  losses = [r['loss'] for r in records if 'loss' in r]
  assert len(losses) == 6 and all(np.isfinite(losses))
  assert losses[-1] < losses[0]
  evaluations = [r for r in records if 'val_loss' in r]
  assert [r['step'] for r in evaluations] == [3, 6]
  assert all(0 <= r['val_accuracy'] <= 1 for r in evaluations)
  assert summary['val_accuracy'] == evaluations[-1]['val_accuracy']
  # A held-out question, the model's answer and the right one.
  assert ' (right: ' in summary['sample'] and '?' in summary['sample']
  # Tokens/s counts the image tokens and the text.
  task = tasks.of_config(config)
  text = tasks.shapes_dataset(config_lib.vlm_architecture(config.model))
  assert task.tokens_per_example == (32 // 8) ** 2 + text.seq_len
  # A rerun of the finished run trains nothing and reports what it logged.
  again = training.train(config, devices=jax.devices()[:1])
  assert again['complete'] and again['step'] == 6
  assert again['val_accuracy'] == summary['val_accuracy']
  # Stopped at step 3 and resumed, a run logs the same losses.
  half = _vlm_config(tmp_path / 'half', steps=3, sample_tokens=0)
  training.train(half, devices=jax.devices()[:1])
  half.train.steps = 6
  assert training.train(half, devices=jax.devices()[:1])['resumed_from'] == 3
  np.testing.assert_array_equal(
      [r['loss'] for r in _records(half.train.run_dir) if 'loss' in r],
      losses)


def test_per_layer_gradients_equal_the_stacked_ones(tmp_path):
  """The fused optimizer's per-layer path (the decoder's layers inside the
  VLM) gives the gradients of the plain path."""
  config = _vlm_config(tmp_path)
  setup = trainer.build(config, devices=jax.devices()[:1])
  params = setup.init_state()['params']
  batch = tasks.load_data(config, setup.task).batch('train', 0, 4)
  plain = trainer._loss_and_grads(setup.task, setup.graphdef,
                                  per_layer=False)
  per_layer = trainer._loss_and_grads(setup.task, setup.graphdef,
                                      per_layer=True)
  loss, grads = jax.jit(plain)(params, *batch)
  loss_pl, grads_pl = jax.jit(per_layer)(params, *batch)
  np.testing.assert_allclose(loss_pl, loss, rtol=1e-6)
  layers = grads_pl['decoder']['layers']
  stacked = jax.tree.map(lambda *g: jnp.stack(g), *[
      jax.tree.map(lambda leaf, i=i: leaf[i], layers,
                   is_leaf=lambda x: isinstance(x, tuple))
      for i in range(setup.architecture.num_layers)])
  grads_pl = {**grads_pl, 'decoder': {**grads_pl['decoder'],
                                      'layers': stacked}}
  jax.tree.map(lambda a, b: np.testing.assert_allclose(
      a, b, rtol=1e-5, atol=1e-7), grads_pl, grads)
  assert float(optax_norm(grads['vision'])) > 0


def optax_norm(tree):
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32)))
                      for x in jax.tree.leaves(tree)))


def test_the_vlm_trains_the_same_on_a_mesh_as_on_one_device(tmp_path):
  """Two steps of the VLM on a (2, 2, 2) mesh: the losses and gradient
  norms of one device's."""
  def two_steps(mesh, devices):
    config = _vlm_config(tmp_path)
    config.mesh = mesh
    setup = trainer.build(config, devices)
    data = tasks.load_data(config, setup.task)
    batch_sharding = sharding.batch_sharding(setup.mesh)
    out = []
    with jax.set_mesh(setup.mesh):
      state = setup.init_state()
      for step in range(2):
        batch = [trainer.device_batch(x, batch_sharding)
                 for x in data.batch('train', step, 8)]
        state, metrics = setup.train_step(state, *batch)
        out.append((float(metrics['loss']), float(metrics['grad_norm'])))
    return np.array(out)

  one = two_steps(training.MeshConfig(), jax.devices()[:1])
  mesh = two_steps(training.MeshConfig(data=2, fsdp=2, tensor=2),
                   jax.devices()[:8])
  np.testing.assert_allclose(mesh, one, rtol=2e-2)


def test_the_vlm_step_estimates_its_memory(tmp_path):
  config = _vlm_config(tmp_path)
  mem = planning.estimate(config, devices=jax.devices()[:1])
  assert mem.params > 0 and mem.activations > 0 and mem.total > mem.params


@pytest.mark.parametrize('overrides, message', [
    (['model.preset=vlm_tiny'], 'set data.source=shapes'),
    (['data.source=shapes'], "set model.preset to one of ['vlm_1b',"
                             " 'vlm_tiny']"),
    (['model.preset=vlm_tiny', 'data.source=shapes', 'model.init_from=x'],
     'data.source=shapes trains a vision-language model, not'
     ' model.init_from'),
])
def test_a_model_and_data_of_different_tasks_are_refused(overrides,
                                                         message):
  config = training.apply_overrides(training.Config(), overrides)
  with pytest.raises(ValueError, match=message.replace('[', r'\[')):
    config_lib.validate(config, 1)


def test_text_longer_than_the_decoder_is_refused_before_compiling(tmp_path):
  config = training.apply_overrides(
      _vlm_config(tmp_path), ['model.max_seq_len=64'])
  setup = trainer.build(config, devices=jax.devices()[:1])
  with pytest.raises(ValueError, match='raise model.max_seq_len'):
    tasks.load_data(config, setup.task)


def test_the_decoder_fields_of_a_vlm_preset_are_overridable():
  config = training.apply_overrides(training.Config(), [
      'model.preset=vlm_tiny', 'data.source=shapes', 'model.num_layers=3'])
  vlm_config = config_lib.vlm_architecture(config.model)
  assert vlm_config.decoder.num_layers == 3
  assert config_lib.architecture(config.model) == vlm_config.decoder
  assert config_lib.vlm_architecture(training.Config().model) is None


def test_generate_and_export_refuse_a_vlm_run(tmp_path, capsys):
  from coat_jax import export  # noqa: PLC0415
  from coat_jax import generate  # noqa: PLC0415
  config = _vlm_config(tmp_path)
  run = config.train.run_dir
  os.makedirs(run)
  with open(os.path.join(run, 'config.json'), 'w') as f:
    json.dump(config_lib.to_dict(config), f)
  with pytest.raises(ValueError, match='trained a vision-language model'):
    export.export(run, str(tmp_path / 'out'))
  assert generate.main([run, '--prompt', 'x']) == 2
  assert 'vlm.greedy_decode' in capsys.readouterr().err


def test_prefetch_makes_every_index_in_order_ahead_of_the_caller():
  started = []
  gate = threading.Event()

  def make(i):
    started.append(i)
    if i == 3:
      gate.wait(5)
    return i * i

  batches = data_lib.Prefetch(make, 2, 7, depth=2)
  time.sleep(0.2)
  assert started == [2, 3]  # made ahead, at most depth
  gate.set()
  assert list(batches) == [4, 9, 16, 25, 36]
  batches.close()


def test_prefetch_raises_a_failure_where_its_index_is_taken():
  def make(i):
    if i == 1:
      raise ValueError('bad batch 1')
    return i

  batches = data_lib.Prefetch(make, 0, 3)
  assert next(batches) == 0
  with pytest.raises(ValueError, match='bad batch 1'):
    next(batches)
  batches.close()
  with pytest.raises(ValueError, match='depth'):
    data_lib.Prefetch(make, 0, 3, depth=0)


def test_the_vlm_model_of_the_task_is_a_converted_vlm(tmp_path):
  config = _vlm_config(tmp_path)
  task = tasks.of_config(config)
  model = task.make_model(config_lib.recipe(config.model), nnx.Rngs(0))
  assert model.conversion.converted  # the vision tower's layers
  assert task.layers_path == ('decoder', 'layers')


def _siglip_checkpoint(path, **overrides):
  """A random SigLIP vision tower shaped as 'vlm_tiny''s ViT, saved by
  transformers."""
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  torch.manual_seed(7301)
  config = transformers.SiglipVisionConfig(**{
      **dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, image_size=32, patch_size=8),
      **overrides})
  transformers.SiglipVisionModel(config).save_pretrained(str(path))
  return str(path)


def test_a_vlm_run_starts_its_vision_tower_from_a_siglip_checkpoint(
    tmp_path):
  siglip = _siglip_checkpoint(tmp_path / 'siglip')
  config = training.apply_overrides(
      _vlm_config(tmp_path), [f'model.vision_init_from={siglip}'])
  setup = trainer.build(config, devices=jax.devices()[:2])
  params = setup.init_state()['params']
  want = nnx.to_pure_dict(nnx.state(hf.load_siglip(siglip), nnx.Param))
  jax.tree.map(np.testing.assert_array_equal, params['vision'], want)
  random = trainer.build(_vlm_config(tmp_path), jax.devices()[:2])
  # The rest starts as a run without the checkpoint does.
  jax.tree.map(np.testing.assert_array_equal, params['decoder'],
               random.init_state()['params']['decoder'])


def test_a_siglip_checkpoint_of_another_shape_or_a_language_model_is_refused(
    tmp_path):
  wide = _siglip_checkpoint(tmp_path / 'wide', hidden_size=32,
                            num_attention_heads=2)
  config = training.apply_overrides(
      _vlm_config(tmp_path), [f'model.vision_init_from={wide}'])
  with pytest.raises(ValueError, match='hidden_size: 32 there, 64 here'):
    trainer.build(config, devices=jax.devices()[:1])
  config = training.apply_overrides(
      training.Config(), [f'model.vision_init_from={wide}'])
  with pytest.raises(ValueError, match='has none: set model.preset'):
    config_lib.validate(config, 1)
