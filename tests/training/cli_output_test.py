"""What the command lines and the package say is what happened: --estimate
names the compiler whose plan it prints, --find-max-batch shows each
compile, train.py's last line reports the last logged losses, export keeps
the checkpoint's special token ids, coat_jax's submodules load on use."""

import json
import math
import os
import signal
import subprocess
import sys
import textwrap

from flax import nnx
import jax
import numpy as np
import pytest

from coat_jax import export
from coat_jax import training
import coat_jax.models as cm
from coat_jax.training import checkpoints
from coat_jax.training import config as config_lib
from coat_jax.training import memory
from coat_jax.training import planning

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
sys.path.insert(0, ROOT)
import train as train_py  # noqa: E402


@pytest.fixture
def run_main(capsys, monkeypatch):
  # main() sets the GPU memory fraction for jax; keep it out of later tests.
  monkeypatch.delenv(train_py.MEM_FRACTION_ENV, raising=False)

  def run(argv):
    code = train_py.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err
  return run


def test_estimate_on_cpu_says_it_is_the_cpu_plan(run_main):
  code, out, _ = run_main(['--estimate', '--set', 'data.seq_len=32'])
  assert code == 0
  assert 'memory per device (compiled train step for cpu):' in out
  assert "(XLA:CPU's plan, not a GPU's" in out
  assert "for a GPU's figure compile on that GPU" in out


def test_a_gpu_plan_is_not_called_a_cpu_one():
  mem = memory.MemoryBreakdown(2**30, 2**29, 2**30, 2**31, 5 * 2**30,
                               80 * 2**30, platform='gpu',
                               device='NVIDIA H200')
  text = mem.format()
  assert text.splitlines()[0] == (
      'memory per device (compiled train step for NVIDIA H200):')
  assert 'XLA:CPU' not in text and 'GPU' not in text.split('\n', 1)[1]


def test_find_max_batch_shows_each_compile_and_compiles_few(run_main):
  """A search of a largest batch of about 12 units compiles 4 or 5 times
  (the old doubling and bisection: 8), each one printed as it ends."""
  sets = ['data.seq_len=32', 'mesh.data=1', 'mesh.fsdp=8', 'model.remat=full']
  config = training.apply_overrides(training.Config(), sets)
  at = lambda b: planning.estimate(training.apply_overrides(
      config, [f'train.batch_size={b}'])).total
  one, two = at(8), at(16)  # the batch steps by 8 devices
  limit = one + 11.5 * (two - one)
  code, out, _ = run_main(['--find-max-batch', '--memory-limit-gib',
                           str(limit / memory.GIB), '--policies', 'full',
                           '--set'] + sets)
  assert code == 0, out
  blocks, tried = [], {}
  for line in out.splitlines():
    if line.startswith('    batch '):
      batch, rest = line.removeprefix('    batch ').split(': ', 1)
      assert rest.endswith(' s)') and 'compiled in' in rest, line
      tried[int(batch)] = rest
    elif 'model.remat=full: train.batch_size=' in line:
      blocks.append((int(line.rsplit('=', 1)[1]), tried))
      tried = {}
  assert len(blocks) == 2, out  # unrolled, then scanned
  for batch, tried in blocks:
    assert 2 <= len(tried) <= 5, out
    assert batch % 8 == 0 and batch >= 8
    # The answer fits and the next multiple, compiled too, does not.
    assert tried[batch].split(' (')[0].endswith('fits'), out
    assert tried[batch + 8].split(' (')[0].endswith('too large'), out


def _fake_run(monkeypatch, run_dir, records, interrupted):
  """train.py's main with `training.train` replaced: the summary of a run
  whose metrics.jsonl holds `records`."""
  os.makedirs(run_dir, exist_ok=True)
  with open(os.path.join(run_dir, 'metrics.jsonl'), 'w') as f:
    f.writelines(json.dumps(r) + '\n' for r in records)
  losses = [r['loss'] for r in records if 'loss' in r]
  summary = {'complete': False, 'sample': None, 'interrupted': interrupted,
             'signal': signal.SIGINT if interrupted else None,
             'step': records[-1]['step'], 'nonfinite_steps': 0,
             'train_loss': float(np.mean(losses[-3:])),
             'val_loss': math.nan, 'tokens_per_s': 1234.0,
             'peak_memory_bytes': None, 'run_dir': run_dir}
  monkeypatch.setattr(training, 'train', lambda config: summary)


def test_done_reports_the_last_logged_loss_and_no_evaluation(
    run_main, monkeypatch, tmp_path):
  run_dir = str(tmp_path / 'run')
  _fake_run(monkeypatch, run_dir, [
      {'step': s, 'loss': loss, 'tokens_per_s': 1234.0}
      for s, loss in ((10, 3.0), (20, 2.0), (30, 1.0))], interrupted=True)
  code, out, _ = run_main(['--set', f'train.run_dir={run_dir}',
                           'train.compilation_cache_dir='])
  assert code == 130
  (done,) = [line for line in out.splitlines() if line.startswith('done:')]
  assert done.startswith('done: step 30, train loss 1.0000 (step 30), no'
                         ' evaluation yet, tokens/s 1,234 (step 30), peak'
                         ' device memory'), done
  assert 'nan' not in done


def test_done_reports_the_last_evaluation_with_its_step(
    run_main, monkeypatch, tmp_path):
  run_dir = str(tmp_path / 'run')
  _fake_run(monkeypatch, run_dir, [
      {'step': 10, 'loss': 3.0}, {'step': 10, 'val_loss': 2.5},
      {'step': 20, 'loss': 2.0}], interrupted=False)
  code, out, _ = run_main(['--set', f'train.run_dir={run_dir}',
                           'train.compilation_cache_dir='])
  assert code == 0
  assert ('done: step 20, train loss 2.0000 (step 20), validation loss'
          ' 2.5000 (step 10), peak device memory') in out


def test_checkpoint_module_works_after_import_coat_jax(tmp_path):
  script = textwrap.dedent(f"""
      import numpy as np
      import coat_jax
      tree = {{'w': np.arange(6, dtype=np.float32).reshape(2, 3)}}
      coat_jax.checkpoint.save({str(tmp_path / 'ckpt')!r}, tree)
      back = coat_jax.checkpoint.restore({str(tmp_path / 'ckpt')!r}, tree)
      print(np.asarray(back['w']).sum(), coat_jax.training.Config.__name__)
      """)
  out = subprocess.run([sys.executable, '-c', script], capture_output=True,
                       text=True, check=False, cwd=ROOT,
                       env={**os.environ, 'PYTHONPATH': ROOT})
  assert out.returncode == 0, out.stderr
  assert out.stdout.split() == ['15.0', 'Config']


def test_export_keeps_the_special_token_ids(tiny_config, tmp_path):
  model = cm.Llama(cm.LlamaConfig.preset('tiny'), recipe='bf16',
                   rngs=nnx.Rngs(69))
  source = str(tmp_path / 'hf')
  cm.save_hf(model, source)
  with open(os.path.join(source, 'config.json')) as f:
    hf_json = json.load(f)
  ids = {'bos_token_id': 1, 'eos_token_id': [2, 7], 'pad_token_id': 0}
  with open(os.path.join(source, 'config.json'), 'w') as f:
    json.dump({**hf_json, **ids}, f)
  # A run directory with the checkpoint's state at step 0.
  config = tiny_config(model={'init_from': source})
  run = config.train.run_dir
  setup = training.build(config, jax.devices()[:1])
  os.makedirs(run)
  with open(os.path.join(run, 'config.json'), 'w') as f:
    json.dump(config_lib.to_dict(config), f)
  checkpointer = checkpoints.Checkpointer(run, config)
  with jax.set_mesh(setup.mesh):
    checkpointer.save(0, setup.init_state(), wait=True)
  checkpointer.close()
  out = str(tmp_path / 'out')
  assert export.main([run, out]) == 0
  with open(os.path.join(out, 'config.json')) as f:
    exported = json.load(f)
  assert {k: exported.get(k) for k in ids} == ids
  assert {k: v for k, v in exported.items() if k not in ids} == hf_json
  with pytest.raises(ValueError, match=r"extra_config sets \['vocab_size'\]"):
    cm.save_hf(model, str(tmp_path / 'clash'),
               extra_config={'vocab_size': 3})


@pytest.mark.parametrize('setting,message', [
    ('optim.learning_rate=inf',
     'optim.learning_rate must be a finite number, got inf.'),
    ('optim.b2=1.5', "optim.b2 must be in [0, 1) (the second moment's decay),"
     ' got 1.5.'),
    ('train.run_dir={file}', 'train.run_dir={file} is a file;'),
])
def test_bad_settings_are_one_error_line(run_main, tmp_path, setting,
                                         message):
  file = tmp_path / 'notes.txt'
  file.write_text('')
  code, out, err = run_main(['--set', setting.format(file=file)])
  assert code == 2
  assert err.startswith('error: ' + message.format(file=file)), err
  assert err.count('\n') == 1 and 'Traceback' not in err
  assert 'compiled in' not in out  # refused before compiling
