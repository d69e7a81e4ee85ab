"""Configs: every file loads and validates; bad input gets clear errors."""

import dataclasses
import glob
import json
import os

import pytest

from coat_jax import recipes
from coat_jax import training
from coat_jax.models import llama
from coat_jax.training import config as config_lib
from coat_jax.training import data as data_lib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, 'configs', '*.py')))


def test_there_are_configs():
  names = {os.path.basename(c) for c in CONFIGS}
  assert {'tiny.py', 'llama_125m.py', 'llama_1b.py', 'llama2_7b.py',
          'llama2_13b.py'} <= names


@pytest.mark.parametrize('path', CONFIGS, ids=os.path.basename)
def test_every_config_loads_and_validates(path):
  config = training.load_config(path)
  training.validate(config, num_devices=1)
  if config.optim.apply_in_backward:  # a one-device config
    with pytest.raises(ValueError, match='runs on one device'):
      training.validate(config, num_devices=8)
  else:
    training.validate(config, num_devices=8)
  config_lib.architecture(config.model)
  assert isinstance(config_lib.recipe(config.model), recipes.Recipe)


def test_overrides_parse_by_type():
  config = training.apply_overrides(training.Config(), [
      'model.recipe=bf16', 'train.batch_size=32', 'optim.learning_rate=1e-4',
      'optim.expansion=false', 'optim.moment_dtypes=e4m3,e5m2',
      'model.hidden_size=128', 'data.tokenizer=none',
      'optim.apply_in_backward=true', 'optim.in_backward_clip=none'])
  assert config.model.recipe == recipes.BF16
  assert config.train.batch_size == 32
  assert config.optim.learning_rate == 1e-4 and not config.optim.expansion
  assert config.optim.moment_dtypes == ('e4m3', 'e5m2')
  assert config.model.hidden_size == 128 and config.data.tokenizer is None
  assert config.optim.apply_in_backward is True
  assert config.optim.in_backward_clip == 'none'
  training.validate(config, 1)  # an in-backward step can run this
  assert training.Config().train.batch_size == 16  # defaults untouched
  assert training.Config().model.recipe == recipes.COAT


def test_recipe_overrides_set_the_recipe_and_its_fields():
  config = training.apply_overrides(training.Config(), [
      'model.recipe=fp8_linear', 'model.recipe.scaling=block',
      'model.recipe.fuse_qkv=false', 'model.recipe.grad_dtype=e4m3'])
  assert config.model.recipe == dataclasses.replace(
      recipes.FP8_LINEAR, scaling='block', fuse_qkv=False, grad_dtype='e4m3')
  # A field after the preset name: the field of the named preset.
  config = training.apply_overrides(training.Config(), [
      'model.recipe.fp8_weight_gather=true'])
  assert config.model.recipe == dataclasses.replace(
      recipes.COAT, fp8_weight_gather=True)
  assert config_lib.recipe(config.model) is config.model.recipe
  config = training.apply_overrides(training.Config(), [
      'model.recipe=coat_block'])
  assert config_lib.recipe(config.model) == recipes.COAT_BLOCK


def test_older_recipe_overrides_still_work():
  """model.precision, model.scaling, model.fuse_qkv and
  model.fp8_weight_gather: the names of the recipe and its fields before
  recipes."""
  config = training.apply_overrides(training.Config(), [
      'model.precision=fp8_linear', 'model.scaling=block',
      'model.fuse_qkv=false', 'model.fp8_weight_gather=true'])
  assert config.model.recipe == dataclasses.replace(
      recipes.FP8_LINEAR, scaling='block', fuse_qkv=False,
      fp8_weight_gather=True)
  with pytest.raises(ValueError, match="model.precision='fp4'"):
    training.apply_overrides(training.Config(), ['model.precision=fp4'])


def test_old_run_config_json_loads():
  """A run's config.json written before recipes (model.precision and the
  recipe's fields beside it), and one written now, give their recipes."""
  old = config_lib.from_dict({'model': {
      'preset': 'tiny', 'precision': 'bf16', 'scaling': 'block',
      'fuse_qkv': False, 'fp8_weight_gather': False, 'remat': 'full'}})
  assert old.model.recipe == dataclasses.replace(
      recipes.BF16, scaling='block', fuse_qkv=False)
  assert old.model.remat == 'full' and old.model.preset == 'tiny'
  assert config_lib.from_dict({'model': {'preset': 'tiny'}}).model.recipe == (
      recipes.COAT)
  config = training.apply_overrides(training.Config(), [
      'model.recipe=coat_block', 'model.recipe.grad_dtype=e4m3',
      'model.num_layers=3'])
  again = config_lib.from_dict(json.loads(json.dumps(
      config_lib.to_dict(config))))
  assert again == config
  by_name = config_lib.from_dict({'model': {'recipe': 'fp8_linear'}})
  assert by_name.model.recipe == recipes.FP8_LINEAR
  with pytest.raises(ValueError, match="model.recipe='fp4' is not a recipe"):
    config_lib.from_dict({'model': {'precision': 'fp4'}})


def test_architecture_of_a_model_config():
  """config.architecture: the preset of any family with the model
  section's overrides; None fields keep the preset's values."""
  model = training.apply_overrides(training.Config(), [
      'model.preset=1b', 'model.num_layers=3', 'model.scan_layers=true']).model
  arch = config_lib.architecture(model)
  assert arch == llama.LlamaConfig.preset('1b', num_layers=3,
                                          scan_layers=True)
  assert config_lib.architecture(training.Config().model) == (
      llama.LlamaConfig.preset('tiny'))


@pytest.mark.parametrize('override,message', [
    ('train.nope=1', "unknown field 'nope'"),
    ('nope.steps=1', "unknown section 'nope'"),
    ('train.steps=ten', "expected a value of type int"),
    ('optim.expansion=maybe', 'expected true or false'),
    ('train.steps', 'must look like section.field=value'),
    ('model.recipe=fp4', "model.recipe='fp4' is not a recipe"),
    ('model.precision=fp4', "model.precision='fp4' is not a recipe"),
    ('model.recipe.scaling=row',
     "model.recipe.scaling='row'.*'tensor', 'block'"),
    ('model.scaling=row', "model.scaling='row'.*'tensor', 'block'"),
    ('model.recipe.fuse_qkv=maybe', 'expected true or false'),
    ('model.recipe.nope=1', "Recipe has no field 'nope'"),
])
def test_bad_overrides(override, message):
  with pytest.raises(ValueError, match=message):
    training.apply_overrides(training.Config(), [override])


@pytest.mark.parametrize('override,devices,message', [
    ('mesh.fsdp=3', 8, 'do(es)? not divide|devices'),
    ('mesh.data=2', 8, 'mesh data=2 x fsdp=1 x tensor=1 = 2 devices'),
    ('train.batch_size=12', 8, 'divisible by mesh.data x mesh.fsdp = 8'),
    ('train.microbatches=3', 1, 'multiple of train.microbatches'),
    ('data.source=text', 1, 'needs data.paths'),
    ('train.steps=0', 1, 'train.steps must be positive'),
    ('train.compilation_cache_max_gib=-1', 1,
     r'train.compilation_cache_max_gib must be >= 0 \(0: no bound\)'),
    ('optim.fused=true optim.name=adamw', 1, 'optim.fused=true needs'),
    ('optim.in_backward_clip=global', 1,
     r"optim.in_backward_clip='global' must be one of \('previous', 'none'\)"),
    # What an in-backward step cannot run with, and the setting to change.
    ('optim.apply_in_backward=true model.scan_layers=true', 1,
     r'optim.apply_in_backward=true needs unrolled layers'
     r' \(model.scan_layers=false\)'),
    ('optim.apply_in_backward=true train.microbatches=2', 1,
     r'cannot accumulate microbatches \(train.microbatches=2: set 1\)'),
    ('optim.apply_in_backward=true optim.name=adamw', 1,
     r'needs the fused optimizer \(optim.name=coat_adamw with FP8 moments'),
    ('optim.apply_in_backward=true optim.fused=false', 1,
     r'needs the fused optimizer .*optim.fused unset or true'),
    ('optim.apply_in_backward=true', 8,
     r'runs on one device \(8 given: make one visible, e.g.'
     r' CUDA_VISIBLE_DEVICES=0\)'),
])
def test_bad_configs(override, devices, message):
  config = training.apply_overrides(training.Config(), override.split())
  with pytest.raises(ValueError, match=message):
    training.validate(config, devices)


def test_wrong_type_set_in_a_config_file(tmp_path):
  path = tmp_path / 'bad.py'
  path.write_text('from coat_jax.training import Config\n'
                  'def get_config():\n  c = Config()\n'
                  '  c.train.steps = "10"\n  return c\n')
  with pytest.raises(ValueError, match="train.steps='10' has type str"):
    training.validate(training.load_config(path), 1)
  path.write_text('from coat_jax.training import Config\n'
                  'def get_config():\n  c = Config()\n'
                  '  c.model.recipe = "fp4"\n  return c\n')
  with pytest.raises(ValueError, match="model.recipe='fp4' is not a recipe"):
    training.validate(training.load_config(path), 1)
  with pytest.raises(FileNotFoundError, match='no such file'):
    training.load_config(tmp_path / 'missing.py')


def test_data_errors(tmp_path):
  empty = tmp_path / 'empty.txt'
  empty.write_text('')
  short = tmp_path / 'short.txt'
  short.write_text('x' * 40)
  cfg = lambda **kw: config_lib.DataConfig(**{'seq_len': 32, **kw})
  with pytest.raises(FileNotFoundError, match='no file matches'):
    data_lib.load_dataset(cfg(source='text', paths=('/nope/*.txt',)), 256)
  with pytest.raises(ValueError, match='is empty'):
    data_lib.load_dataset(cfg(source='text', paths=(str(empty),)), 256)
  with pytest.raises(ValueError, match='too few for one window'):
    data_lib.load_dataset(cfg(source='text', paths=(str(short),)), 256)
  short.write_text('x' * 400)
  with pytest.raises(ValueError, match='vocab_size=100'):
    data_lib.load_dataset(cfg(source='text', paths=(str(short),),
                              seq_len=8), 100)


def test_token_files(tmp_path):
  import numpy as np  # noqa: PLC0415
  ids = np.arange(5000, dtype=np.uint16) % 1000
  np.save(tmp_path / 'a.npy', ids)
  ids.tofile(tmp_path / 'b.bin')
  for name in ('a.npy', 'b.bin'):
    ds = data_lib.load_dataset(config_lib.DataConfig(
        source='tokens', paths=(str(tmp_path / name),), seq_len=16), 1000)
    x, y = ds.batch('train', 0, 3, 4, 16)
    assert x.shape == (4, 16) and (x[:, 1:] == y[:, :-1]).all()
    x2, _ = ds.batch('train', 0, 3, 4, 16)
    assert (x == x2).all()  # deterministic: the position is the step
  with pytest.raises(ValueError, match='token id 999.*vocab_size=500'):
    data_lib.load_dataset(config_lib.DataConfig(
        source='tokens', paths=(str(tmp_path / 'a.npy'),), seq_len=16), 500)
  (tmp_path / 'odd.bin').write_bytes(b'\x00' * 3001)
  with pytest.raises(ValueError, match='not a multiple'):
    data_lib.load_dataset(config_lib.DataConfig(
        source='tokens', paths=(str(tmp_path / 'odd.bin'),)), 500)


def test_stdlib_split_is_deterministic_and_by_file():
  files = data_lib.stdlib_files()
  assert len(files) > 100
  import sysconfig  # noqa: PLC0415
  root = sysconfig.get_paths()['stdlib']
  a = data_lib._split_files(files, 0.05, root)
  b = data_lib._split_files(files, 0.05, root)
  assert a == b and a[1] and not set(a[0]) & set(a[1])


@pytest.mark.parametrize('overrides,fused', [
    ([], True),  # coat_adamw with FP8 moments: fused by default
    (['optim.fused=false'], False),
    (['optim.name=adamw'], False),
    (['optim.moment_dtypes=e4m3,float32'], False),
    (['optim.fused=none', 'optim.name=adamw'], False),
])
def test_fused_optimizer_default(overrides, fused):
  config = training.apply_overrides(training.Config(), overrides)
  training.validate(config, 1)
  assert training.config.uses_fused_optimizer(config.optim) is fused
