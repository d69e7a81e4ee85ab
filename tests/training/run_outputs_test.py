"""What a run leaves and shows: TensorBoard scalars, the final sample, a
rerun of a finished run, generation and plots from its directory."""

import glob
import importlib.util
import json
import math
import os
import shlex
import struct
import sys

import jax
import numpy as np
import pytest

from coat_jax import generate
from coat_jax import plot
from coat_jax.models import sampling
from coat_jax.training import metrics as metrics_lib
from coat_jax.training import tokenizer as tokenizer_lib
from coat_jax.training import trainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
# TensorBoard's tests need tensorboardX, which the test extra installs: a
# machine without it fails them (with the ImportError naming the package)
# rather than skipping them.


def _train_py():
  spec = importlib.util.spec_from_file_location(
      '_train_cli', os.path.join(ROOT, 'train.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _args(corpus, run_dir, *extra):
  return ['--set', 'data.source=text', f'data.paths={corpus}',
          'data.seq_len=32', 'train.batch_size=8', 'train.steps=3',
          'train.log_every=1', 'train.eval_every=3', 'train.eval_batches=1',
          'train.progress_bar=false', 'train.sample_tokens=12',
          'train.sample_prompt=import ', f'train.run_dir={run_dir}', *extra]


@pytest.fixture(scope='module')
def finished(corpus, tmp_path_factory):
  """A 3-step run through train.py's main with TensorBoard on, then the same
  command again: (run_dir, argv, first output, rerun output, exit codes)."""
  run_dir = str(tmp_path_factory.mktemp('finished') / 'run')
  argv = _args(corpus, run_dir, 'train.tensorboard=true')
  cli = _train_py()
  outputs, codes = [], []
  for _ in range(2):
    capture = _Capture()
    with capture:
      codes.append(cli.main(argv))
    outputs.append(capture.text)
  return run_dir, argv, outputs[0], outputs[1], codes


class _Capture:
  """Collects what print() writes to stdout (capsys is function-scoped)."""

  def __enter__(self):
    import io  # noqa: PLC0415
    self._old, sys.stdout = sys.stdout, io.StringIO()

  def __exit__(self, *exc):
    self.text = sys.stdout.getvalue()
    sys.stdout = self._old


def _scalars(event_file):
  """{tag: [(step, value)]} from a TensorBoard event file (TFRecords)."""
  from tensorboardX.proto import event_pb2  # noqa: PLC0415
  out = {}
  with open(event_file, 'rb') as f:
    data = f.read()
  at = 0
  while at < len(data):
    (length,) = struct.unpack('<Q', data[at:at + 8])
    event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
    at += 12 + length + 4
    for v in event.summary.value:
      out.setdefault(v.tag, []).append((event.step, v.simple_value))
  return out


def test_the_run_ends_with_a_sample_and_its_summary(finished):
  run_dir, _, first, _, codes = finished
  assert codes == [0, 0]
  (line,) = [x for x in first.splitlines() if x.startswith('sample')]
  assert line.startswith("sample (greedy): 'import ")
  assert 'done: step 3' in first


def test_tensorboard_has_every_scalar_of_metrics_jsonl(finished):
  run_dir = finished[0]
  (events,) = glob.glob(os.path.join(run_dir, 'tensorboard', 'events.*'))
  scalars = _scalars(events)
  records = metrics_lib.read_metrics(run_dir)
  for key, tag in (('loss', 'train/loss'), ('grad_norm', 'train/grad_norm'),
                   ('learning_rate', 'train/learning_rate'),
                   ('tokens_per_s', 'perf/tokens_per_s'),
                   ('nonfinite_steps', 'train/skipped_steps'),
                   ('val_loss', 'val/loss')):
    steps, values = metrics_lib.series(records, key)
    assert [s for s, _ in scalars[tag]] == steps, tag
    np.testing.assert_allclose([v for _, v in scalars[tag]], values,
                               rtol=1e-6, err_msg=tag)
  assert len(scalars['train/loss']) == 3 and len(scalars['val/loss']) == 1
  # The rate each step used: warmup over min(20, steps - 1) = 2 steps to
  # optim.learning_rate.
  lrs = [v for _, v in scalars['train/learning_rate']]
  np.testing.assert_allclose(lrs, [0, 1.5e-3, 3e-3], rtol=1e-6)


def test_peak_memory_goes_to_tensorboard_in_gib(tmp_path):
  log = metrics_lib.MetricsLog(str(tmp_path), tensorboard=True)
  log.write(5, loss=1.5, peak_memory_bytes=3 * 2**30, grad_norm=None)
  log.close()
  (events,) = glob.glob(str(tmp_path / 'tensorboard' / 'events.*'))
  assert _scalars(events) == {'train/loss': [(5, 1.5)],
                              'perf/peak_memory_gib': [(5, 3.0)]}
  assert metrics_lib.read_metrics(str(tmp_path)) == [
      {'step': 5, 'loss': 1.5, 'peak_memory_bytes': 3 * 2**30}]


def test_peak_memory_is_the_largest_of_the_local_devices(monkeypatch):
  class Device:
    def __init__(self, stats):
      self.stats = stats

    def memory_stats(self):
      return self.stats

  # Sharded, any device may peak highest; CPU devices report no stats.
  devices = [Device({'peak_bytes_in_use': 5}),
             Device({'peak_bytes_in_use': 9}), Device(None)]
  monkeypatch.setattr(jax, 'local_devices', lambda: devices)
  assert trainer._peak_memory() == 9
  monkeypatch.setattr(jax, 'local_devices', lambda: [Device(None)])
  assert trainer._peak_memory() is None


def test_tensorboard_without_tensorboardx_says_what_to_install(
    tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, 'tensorboardX', None)
  with pytest.raises(ImportError, match='pip install tensorboardX'):
    metrics_lib.MetricsLog(str(tmp_path), tensorboard=True)
  metrics_lib.MetricsLog(str(tmp_path)).close()  # off: not needed


def test_train_without_tensorboardx_fails_before_compiling(
    tiny_config, monkeypatch):
  from coat_jax import training  # noqa: PLC0415
  from coat_jax.training import trainer  # noqa: PLC0415
  monkeypatch.setitem(sys.modules, 'tensorboardX', None)
  monkeypatch.setattr(trainer, 'build', None)  # never reached
  with pytest.raises(ImportError, match='or set train.tensorboard=false'):
    training.train(tiny_config(train={'tensorboard': True}))


def test_rerunning_a_finished_run_reports_it(finished):
  run_dir, argv, first, again, _ = finished
  last = metrics_lib.latest(metrics_lib.read_metrics(run_dir))
  assert 'nan' not in again and 'done:' not in again
  assert 'memory per device' in first
  assert 'memory per device' not in again  # nothing compiled
  assert 'train step lowered and compiled in' in first
  assert 'lowered and compiled' not in again
  assert f'the run in {os.path.abspath(run_dir)} is complete' in again
  assert 'step 3, train.steps=3' in again
  assert f"train loss {last['loss'][1]:.4f} (step 3)" in again
  assert f"validation loss {last['val_loss'][1]:.4f} (step 3)" in again
  command = shlex.join(['python', 'train.py', *argv, '--set',
                        'train.steps=6'])
  assert "'train.sample_prompt=import '" in command  # quoted for a shell
  assert command in again
  # The rerun wrote nothing new.
  with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
    assert sum(1 for _ in f) == 4  # 3 training lines, 1 validation line


def test_generate_continues_from_the_latest_checkpoint(finished, capsys):
  run_dir = finished[0]
  config, model, step = generate.load_run(run_dir)
  assert step == 3 and config.train.steps == 3
  tok = tokenizer_lib.for_data(config.data)
  expected = 'def f' + tok.decode(sampling.generate(model, tok.encode(
      'def f'), 10, vocab_limit=256))
  assert generate.main([run_dir, '--prompt', 'def f',
                        '--max-new-tokens', '10']) == 0
  assert capsys.readouterr().out == expected + '\n'
  hot = lambda seed: generate.main([run_dir, '--prompt', 'x', '--seed',
                                    str(seed), '--temperature', '3',
                                    '--max-new-tokens', '20'])
  outs = []
  for seed in (0, 0, 1):
    assert hot(seed) == 0
    outs.append(capsys.readouterr().out)
  assert outs[0] == outs[1] != outs[2]


def test_generate_refuses_what_it_cannot_do(tmp_path, capsys, finished):
  assert generate.main([str(tmp_path), '--prompt', 'a']) == 2
  assert 'no config.json' in capsys.readouterr().err
  assert generate.main([finished[0], '--prompt', '']) == 2
  assert 'prompt is empty' in capsys.readouterr().err


def test_plot_of_real_runs(finished, tmp_path):
  out = str(tmp_path / 'curves.png')
  assert plot.main([finished[0], finished[0], '-o', out]) == 0
  with open(out, 'rb') as f:
    assert f.read(8) == b'\x89PNG\r\n\x1a\n'


def _fake_run(path, recipe, lines, key='recipe'):
  """A run directory; key='precision' writes the recipe's older name."""
  os.makedirs(path)
  with open(os.path.join(path, 'config.json'), 'w') as f:
    json.dump({'model': {'preset': 'tiny', key: recipe},
               'optim': {'name': 'adamw'}}, f)
  with open(os.path.join(path, 'metrics.jsonl'), 'w') as f:
    f.write(lines)


def test_metrics_reading_keeps_the_resumed_records(tmp_path):
  run = str(tmp_path / 'a')
  _fake_run(run, 'bf16', '{"step": 1, "loss": 3.0}\n'
            '{"step": 2, "loss": 2.0}\n'
            '{"step": 2, "val_loss": 2.5}\n'
            '{"step": 2, "loss": 1.9}\n'    # resumed from step 1: rewrote 2
            '{"step": 3, "loss": NaN}\n'
            '{"step": 4, "lo')              # cut short by a kill
  records = metrics_lib.read_metrics(run)
  assert metrics_lib.series(records, 'loss') == ([1, 2], [3.0, 1.9])
  assert metrics_lib.series(records, 'val_loss') == ([2], [2.5])
  assert metrics_lib.latest(records) == {'loss': (2, 1.9),
                                         'val_loss': (2, 2.5)}
  assert math.isnan(records[-1]['loss'])


def test_plot_labels_and_errors(tmp_path, monkeypatch, capsys):
  a, b, c = (str(tmp_path / n) for n in 'abc')
  _fake_run(a, 'bf16', '{"step": 1, "loss": 3.0}\n')
  _fake_run(b, 'coat', '{"step": 1, "loss": 3.1}\n')
  _fake_run(c, 'coat', '{"step": 1, "loss": 3.2}\n', key='precision')
  d = str(tmp_path / 'd')
  _fake_run(d, {'scaling': 'block', 'fuse_qkv': False},
            '{"step": 1, "loss": 3.3}\n')
  assert plot._labels([a, b, c, d]) == [
      'tiny bf16, adamw', 'tiny coat, adamw (b)', 'tiny coat, adamw (c)',
      'tiny custom recipe, adamw']
  assert plot.main([a, str(tmp_path / 'none'), '-o',
                    str(tmp_path / 'x.png')]) == 2
  assert 'no metrics.jsonl' in capsys.readouterr().err
  monkeypatch.setitem(sys.modules, 'matplotlib', None)
  with pytest.raises(ImportError, match='pip install matplotlib'):
    plot.plot_runs([a], str(tmp_path / 'y.png'))


def test_config_json_round_trips():
  from coat_jax import training  # noqa: PLC0415
  from coat_jax.training import config as config_lib  # noqa: PLC0415
  config = training.apply_overrides(training.Config(), [
      'optim.moment_dtypes=e5m2,e4m3', 'data.paths=a.txt,b.txt',
      'train.tensorboard=true', 'model.hidden_size=96'])
  values = json.loads(json.dumps(config_lib.to_dict(config)))
  assert config_lib.from_dict(values) == config
  del values['train']['sample_prompt']  # written before the field existed
  assert config_lib.from_dict(values).train.sample_prompt == 'def '
  values['train']['typo'] = 1
  with pytest.raises(ValueError, match=r"train: unknown fields \['typo'\]"):
    config_lib.from_dict(values)
