"""Nothing lost: the final checkpoint, SIGTERM, kill -9 mid-save, damaged
checkpoints, and what a resumed run says and logs."""

import glob
import importlib.util
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time

import jax
import pytest

from coat_jax import training
from coat_jax.checkpoint import DamagedCheckpointError
from coat_jax.training import metrics as metrics_lib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
needs_tensorboardx = pytest.mark.skipif(
    importlib.util.find_spec('tensorboardX') is None,
    reason='needs tensorboardX')


def _records(run_dir):
  """Every record of metrics.jsonl, in the order written."""
  with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def _losses(run_dir):
  """[(step, loss)] of metrics.jsonl's training records, in the order
  written (a step logged twice shows twice)."""
  return [(r['step'], r['loss']) for r in _records(run_dir) if 'loss' in r]


def _steps_on_disk(run_dir):
  ckpts = os.path.join(run_dir, 'checkpoints')
  return sorted(int(d) for d in os.listdir(ckpts) if d.isdigit())


def _train(config):
  return training.train(config, devices=jax.devices()[:1])


# ------------------------------------------------------ the final checkpoint


def test_checkpoint_every_0_still_saves_the_final_state(tiny_config):
  config = tiny_config(train={'checkpoint_every': 0})
  _train(config)
  run = config.train.run_dir
  assert _steps_on_disk(run) == [3]
  again = _train(config)
  assert again['complete'] and again['resumed_from'] == 3


def test_turning_saving_off_warns_at_the_start(tiny_config, capsys):
  config = tiny_config(train={'save_checkpoints': False,
                              'checkpoint_every': 1})
  summary = _train(config)
  assert summary['step'] == 3
  err = capsys.readouterr().err
  assert 'warning: train.save_checkpoints=false: this run saves no' in err
  assert not glob.glob(os.path.join(config.train.run_dir, 'checkpoints',
                                    '[0-9]*'))


def test_a_stop_right_after_a_periodic_save_keeps_that_save(
    tiny_config, ctrl_c_at_call):
  """Ctrl-C during the step after a save: the step saved is not saved
  again (orbax refuses a step that exists)."""
  ctrl_c_at_call(3)
  config = tiny_config(train={'steps': 6, 'checkpoint_every': 2})
  summary = _train(config)
  assert summary['interrupted'] and summary['step'] == 2
  assert summary['signal'] == signal.SIGINT
  assert _steps_on_disk(config.train.run_dir) == [2]


# ------------------------------------------------------------ train.py runs


def _cli_args(corpus, run_dir, *extra):
  return ['--set', 'data.source=text', f'data.paths={corpus}',
          'data.seq_len=32', 'train.batch_size=8', 'train.log_every=1',
          'train.eval_every=100', 'train.eval_batches=1',
          'train.sample_tokens=0', 'train.progress_bar=false',
          'optim.warmup_steps=1', f'train.run_dir={run_dir}', *extra]


def _wait_for(condition, proc, what, timeout=300):
  deadline = time.time() + timeout
  while not condition():
    if proc.poll() is not None:
      out, err = proc.communicate()
      pytest.fail(f'train.py exited ({proc.returncode}) before {what}:\n'
                  f'{(out + err)[-3000:]}')
    if time.time() > deadline:
      proc.kill()
      pytest.fail(f'no {what} within {timeout} s')
    time.sleep(0.2)


def test_sigterm_saves_and_exits_143(corpus, tmp_path):
  """A real SIGTERM (sent twice, as schedulers may): the step finishes, the
  state is saved, the message says so, exit code 128 + 15."""
  run = tmp_path / 'run'
  proc = subprocess.Popen(
      [sys.executable, 'train.py', *_cli_args(
          corpus, run, 'train.steps=100000', 'train.checkpoint_every=0')],
      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  metrics = run / 'metrics.jsonl'
  _wait_for(lambda: metrics.exists() and metrics.read_text().count('\n') >= 2,
            proc, 'two logged steps')
  proc.send_signal(signal.SIGTERM)
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 143, (out + err)[-3000:]
  (saved,) = _steps_on_disk(run)
  assert f'stopped by SIGTERM: saved step {saved} to' in out
  assert f'done: step {saved},' in out
  assert _losses(run)[-1][0] == saved  # the last step logged is the one saved


# orbax commits a step by renaming its finished temporary directory. This
# runs train.py (the arguments after the marker path and the step) with that
# rename stalled for one step, after touching the marker: the save is in
# flight until the process is killed.
_STALLED_COMMIT = """
import runpy, sys, time
from etils import epath
marker, step = sys.argv[1:3]
sys.argv = ['train.py', *sys.argv[3:]]
path_type = type(epath.Path('/'))
rename = path_type.rename

def stalled(self, target):
  if epath.Path(target).name == step:
    epath.Path(marker).touch()
    time.sleep(600)
  return rename(self, target)

path_type.rename = stalled
runpy.run_path('train.py', run_name='__main__')
"""


def test_kill_9_mid_save_resumes_from_the_save_before(corpus, tmp_path):
  """SIGKILL while the last step's async save is in flight. The process had
  logged steps 1-4 (they precede the save): the losses of an uninterrupted
  run, which the rerun, resumed from step 2, must repeat bit for bit."""
  run, marker = tmp_path / 'run', tmp_path / 'saving_step_4'
  args = _cli_args(corpus, run, 'train.steps=4', 'train.checkpoint_every=2')
  proc = subprocess.Popen(
      [sys.executable, '-c', _STALLED_COMMIT, str(marker), '4', *args],
      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  _wait_for(marker.exists, proc, 'the save of step 4')
  proc.send_signal(signal.SIGKILL)
  proc.communicate(timeout=60)
  assert proc.returncode == -signal.SIGKILL
  assert _steps_on_disk(run) == [2]
  assert glob.glob(str(run / 'checkpoints' / '4.orbax-checkpoint-tmp*'))
  uninterrupted = _losses(run)
  assert [step for step, _ in uninterrupted] == [1, 2, 3, 4]

  out = subprocess.run([sys.executable, 'train.py', *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
  assert 'resuming from step 2 (' in out.stdout
  assert _steps_on_disk(run) == [2, 4]
  assert _losses(run) == uninterrupted  # each step once, the same losses


# --------------------------------------------------------- resuming a run


def _config(corpus, run_dir, **train):
  """The tiny run: 8 sequences of 32 bytes, a checkpoint every 2 steps."""
  config = training.Config()
  config.data = training.DataConfig(source='text', paths=(corpus,),
                                    seq_len=32)
  config.train = training.TrainConfig(
      steps=4, batch_size=8, log_every=1, eval_every=100, eval_batches=1,
      checkpoint_every=2, run_dir=str(run_dir), progress_bar=False,
      sample_tokens=0)
  config.optim.warmup_steps = 1
  for k, v in train.items():
    setattr(config.train, k, v)
  return config


@pytest.fixture(scope='module')
def runs(corpus, tmp_path_factory):
  """(a 4-step run with checkpoints at steps 2 and 4, the [(step, loss)] of
  the same run trained to 6 steps without a stop)."""
  base = tmp_path_factory.mktemp('runs')
  _train(_config(corpus, base / 'full', steps=6))
  _train(_config(corpus, base / 'four'))
  assert _steps_on_disk(base / 'four') == [2, 4]
  return base / 'four', _losses(base / 'full')


def _copy(runs, tmp_path):
  run = tmp_path / 'run'
  shutil.copytree(runs[0], run)
  return run


def test_a_resumed_run_says_so_and_logs_each_step_once(corpus, runs,
                                                       tmp_path, capsys):
  """Step 4's save lost after its steps were logged: the rerun replays
  steps 3 and 4, and their records are not written twice."""
  run = _copy(runs, tmp_path)
  shutil.rmtree(run / 'checkpoints' / '4')
  summary = _train(_config(corpus, run, steps=6))
  assert summary['resumed_from'] == 2 and summary['step'] == 6
  assert f'resuming from step 2 ({run}/checkpoints/2, restored in' in (
      capsys.readouterr().out)
  assert _losses(run) == runs[1]


def _largest_data_file(step_dir):
  files = glob.glob(os.path.join(step_dir, 'state', 'ocdbt.process_0', 'd',
                                 '*'))
  return max(files, key=os.path.getsize)


def _truncate(step_dir):
  path = _largest_data_file(step_dir)
  os.truncate(path, os.path.getsize(path) // 2)
  return os.path.join(step_dir, 'state'), 'OUT_OF_RANGE: Error reading "'


def _zero(step_dir):
  path = _largest_data_file(step_dir)
  with open(path, 'r+b') as f:
    f.write(bytes(os.path.getsize(path)))
  return os.path.join(step_dir, 'state'), 'ZSTD_decompressStream() failed'


def _delete_state(step_dir):
  shutil.rmtree(os.path.join(step_dir, 'state'))
  return os.path.join(step_dir, 'state'), 'missing (the step directory holds'


def _empty(step_dir):
  shutil.rmtree(step_dir)
  os.mkdir(step_dir)
  return step_dir, 'the step directory is empty'


def _overwrite_metadata(step_dir):
  with open(os.path.join(step_dir, 'state', '_METADATA'), 'w') as f:
    f.write('overwritten')
  return os.path.join(step_dir, 'state', '_METADATA'), 'JSONDecodeError'


DAMAGES = [_truncate, _zero, _delete_state, _empty, _overwrite_metadata]


@pytest.mark.parametrize('damage', DAMAGES, ids=lambda f: f.__name__[1:])
def test_a_damaged_checkpoint_is_reported_and_the_one_before_resumes(
    corpus, runs, tmp_path, capsys, damage):
  run = _copy(runs, tmp_path)
  path, why = damage(str(run / 'checkpoints' / '4'))
  summary = _train(_config(corpus, run, steps=6))
  out = capsys.readouterr().out
  assert f'the checkpoint of step 4 is damaged: {path}: ' in out
  assert why in out
  assert f'moved the damaged step 4 to {run}/damaged_checkpoints/4.' in out
  assert f'resuming from step 2 ({run}/checkpoints/2, restored in' in out
  assert summary['resumed_from'] == 2 and summary['step'] == 6
  assert _losses(run) == runs[1]
  assert _steps_on_disk(run) == [4, 6]
  assert os.listdir(run / 'damaged_checkpoints') == ['4']


def test_a_damaged_checkpoint_stops_the_run_when_asked(corpus, runs,
                                                       tmp_path):
  run = _copy(runs, tmp_path)
  path, _ = _overwrite_metadata(str(run / 'checkpoints' / '4'))
  config = _config(corpus, run, steps=6, on_damaged_checkpoint='stop')
  with pytest.raises(DamagedCheckpointError,
                     match='Set train.on_damaged_checkpoint=fallback') as e:
    _train(config)
  assert e.value.step == 4 and e.value.path == path
  assert str(e.value).startswith(
      f'the checkpoint of step 4 is damaged: {path}: JSONDecodeError')
  assert _steps_on_disk(run) == [2, 4]  # nothing moved


def test_no_intact_checkpoint_stops_and_moves_nothing(corpus, runs,
                                                      tmp_path):
  """Every step damaged (or a restore that always fails): no fresh start
  over the user's checkpoints."""
  run = _copy(runs, tmp_path)
  for step in (2, 4):
    _overwrite_metadata(str(run / 'checkpoints' / str(step)))
  with pytest.raises(ValueError, match=r'restores \(steps \[4, 2\]'):
    _train(_config(corpus, run, steps=6))
  assert _steps_on_disk(run) == [2, 4]
  assert not (run / 'damaged_checkpoints').exists()


# -------------------------------------------------------------- metrics log


def _events(event_file):
  """The TensorBoard events of an event file (TFRecords)."""
  from tensorboardX.proto import event_pb2  # noqa: PLC0415
  with open(event_file, 'rb') as f:
    data = f.read()
  events, at = [], 0
  while at < len(data):
    (length,) = struct.unpack('<Q', data[at:at + 8])
    events.append(event_pb2.Event.FromString(data[at + 12:at + 12 + length]))
    at += 12 + length + 4
  return events


@needs_tensorboardx
def test_drop_after_keeps_the_records_up_to_the_resumed_step(tmp_path):
  log = metrics_lib.MetricsLog(str(tmp_path))
  for step in (1, 2, 3):
    log.write(step, loss=float(step))
  log.write(2, val_loss=0.5)
  log.close()
  with open(tmp_path / 'metrics.jsonl', 'a') as f:
    f.write('{"step": 1, "lo')  # a line cut short by a kill
  log = metrics_lib.MetricsLog(str(tmp_path), tensorboard=True)
  log.drop_after(2)
  log.write(3, loss=30.0)
  log.close()
  assert _records(tmp_path) == [
      {'step': 1, 'loss': 1.0}, {'step': 2, 'loss': 2.0},
      {'step': 2, 'val_loss': 0.5}, {'step': 3, 'loss': 30.0}]
  # TensorBoard hides the earlier writer's events from step 3 on.
  (events,) = glob.glob(str(tmp_path / 'tensorboard' / 'events.*'))
  (purge,) = [e for e in _events(events) if e.HasField('session_log')]
  assert purge.step == 3 and purge.session_log.status == purge.session_log.START
