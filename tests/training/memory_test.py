"""Memory: the ahead-of-time estimate, fitting, the max batch, train.py."""

import dataclasses
import math
import os
import sys
import types

import jax
import pytest

from coat_jax import training
from coat_jax.models import remat
from coat_jax.training import config as config_lib
from coat_jax.training import memory
from coat_jax.training import planning
from coat_jax.training import trainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
sys.path.insert(0, ROOT)
import train as train_py  # noqa: E402

ONE = jax.devices()[:1]


def _param_bytes(config):
  setup = trainer.build(config, ONE)
  return sum(math.prod(x.shape) * x.dtype.itemsize
             for x in jax.tree.leaves(setup.abstract_state['params']))


def test_estimate_divides_the_step(tiny_config):
  config = tiny_config()
  mem = planning.estimate(config, ONE, limit=1 << 40)
  params = _param_bytes(config)
  assert mem.params == params and mem.gradients == params
  # coat_adamw: two E4M3 moments (1 byte per param) plus group scales.
  assert params / 4 * 2 <= mem.optimizer_state < params
  assert mem.activations > 0
  assert mem.total >= mem.params + mem.optimizer_state + mem.gradients
  assert mem.fits
  text = mem.format()
  for part in ('params', 'optimizer state', 'gradients', 'activations',
               'total', 'the device allows'):
    assert part in text
  # What the default 'auto' stands for is printed with the activations.
  assert mem.layers == "unrolled, remat 'none' (auto)", mem.layers
  assert "activations and temporaries" in text and mem.layers in text
  for remat_policy, layers in (('auto', "scanned, remat 'full' (auto)"),
                               ('minimal', "scanned, remat 'minimal'")):
    scanned = tiny_config(model={'scan_layers': True, 'remat': remat_policy})
    assert planning.estimate(scanned, ONE, limit=1 << 40).layers == layers
  # Sharded over 8 devices (fsdp), each holds about an eighth of the state.
  sharded = planning.estimate(
      tiny_config(mesh={'data': 1, 'fsdp': 8, 'tensor': 1}))
  assert sharded.limit is None  # CPU: no device limit
  assert sharded.params < params / 2


def test_a_run_that_does_not_fit_is_refused_before_training(
    tiny_config, monkeypatch):
  """The state fits and the compiled step does not: refused after the
  compile, naming the batch and remat."""
  config = tiny_config()
  state = sum(memory.state_bytes(trainer.build(config, ONE)))
  monkeypatch.setattr(memory, 'device_limit', lambda: state + 1)
  with pytest.raises(ValueError, match=r'train\.batch_size=8, model\.remat='
                     r"'auto'.*smaller train\.batch_size.*model\.remat"
                     r'.*mesh\.fsdp'):
    training.train(config, devices=ONE)
  assert not os.path.exists(config.train.run_dir)  # nothing was started


def test_refusal_names_only_settings_not_set_already(tiny_config):
  """What check_fits offers depends on what the run already does: no remat
  policy past 'full', no offload or in-backward step where one is on."""
  gib = memory.GIB
  mem = memory.MemoryBreakdown(params=gib, optimizer_state=gib // 2,
                               gradients=gib, activations=gib,
                               total=4 * gib, limit=3 * gib)
  with pytest.raises(ValueError) as e:
    memory.check_fits(mem, tiny_config(model={'remat': 'none'}))
  plain = str(e.value)
  for option in ("model.remat one of ['minimal', 'minimal_offloaded',"
                 " 'full']", 'model.scan_layers=true',
                 'optim.apply_in_backward=true', "train.offload='optimizer'"
                 ' (the optimizer state in pinned host memory, on the device'
                 " only for its step, or with the in-backward step a layer's"
                 " for that layer's: up to 0.50 GiB less)",
                 'smaller train.batch_size', 'mesh.fsdp'):
    assert option in plain, option
  offloaded = tiny_config(model={'remat': 'full', 'scan_layers': True},
                          train={'offload': 'optimizer'})
  with pytest.raises(ValueError) as e:
    memory.check_fits(mem, offloaded)
  for option in ('model.remat one of', 'scan_layers', 'train.offload'):
    assert option not in str(e.value), option
  for option in ('smaller train.batch_size', 'apply_in_backward=true'):
    assert option in str(e.value), option
  both = tiny_config(optim={'apply_in_backward': True},
                     train={'offload': 'optimizer'})
  with pytest.raises(ValueError) as e:
    memory.check_fits(mem, both)
  for option in ('apply_in_backward', 'train.offload'):
    assert option not in str(e.value), option
  memory.check_fits(dataclasses.replace(mem, limit=5 * gib), offloaded)


def test_the_total_counts_device_buffers_only(tiny_config):
  """XLA's peak also counts buffers in pinned host memory: with any there
  (train.offload) the total is the device's arguments, outputs and
  temporaries; without, the larger of that sum and the peak."""
  setup = trainer.build(tiny_config(), ONE)
  gib = memory.GIB

  def total(**host):
    stats = types.SimpleNamespace(
        argument_size_in_bytes=10 * gib, output_size_in_bytes=10 * gib,
        alias_size_in_bytes=9 * gib, temp_size_in_bytes=5 * gib,
        peak_memory_in_bytes=30 * gib, host_temp_size_in_bytes=0, **host)
    compiled = types.SimpleNamespace(memory_analysis=lambda: stats)
    return memory.breakdown(setup, compiled, limit=100 * gib).total

  assert total(host_argument_size_in_bytes=0,
               host_output_size_in_bytes=0) == 30 * gib
  assert total(host_argument_size_in_bytes=12 * gib,
               host_output_size_in_bytes=12 * gib) == 16 * gib


def test_a_state_that_cannot_fit_is_refused_before_compiling(
    tiny_config, monkeypatch):
  """Params, optimizer state and gradients alone over the limit: refused
  before the step compiles, with their sizes and the settings that make
  room; apply_in_backward counts only the gradients outside the layers."""
  def no_compile(*args, **kwargs):
    raise AssertionError('compiled a step that cannot fit')

  monkeypatch.setattr(memory, 'compile_train_step', no_compile)
  config = tiny_config()
  setup = trainer.build(config, ONE)
  params, opt, grads = memory.state_bytes(setup)
  assert params == grads == _param_bytes(config)
  assert params / 4 * 2 <= opt < params  # FP8 moments and their scales
  layers = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(
      setup.task.layers_of(setup.abstract_state['params'])))
  assert 0 < layers < params
  limit = params + opt + grads - 1
  monkeypatch.setattr(memory, 'device_limit', lambda: limit)
  gib = lambda n: f'{n / memory.GIB:.2f} GiB'
  with pytest.raises(ValueError) as e:
    training.train(config, devices=ONE)
  message = str(e.value)
  assert f'needs {gib(params + opt + grads)} per device' in message
  assert f'gradients {gib(grads)}' in message
  assert f'allows {gib(limit)}' in message
  assert 'optim.apply_in_backward=true' in message
  assert f'{gib(layers)} less' in message and 'mesh.fsdp=N' in message
  assert 'FP8 moments (' not in message  # coat_adamw has them already
  assert not os.path.exists(config.train.run_dir)
  # float32 moments: FP8 ones are named; --estimate refuses alike.
  adamw = tiny_config(optim={'name': 'adamw'})
  with pytest.raises(ValueError, match=r'state alone.*FP8 moments \(optim'):
    planning.estimate(adamw, ONE, limit=limit)
  # In backward, only the gradients outside the layers are held: it fits.
  in_bwd = trainer.build(tiny_config(optim={'apply_in_backward': True}), ONE)
  params_b, opt_b, grads_b = memory.state_bytes(in_bwd)
  assert (params_b, grads_b) == (params, params - layers)
  assert 0 <= opt_b - opt <= 4  # the previous step's norm, for the clip
  memory.check_state_fits(in_bwd, limit)  # fits where the ordinary does not
  with pytest.raises(ValueError, match='state alone') as e:
    memory.check_state_fits(in_bwd, params + opt_b)
  assert 'apply_in_backward' not in str(e.value)  # already on
  monkeypatch.setattr(memory, 'device_limit', lambda: None)  # as a CPU
  memory.check_state_fits(setup)  # no limit known: not checked


def test_find_max_batch_searches_multiples_of_the_unit(monkeypatch):
  """The search itself, on a stand-in estimate (total = 1000 x batch): the
  compiled path is tested from the command line below."""
  compiled = []

  def fake_estimate(config, devices, limit):
    compiled.append(config.train.batch_size)
    return memory.MemoryBreakdown(0, 0, 0, 0, 1000 * config.train.batch_size,
                                  limit)

  monkeypatch.setattr(planning, 'estimate', fake_estimate)
  config = training.Config()
  config.train.microbatches = 2
  devices = jax.devices()  # 8: the batch steps by 2 x 8 = 16
  assert planning.batch_unit(config, 8) == 16
  for limit, expected in ((15_999, 0), (16_000, 16), (47_999, 32),
                          (48_000, 48), (1_000_000, 992)):
    compiled.clear()
    assert planning.find_max_batch(config, limit, devices) == expected, limit
    assert all(b % 16 == 0 for b in compiled)
    assert len(compiled) <= 2 * math.log2(max(expected, 16) / 16) + 2
  assert planning.find_max_batch(config, 10**9, devices, max_batch=100) == 96
  assert config.train.batch_size == 16  # the config given is not changed


@pytest.fixture
def run_main(capsys, monkeypatch):
  # main() sets the GPU memory fraction for jax; keep it out of later tests.
  monkeypatch.delenv(train_py.MEM_FRACTION_ENV, raising=False)
  return lambda argv: _main(argv, capsys)


def _main(argv, capsys):
  code = train_py.main(argv)
  out = capsys.readouterr()
  return code, out.out, out.err


def test_estimate_from_the_command_line(run_main):
  base = ['--set', 'data.seq_len=32', 'model.remat=full']
  code, out, _ = run_main(['--estimate'] + base)
  assert code == 0
  assert 'XLA_PYTHON_CLIENT_MEM_FRACTION=' in out
  assert 'optimizer state' in out and 'total' in out
  code, out, err = run_main(['--estimate', '--memory-limit-gib', '0.001']
                            + base)
  assert code == 2
  assert "this run's state alone needs" in err and 'mesh.fsdp' in err
  assert 'optimizer state' not in out  # nothing compiled


def test_find_max_batch_from_the_command_line(run_main):
  sets = ['data.seq_len=32', 'mesh.data=1', 'mesh.fsdp=8', 'model.remat=full']
  base = ['--set'] + sets
  code, _, err = run_main(['--find-max-batch'] + base)
  assert code == 2 and '--memory-limit-gib' in err  # CPU: no device limit
  config = training.apply_overrides(training.Config(), sets)
  at = lambda b: planning.estimate(training.apply_overrides(
      config, [f'train.batch_size={b}'])).total
  gib = (at(8) + at(16)) / 2 / memory.GIB  # batch steps by 8 devices
  code, out, _ = run_main(['--find-max-batch', '--memory-limit-gib',
                           str(gib), '--policies', 'full'] + base)
  assert code == 0
  # The configured (unrolled) layout, then the scanned one.
  lines = [s.strip() for s in out.splitlines() if 'model.remat=full' in s]
  assert [s.split(':')[0] for s in lines] == [
      'model.scan_layers=false model.remat=full',
      'model.scan_layers=true model.remat=full'], out
  assert lines[0].endswith('train.batch_size=8'), out
  scanned = training.apply_overrides(config, ['model.scan_layers=true'])
  fits = lambda b: planning.estimate(training.apply_overrides(
      scanned, [f'train.batch_size={b}'])).total <= gib * memory.GIB
  batch = int(lines[1].rsplit('=', 1)[1])  # the largest multiple of 8
  assert fits(batch) and not fits(batch + 8), (batch, out)
  code, _, err = run_main(['--find-max-batch', '--memory-limit-gib', '1',
                           '--policies', 'fastest'] + base)
  assert code == 2 and "--policies='fastest' is not a remat policy" in err


def test_find_max_batch_says_when_the_other_layout_cannot_run(
    run_main, monkeypatch):
  def find_max_batch(config, limit, **_):
    if not config.model.scan_layers:  # as under deterministic GPU ops
      raise ValueError('set model.scan_layers=true')
    return 24
  monkeypatch.setattr(planning, 'find_max_batch', find_max_batch)
  code, out, _ = run_main(['--find-max-batch', '--memory-limit-gib', '1',
                           '--policies', 'full,none', '--set',
                           'model.scan_layers=true'])
  assert code == 0
  assert [s.strip() for s in out.splitlines()[-3:]] == [
      'model.scan_layers=true model.remat=full: train.batch_size=24',
      'model.scan_layers=true model.remat=none: train.batch_size=24',
      'model.scan_layers=false: cannot run here: set model.scan_layers=true']
  code, _, err = run_main(['--find-max-batch', '--memory-limit-gib', '1'])
  assert code == 2 and 'set model.scan_layers=true' in err


def test_remat_setting_and_its_errors(run_main):
  config = training.apply_overrides(training.Config(), [
      'model.remat=full', 'data.seq_len=16384', 'model.max_seq_len=16384'])
  training.validate(config, 8)
  arch = config_lib.architecture(config.model)
  assert (arch.remat, arch.max_seq_len) == ('full', 16384)
  bad = training.apply_overrides(training.Config(), ['model.remat=most'])
  with pytest.raises(ValueError, match=r"model\.remat='most' is not a remat"
                     r" policy: use one of \('none', 'minimal'"):
    training.validate(bad, 1)
  code, _, err = run_main(['--set', 'model.remat=most'])
  assert code == 2 and 'model.remat' in err and "'full'" in err


@pytest.mark.parametrize('recipe', ['bf16', 'fp8_linear', 'coat'])
def test_train_step_compiles_with_every_policy(tiny_config, recipe):
  peaks = {}
  for scan in (True, False):
    for name in planning.usable_policies():
      config = tiny_config(model={'recipe': recipe, 'remat': name,
                                  'scan_layers': scan})
      peaks[scan, name] = planning.estimate(config, ONE).activations
  print(recipe, {k: v / 2**20 for k, v in peaks.items()})
  offload = jax.default_backend() == 'gpu'
  assert {name for _, name in peaks} == set(remat.POLICIES) - (
      set() if offload else {'minimal_offloaded'})
  assert all(v > 0 for v in peaks.values())
  # Ordered as promised under the scan. XLA:CPU drops jax.checkpoint's
  # optimization barriers before fusion, so unrolled layers recompute
  # nothing here (on the GPU they do: docs/decisions.md#comment-figures).
  assert peaks[True, 'full'] < peaks[True, 'minimal'] < peaks[True, 'none']
  if recipe == 'coat':  # activations grow with the batch
    config = tiny_config(model={'recipe': recipe, 'remat': 'none'},
                         train={'batch_size': 16})
    assert planning.estimate(config, ONE).activations > peaks[False, 'none']


@pytest.mark.gpu
@pytest.mark.parametrize('recipe', ['bf16', 'fp8_linear', 'coat'])
def test_scanned_step_keeps_no_more_than_unrolled_on_gpu(tiny_config,
                                                         recipe):
  """With the default remat ('auto'), the train step compiled by XLA:GPU
  needs no more memory with scanned layers than with unrolled ones (on an
  H200, 1b, batch 8, measured peaks: coat 10.9 against 19.9 GiB,
  fp8_linear 17.2 against 30.9, bf16 17.2 against 30.7; this test's bf16
  model on an H200: 90 against 144 MiB, 171 scanned with 'minimal')."""
  dims = {'hidden_size': 256, 'intermediate_size': 768, 'num_layers': 4,
          'num_heads': 4, 'num_kv_heads': 2, 'recipe': recipe}
  total = {}
  for scan in (True, False):
    config = tiny_config(model={**dims, 'scan_layers': scan},
                         data={'seq_len': 256}, train={'batch_size': 16})
    total[scan] = planning.estimate(config, ONE).total
  print(recipe, {k: v / 2**20 for k, v in total.items()})
  assert total[True] <= total[False]
