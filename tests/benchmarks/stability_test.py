"""benchmarks/stability.py: variants, the report from run dirs, the budget."""

import json
import math
import os

import pytest

from benchmarks import stability


def test_variants_default_to_bf16_and_coat():
  assert stability.parse_variants(['m=bf16:optim.name=coat_adamw']) == {
      'bf16': ('bf16', []), 'coat': ('coat', []),
      'm': ('bf16', ['optim.name=coat_adamw'])}
  with pytest.raises(ValueError, match='train.py runs'):
    stability.parse_variants(['p=plain'])
  with pytest.raises(ValueError, match='taken'):
    stability.parse_variants(['coat=coat:model.scan_layers=false'])


def _fake_run(out_dir, variant, lr, seed, final, *, steps=100, nonfinite=0,
              returncode=0, accuracy=None):
  run_dir = os.path.join(out_dir, stability.run_name(variant, lr, seed))
  os.makedirs(run_dir)
  with open(os.path.join(run_dir, stability.META), 'w') as f:
    json.dump(dict(variant=variant, mode='bf16', overrides=[], lr=lr,
                   seed=seed, steps=steps, seq=8, batch=2,
                   config='configs/tiny.py', set=[], returncode=returncode,
                   wall_s=1.0), f)
  with open(os.path.join(run_dir, 'metrics.jsonl'), 'w') as f:
    for step, rate in ((10, 100.0), (20, 16.0), (30, 20.0), (40, 24.0)):
      f.write(json.dumps(dict(step=step, loss=(final or 2.0) + 1 / step,
                              grad_norm=1.0, tokens_per_s=rate,
                              nonfinite_steps=nonfinite)) + '\n')
    f.write(json.dumps(dict(step=50, val_loss=(final or 2.0) + 1)) + '\n')
    if final is not None:
      f.write(json.dumps(dict(step=steps, val_loss=final, **(
          {} if accuracy is None else {'val_accuracy': accuracy}))) + '\n')
  return run_dir


def test_report_means_seeds_and_compares_to_bf16(tmp_path):
  out = str(tmp_path)
  for seed, (ref, coat) in enumerate([(2.0, 2.02), (2.2, 2.18)]):
    _fake_run(out, 'bf16', 1e-3, seed, ref)
    _fake_run(out, 'coat', 1e-3, seed, coat)
  _fake_run(out, 'bf16', 1e-2, 0, 3.0)
  _fake_run(out, 'coat', 1e-2, 0, 3.1, nonfinite=3)
  _fake_run(out, 'moments', 1e-2, 0, 3.03)
  text = stability.report(out)
  assert '| bf16 | 2.1000 (2.0000, 2.2000) | 3.0000 (3.0000) |' in text
  # Means 2.1 vs 2.1: 0%; 3.1 / 3.0: +3.33%, over the 1.5% target.
  assert '| coat | 2.1000 (2.0200, 2.1800) +0.00% ok |' in text
  assert '3.1000 (3.1000) +3.33% MISS |' in text
  assert '| moments |  | 3.0300 (3.0300) +1.00% ok |' in text
  assert 'coat_lr0.01_seed0: 3 skipped non-finite steps' in text
  # Paired by seed: +1.0% and -0.909%: mean +0.05%, standard error 0.95%.
  assert '| coat | +0.05% +- 0.95 (2 seeds) | +3.33% (1 seed) |' in text
  assert '| moments |  | +1.00% (1 seed) |' in text
  assert open(tmp_path / 'stability.md').read().strip() == text
  assert os.path.getsize(tmp_path / 'stability.png') > 10_000


def test_report_gives_the_spread_of_two_seeds_from_three_on(tmp_path):
  out = str(tmp_path)
  for seed, coat in enumerate([2.02, 2.0, 1.98]):
    _fake_run(out, 'bf16', 3e-3, seed, 2.0)
    _fake_run(out, 'coat', 3e-3, seed, coat)
  # Per seed +1%, 0%, -1%: standard deviation 1, so 1/sqrt(3) for the mean
  # of three and 1/sqrt(2) for a mean of two.
  assert '| coat | +0.00% +- 0.58 (3 seeds; two seeds +- 0.71) |' in (
      stability.report(out))


def test_curves_over_seeds_end_where_a_seed_diverged():
  steps, low, high, full, mean = stability._over_seeds([
      [(10, 3.0), (20, 2.0), (30, 1.0)],
      [(10, 5.0), (20, math.nan), (30, math.inf)]])
  assert steps == [10, 20, 30]
  assert low == [3.0, 2.0, 1.0] and high == [5.0, 2.0, 1.0]
  assert full == [10] and mean == [4.0]


def test_unfinished_runs_are_not_finished(tmp_path):
  done = stability.read_run(_fake_run(str(tmp_path), 'bf16', 1e-3, 0, 2.0))
  assert stability.is_finished(done)
  # Tokens/s: the median of the intervals after the first, 16/20/24.
  assert done['tokens_per_s'] == 20.0
  assert done['accuracy'] == [] and math.isnan(done['final_accuracy'])
  cut = stability.read_run(_fake_run(str(tmp_path), 'bf16', 1e-3, 1, None))
  assert math.isnan(cut['final_val']) and not stability.is_finished(cut)
  failed = stability.read_run(
      _fake_run(str(tmp_path), 'coat', 1e-3, 0, 2.0, returncode=1))
  assert not stability.is_finished(failed)
  assert stability.read_run(str(tmp_path / 'nothing')) is None
  diverged = stability.read_run(
      _fake_run(str(tmp_path), 'coat', 1e-2, 0, math.nan))
  assert stability.is_finished(diverged)  # nan is its result


def test_runs_use_deterministic_kernels_unless_told(monkeypatch):
  monkeypatch.setenv('XLA_FLAGS', '--xla_dump_to=/tmp/x')
  env = stability.run_env(4, deterministic=True)
  assert env['XLA_FLAGS'] == ('--xla_dump_to=/tmp/x'
                              ' --xla_gpu_deterministic_ops=true')
  assert env['XLA_PYTHON_CLIENT_MEM_FRACTION'] == '0.225'
  assert stability.run_env(4, deterministic=False)['XLA_FLAGS'] == (
      '--xla_dump_to=/tmp/x')
  monkeypatch.delenv('XLA_FLAGS')
  assert stability.run_env(1, deterministic=True)['XLA_FLAGS'] == (
      '--xla_gpu_deterministic_ops=true')


def test_unrolled_variants_need_no_deterministic(tmp_path, capsys):
  argv = ['--out-dir', str(tmp_path), '--only', 'u',
          '--variants', 'u=coat:model.scan_layers=false']
  with pytest.raises(SystemExit):
    stability.main(argv)
  assert '--no-deterministic' in capsys.readouterr().err
  assert not os.listdir(tmp_path)  # refused before any run started
  stability.check_deterministic(
      stability.parse_variants(['s=coat:model.scan_layers=true']), [])


def test_budget_stops_starting_runs(monkeypatch, tmp_path, capsys):
  clock = [0.0]
  started = []

  class FakeProcess:
    returncode = 0

    def __init__(self, cmd, **kwargs):
      started.append(cmd[cmd.index('--set') + 1:])

    def poll(self):
      clock[0] += 40.0
      return 0

  monkeypatch.setattr(stability.subprocess, 'Popen', FakeProcess)
  monkeypatch.setattr(stability.time, 'perf_counter', lambda: clock[0])
  monkeypatch.setattr(stability.time, 'sleep', lambda s: None)
  argv = ['--out-dir', str(tmp_path), '--parallel', '1', '--budget-s', '100',
          '--lrs', '1e-3,1e-2', '--seeds', '0', '--only', 'coat']
  assert stability.main(argv) == 0
  # The first run ends at 40 s, the second at 80 s; a third would end at 120.
  assert len(started) == 2
  assert 'optim.learning_rate=0.001' in started[0]
  assert {'model.recipe=coat', 'optim.name=coat_adamw', 'data.seq_len=512',
          'train.batch_size=16', 'train.steps=800'} <= set(started[1])
  text = capsys.readouterr().out
  assert 'stopped' not in text  # two runs were all there was
  argv[argv.index('--lrs') + 1] = '1e-3,3e-3,1e-2'
  argv[argv.index('--budget-s') + 1] = '50'
  clock[0] = 0.0
  assert stability.main(argv) == 0
  # No metrics were written, so nothing finished: the first run restarts,
  # and the budget stops the rest.
  assert len(started) == 3
  assert 'stopped: --budget-s 50 would be exceeded' in capsys.readouterr().out
  with pytest.raises(SystemExit):  # the same run dirs, other settings
    stability.main(argv + ['--steps', '900'])
  assert 'holds a run with other settings ([\'steps\'])' in (
      capsys.readouterr().err)
  assert len(started) == 3


def test_report_gives_a_vlms_answer_accuracy_against_bf16(tmp_path):
  out = str(tmp_path)
  for seed, (ref, coat) in enumerate([(0.80, 0.82), (0.90, 0.87)]):
    _fake_run(out, 'bf16', 3e-4, seed, 2.0, accuracy=ref)
    _fake_run(out, 'coat', 3e-4, seed, 2.0, accuracy=coat)
  text = stability.report(out)
  assert '| bf16 | 85.0% (80.0, 90.0) |' in text
  # Means 84.5% vs 85.0%: -0.5 points.
  assert '| coat | 84.5% (82.0, 87.0) -0.5 |' in text
  assert stability.read_run(os.path.join(
      out, stability.run_name('coat', 3e-4, 1)))['final_accuracy'] == 0.87


def test_shapes_runs_name_their_data_and_no_seq_len():
  args = stability.argparse.Namespace(
      config='configs/vlm_1b.py', data='shapes', seq=512, batch=32,
      steps=10, eval_every=5, eval_batches=2, deterministic=False, set=[])
  cmd = stability.train_command(args, 'coat', [], 3e-4, 1, 'runs/x')
  assert 'data.source=shapes' in cmd
  assert not any(c.startswith('data.seq_len') for c in cmd)
