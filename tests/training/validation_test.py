"""Bad input is refused before anything compiles, naming the setting or the
file and the fix: config ranges, the run directory, token files, the data
path, the vocabulary, damaged safetensors."""

import dataclasses
import math
import os
import typing

from flax import nnx
import jax
import numpy as np
import pytest

from coat_jax import training
import coat_jax.models as cm
from coat_jax.models import hf
from coat_jax.training import config as config_lib
from coat_jax.training import data as data_lib
from coat_jax.training import tokenizer as tokenizer_lib
from coat_jax.training import trainer


@pytest.mark.parametrize('override,message', [
    ('optim.learning_rate=-1e-3',
     r'optim.learning_rate must be positive \(the peak of the schedule\),'
     r' got -0.001'),
    ('optim.learning_rate=0', 'optim.learning_rate must be positive'),
    ('optim.learning_rate=nan',
     'optim.learning_rate must be a finite number, got nan'),
    ('optim.learning_rate=inf',
     'optim.learning_rate must be a finite number, got inf'),
    ('optim.b1=1', r"optim.b1 must be in \[0, 1\) \(the first moment's"
     r' decay\), got 1.0'),
    ('optim.b1=-0.1', r'optim.b1 must be in \[0, 1\)'),
    ('optim.b2=1.5', r"optim.b2 must be in \[0, 1\) \(the second moment's"
     r' decay\), got 1.5'),
    ('optim.b2=-inf', 'optim.b2 must be a finite number, got -inf'),
    ('optim.eps=0', 'optim.eps must be positive, got 0.0'),
    ('optim.eps=-1e-8', 'optim.eps must be positive'),
    ('optim.weight_decay=-0.1', r'optim.weight_decay must be >= 0 \(0:'
     r' none\), got -0.1'),
    ('optim.clip_norm=-1', r'optim.clip_norm must be positive \(the largest'
     r' global gradient norm\), got -1.0'),
    ('optim.clip_norm=0', 'optim.clip_norm must be positive'),
    ('optim.warmup_steps=-5', 'optim.warmup_steps must be >= 0, got -5'),
    ('optim.end_learning_rate_ratio=1.5',
     r'optim.end_learning_rate_ratio must be in \[0, 1\] \(the final'
     r' learning rate over the peak\), got 1.5'),
    ('optim.end_learning_rate_ratio=-0.1',
     r'optim.end_learning_rate_ratio must be in \[0, 1\]'),
    ('optim.group_size=0', 'optim.group_size must be positive, got 0'),
    ('optim.moment_dtypes=e4m3',
     r"optim.moment_dtypes='e4m3' must be two formats"),
    ('optim.moment_dtypes=e4m3,fp4',
     r"optim.moment_dtypes='e4m3,fp4' must be two formats .*'e5m2'"),
    ('data.val_fraction=0', r'data.val_fraction must be in \(0, 1\), got 0.0'),
    ('data.val_fraction=1', r'data.val_fraction must be in \(0, 1\), got 1.0'),
    ('data.val_fraction=nan', 'data.val_fraction must be a finite number'),
    ('data.seq_len=0', 'data.seq_len must be positive, got 0'),
    ('train.steps=0', 'train.steps must be positive, got 0'),
    ('train.batch_size=-8', 'train.batch_size must be positive, got -8'),
    ('train.microbatches=0', 'train.microbatches must be positive'),
    ('train.seed=-1', 'train.seed must be >= 0, got -1'),
    ('train.log_every=0', 'train.log_every must be positive'),
    ('train.eval_every=0', 'train.eval_every must be positive'),
    ('train.eval_batches=0', 'train.eval_batches must be positive'),
    ('train.checkpoint_every=-1', r'train.checkpoint_every must be >= 0 \(0:'),
    ('train.keep_checkpoints=0', 'train.keep_checkpoints must be positive'),
    ('train.sample_tokens=-1', r'train.sample_tokens must be >= 0 \(0: no'
     r' sample\), got -1'),
    ('train.compilation_cache_max_gib=-1',
     r'train.compilation_cache_max_gib must be >= 0 \(0: no bound\)'),
    ('train.compilation_cache_max_gib=inf',
     'train.compilation_cache_max_gib must be a finite number, got inf'),
    ('train.run_dir=', 'train.run_dir is empty'),
    ('model.vocab_size=-1', 'model.vocab_size must be positive, got -1'),
    ('model.hidden_size=0', 'model.hidden_size must be positive'),
    ('model.intermediate_size=0', 'model.intermediate_size must be positive'),
    ('model.num_layers=0', 'model.num_layers must be positive, got 0'),
    ('model.num_heads=0', 'model.num_heads must be positive'),
    ('model.num_kv_heads=0', 'model.num_kv_heads must be positive'),
    ('model.max_seq_len=0', 'model.max_seq_len must be positive'),
    ('model.head_dim=0', 'model.head_dim must be positive'),
    ('model.sliding_window=0', 'model.sliding_window must be positive'),
    ('model.sliding_window_pattern=-6',
     'model.sliding_window_pattern must be positive'),
    ('model.rope_theta=0', 'model.rope_theta must be positive, got 0.0'),
    ('model.rope_local_theta=-1', 'model.rope_local_theta must be positive'),
    ('model.rms_norm_eps=-1e-6', 'model.rms_norm_eps must be positive'),
    ('model.init_std=nan', 'model.init_std must be a finite number, got nan'),
    ('model.query_scale=0', 'model.query_scale must be positive'),
    ('model.norm_scale_offset=inf',
     'model.norm_scale_offset must be a finite number, got inf'),
])
def test_every_out_of_range_setting_is_named(override, message):
  config = training.apply_overrides(training.Config(), [override])
  with pytest.raises(ValueError, match=message):
    training.validate(config, 1)


def test_every_numeric_field_has_a_range():
  """RANGES covers every int and float field (the mesh's sizes are checked
  by `mesh_shape`; a norm's scale offset may be any finite number)."""
  unchecked = set()
  for section in dataclasses.fields(config_lib.Config):
    cls = section.default_factory
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
      kinds = set(typing.get_args(hints[f.name])) or {hints[f.name]}
      if kinds & {int, float}:
        unchecked.add(f'{section.name}.{f.name}')
  assert set(config_lib.RANGES) <= unchecked
  assert unchecked - set(config_lib.RANGES) == {
      'mesh.data', 'mesh.fsdp', 'mesh.tensor', 'model.norm_scale_offset'}


def test_values_at_the_edges_of_the_ranges_are_accepted():
  config = training.apply_overrides(training.Config(), [
      'optim.b1=0', 'optim.b2=0.999', 'optim.warmup_steps=0',
      'optim.weight_decay=0', 'optim.end_learning_rate_ratio=1',
      'train.seed=0', 'train.checkpoint_every=0', 'train.sample_tokens=0',
      'train.compilation_cache_max_gib=0', 'model.norm_scale_offset=-1'])
  training.validate(config, 1)
  config.optim.end_learning_rate_ratio = 0.0
  training.validate(config, 1)


def test_config_file_values_are_range_checked(tmp_path):
  """A config file sets fields without the parser: the same checks hold."""
  path = tmp_path / 'bad.py'
  path.write_text('from coat_jax.training import Config\n'
                  'def get_config():\n  c = Config()\n'
                  '  c.optim.learning_rate = float("inf")\n  return c\n')
  with pytest.raises(ValueError, match='optim.learning_rate must be a'
                     ' finite number, got inf'):
    training.validate(training.load_config(path), 1)


def test_a_run_dir_that_is_a_file_is_named(tmp_path):
  file = tmp_path / 'notes.txt'
  file.write_text('not a directory')
  config = training.apply_overrides(training.Config(),
                                    [f'train.run_dir={file}'])
  with pytest.raises(ValueError, match=f'train.run_dir={file} is a file;'
                     ' it must be a directory .*choose another'):
    training.validate(config, 1)
  config.train.run_dir = str(file / 'run')
  with pytest.raises(ValueError, match=f'train.run_dir={file}/run cannot be'
                     f' made: {file} is a file'):
    training.validate(config, 1)
  config.train.run_dir = str(tmp_path / 'new' / 'run')  # made by the run
  training.validate(config, 1)


def test_an_infinite_learning_rate_fails_before_training(tiny_config,
                                                         monkeypatch):
  """train() checks the config before it compiles anything."""
  monkeypatch.setattr(trainer.memory, 'compile_train_step', None)
  config = tiny_config(optim={'learning_rate': math.inf})
  with pytest.raises(ValueError, match='optim.learning_rate must be a'
                     ' finite number, got inf'):
    training.train(config)
  assert not os.path.exists(config.train.run_dir)


def _tokens(tmp_path, name, ids, dtype=None):
  ids = np.asarray(ids, dtype)
  path = tmp_path / name
  if name.endswith('.npy'):
    np.save(path, ids)
  else:
    ids.tofile(path)
  return data_lib.DataConfig(source='tokens', paths=(str(path),),
                             seq_len=16, token_dtype='uint16'), str(path)


def test_negative_token_ids_are_refused_naming_the_file(tmp_path):
  ids = np.arange(4000, dtype=np.int32) % 500
  ids[1234] = -3
  config, path = _tokens(tmp_path, 'neg.npy', ids)
  with pytest.raises(ValueError, match=f'{path} holds token id -3: token ids'
                     ' cannot be negative'):
    data_lib.load_dataset(config, 500)


def test_too_large_token_ids_are_refused_naming_the_file(tmp_path):
  ids = np.arange(4000, dtype=np.uint16) % 500
  ids[3999] = 700  # in the validation tail: every file is checked whole
  for name in ('big.npy', 'big.bin'):
    config, path = _tokens(tmp_path, name, ids)
    with pytest.raises(ValueError, match=f'{path} holds token id 700, but'
                       ' the model has vocab_size=500'):
      data_lib.load_dataset(config, 500)


@pytest.mark.parametrize('vocab', [1000, 70_000, 151_936])
def test_uint32_tokens_read_as_uint16_are_detected(tmp_path, vocab):
  """A little-endian uint32 file read as uint16: every second uint16 is
  the high half, 0 for ids below 65536 (at most 2 for a 151936-id
  vocabulary)."""
  rng = np.random.default_rng(69)
  ids = rng.integers(0, vocab, 6000).astype(np.uint32)
  config, path = _tokens(tmp_path, 'ids.bin', ids)
  with pytest.raises(ValueError, match=f'{path} looks like uint32 token ids'
                     ' read as data.token_dtype=uint16.*Set'
                     ' data.token_dtype=uint32'):
    data_lib.load_dataset(config, vocab)
  config.token_dtype = 'uint32'
  dataset = data_lib.load_dataset(config, vocab)
  np.testing.assert_array_equal(
      np.concatenate([dataset.train, dataset.val]), ids)


def test_uint16_tokens_pass_the_uint32_check(tmp_path):
  """Real uint16 ids, even many small ones, are not mistaken for uint32."""
  rng = np.random.default_rng(70)
  ids = rng.integers(0, 3, 6000).astype(np.uint16)
  config, _ = _tokens(tmp_path, 'small.bin', ids)
  dataset = data_lib.load_dataset(config, 3)
  np.testing.assert_array_equal(
      np.concatenate([dataset.train, dataset.val]), ids)


def test_a_size_that_does_not_fit_the_dtype_is_named(tmp_path):
  config, path = _tokens(tmp_path, 'odd.bin', np.arange(3001) % 200,
                         np.uint16)
  config.token_dtype = 'uint32'
  with pytest.raises(ValueError, match=f'{path}: its size \\(6002 bytes\\)'
                     ' is not a multiple of data.token_dtype=uint32 \\(4'
                     ' bytes\\)'):
    data_lib.load_dataset(config, 500)


def test_a_directory_in_data_paths_asks_for_a_glob(tmp_path, corpus):
  folder = tmp_path / 'texts'
  folder.mkdir()
  (folder / 'a.txt').write_text(open(corpus).read())
  config = data_lib.DataConfig(source='text', paths=(str(folder),),
                               seq_len=16)
  with pytest.raises(ValueError, match=f"'{folder}' names only directories"
                     f".*e.g. '{folder}/\\*\\*/\\*.txt'"):
    data_lib.load_dataset(config, 256)
  config.paths = (f'{folder}/**/*.txt',)
  assert len(data_lib.load_dataset(config, 256).train) > 1000
  tokens = data_lib.DataConfig(source='tokens', paths=(str(folder),))
  with pytest.raises(ValueError, match=r"\*\*/\*\.bin"):
    data_lib.load_dataset(tokens, 256)


@pytest.mark.parametrize('source', ['stdlib', 'text'])
def test_bytes_for_a_checkpoint_vocabulary_are_refused(tmp_path, corpus,
                                                       source):
  """Byte ids (0-255) for a checkpoint with a 32000-token vocabulary would
  train it on raw bytes; its own tokenizer must be named."""
  ckpt = tmp_path / 'llama'
  ckpt.mkdir()
  config = data_lib.DataConfig(source=source, paths=(corpus,), seq_len=16)
  with pytest.raises(ValueError, match=(
      f'model.init_from={ckpt} has a 32000-token vocabulary.*byte-level'
      '.*data.tokenizer=')):
    data_lib.load_dataset(config, 32000, init_from=str(ckpt))
  (ckpt / 'tokenizer.model').write_bytes(b'sentencepiece')
  with pytest.raises(ValueError, match='has tokenizer.model but no'
                     ' tokenizer.json: transformers writes one'):
    data_lib.load_dataset(config, 32000, init_from=str(ckpt))
  # A byte-level checkpoint, or a model trained from scratch, takes bytes.
  data_lib.load_dataset(config, 256, init_from=str(ckpt))
  data_lib.load_dataset(config, 32000)


@pytest.fixture(scope='module')
def bpe(corpus, tmp_path_factory) -> str:
  """A byte-level BPE tokenizer.json of 320 ids (the 256 bytes and 64
  merges) trained on the corpus."""
  import tokenizers  # noqa: PLC0415
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(
      add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  tok.train([corpus], tokenizers.trainers.BpeTrainer(
      vocab_size=320, show_progress=False,
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
  path = str(tmp_path_factory.mktemp('tokenizer') / 'tokenizer.json')
  tok.save(path)
  return path


def test_text_is_tokenized_by_the_tokenizer_json(bpe, corpus):
  import tokenizers  # noqa: PLC0415
  config = data_lib.DataConfig(source='text', paths=(corpus,),
                               tokenizer=bpe, seq_len=32)
  dataset = data_lib.load_dataset(config, 320)
  want = tokenizers.Tokenizer.from_file(bpe).encode(open(corpus).read()).ids
  np.testing.assert_array_equal(
      np.concatenate([dataset.train, dataset.val]), want)
  assert max(want) >= 256  # merges are used, not only the bytes
  tok = tokenizer_lib.for_data(config)
  assert tok.vocab_size == 320
  assert tok.decode(tok.encode('def main():')) == 'def main():'
  with pytest.raises(ValueError, match=f'{corpus} \\(tokenized by'
                     f' data.tokenizer={bpe}\\) holds token id .*, but the'
                     ' model has vocab_size=256'):
    data_lib.load_dataset(config, 256)


def test_a_run_on_tokenizer_json_text_trains_and_samples(tiny_config, bpe):
  """data.tokenizer: the run trains on its ids and decodes its sample with
  it."""
  config = tiny_config(model={'vocab_size': 320}, data={'tokenizer': bpe},
                       train={'steps': 2, 'sample_tokens': 4,
                              'sample_prompt': 'def '})
  summary = training.train(config, devices=jax.devices()[:1])
  assert summary['step'] == 2 and math.isfinite(summary['train_loss'])
  assert summary['sample'].startswith('def ')
  assert len(summary['sample']) > len('def ')


@pytest.fixture(scope='module')
def tiny_hf(tmp_path_factory) -> cm.Decoder:
  return cm.Llama(cm.LlamaConfig.preset('tiny'), recipe='bf16',
                  rngs=nnx.Rngs(69))


@pytest.mark.parametrize('damage', ['truncated', 'zeroed', 'header only'])
def test_a_damaged_safetensors_file_is_named(tiny_hf, tmp_path, damage):
  hf.save_hf(tiny_hf, tmp_path)
  file = tmp_path / hf.SINGLE_FILE
  data = file.read_bytes()
  file.write_bytes({'truncated': data[:len(data) // 2],
                    'zeroed': bytes(len(data)),
                    'header only': data[:40]}[damage])
  with pytest.raises(ValueError, match=f'{file} is damaged or incomplete'
                     '.*download or save the checkpoint again'):
    hf.load_hf(tmp_path, 'bf16')


def test_a_damaged_shard_or_index_is_named(tiny_hf, tmp_path):
  hf.save_hf(tiny_hf, tmp_path, max_shard_size=40_000)
  shard = sorted(tmp_path.glob('model-*-of-*.safetensors'))[-1]
  shard.write_bytes(shard.read_bytes()[:1000])
  with pytest.raises(ValueError, match=f'{shard} is damaged or incomplete'):
    hf.load_hf(tmp_path, 'bf16')
  index = tmp_path / hf.INDEX_FILE
  index.write_text(index.read_text()[:100])
  with pytest.raises(ValueError, match=f'{index} is damaged or incomplete'
                     ' \\(not JSON'):
    hf.load_hf(tmp_path, 'bf16')
  (tmp_path / hf.CONFIG_FILE).write_bytes(b'\0' * 64)
  with pytest.raises(ValueError, match='config.json is damaged or'
                     ' incomplete'):
    hf.load_hf(tmp_path, 'bf16')


def test_data_errors_come_before_the_step_compiles(tiny_config, tmp_path,
                                                   monkeypatch):
  """The trainer reads and checks the data before compiling the step."""
  from coat_jax.training import memory  # noqa: PLC0415
  monkeypatch.setattr(memory, 'compile_train_step', None)  # never reached
  config = tiny_config(data={'paths': (str(tmp_path),)})
  with pytest.raises(ValueError, match='names only directories'):
    training.train(config, devices=jax.devices()[:1])
