"""train.py's loop: recipes, meshes, resume, faults, the CLI."""

import dataclasses
import glob
import json
import os
import signal
import subprocess
import sys
import time
from unittest import mock

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from coat_jax import quant
from coat_jax import recipes
from coat_jax import training
from coat_jax.models import families
from coat_jax.models import llama
from coat_jax.models import lm_loss
from coat_jax.training import config as config_lib
from coat_jax.training import trainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def _logged(run_dir, key):
  """Each step's logged `key` (log_every=1) from metrics.jsonl."""
  with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
    return [r[key] for r in map(json.loads, f) if key in r]


def _losses(run_dir):
  return _logged(run_dir, 'loss')


def _train(config, devices):
  summary = training.train(config, devices=devices)
  return summary, _losses(config.train.run_dir)


@pytest.mark.parametrize('recipe', ['bf16', 'fp8_linear', 'coat'])
def test_three_steps_in_each_recipe(tiny_config, recipe):
  config = tiny_config(model={'recipe': recipe})
  summary, losses = _train(config, jax.devices()[:1])
  assert len(losses) == 3 and all(np.isfinite(losses))
  assert losses[-1] < losses[0]
  assert summary['step'] == 3 and summary['nonfinite_steps'] == 0
  assert summary['compile_s'] > 0


def test_block_scaling_reaches_the_model_and_trains(tiny_config,
                                                    monkeypatch):
  seen = []
  family = families.FAMILIES['llama']

  def spy(*args, **kwargs):
    seen.append(kwargs.get('recipe'))
    return family.model(*args, **kwargs)

  monkeypatch.setitem(families.FAMILIES, 'llama',
                      dataclasses.replace(family, model=spy))
  config = training.apply_overrides(tiny_config(),
                                    ['model.recipe.scaling=block'])
  summary, losses = _train(config, jax.devices()[:1])
  assert seen and set(seen) == {recipes.COAT_BLOCK}
  assert len(losses) == 3 and all(np.isfinite(losses))
  assert losses[-1] < losses[0] and summary['nonfinite_steps'] == 0


def test_fp8_head_trains_from_the_command_line_override(tiny_config):
  """`model.recipe.fp8_head=true` reaches the loss: its three GEMMs go
  through `fp8_matmul`, and three steps lower the loss."""
  from coat_jax.models import loss as loss_lib  # noqa: PLC0415
  calls = []
  real = loss_lib.fp8_matmul

  def spy(*args, **kwargs):
    calls.append(args[0].dtype)
    return real(*args, **kwargs)

  config = training.apply_overrides(tiny_config(),
                                    ['model.recipe.fp8_head=true'])
  assert config.model.recipe == dataclasses.replace(recipes.COAT,
                                                    fp8_head=True)
  with mock.patch.object(loss_lib, 'fp8_matmul', spy):
    summary, losses = _train(config, jax.devices()[:1])
  assert calls
  assert len(losses) == 3 and all(np.isfinite(losses))
  assert losses[-1] < losses[0] and summary['nonfinite_steps'] == 0


def test_microbatches_accumulate_the_same_gradient(tiny_config, tmp_path):
  one = tiny_config(train={'run_dir': str(tmp_path / 'one')})
  two = tiny_config(train={'run_dir': str(tmp_path / 'two'),
                           'microbatches': 2})
  _, losses_one = _train(one, jax.devices()[:1])
  summary, losses_two = _train(two, jax.devices()[:1])
  assert summary['step'] == 3
  # Step 1 sees the same params: the mean of the two halves' losses is the
  # whole batch's loss, up to the FP8 scales taken per microbatch
  # (per-tensor amax of each half): another scale moves each FP8 GEMM's
  # BF16 result by about 1 ulp.
  # Later steps differ by those and float reordering.
  np.testing.assert_allclose(losses_two[0], losses_one[0], rtol=2e-4)
  np.testing.assert_allclose(losses_two, losses_one, rtol=2e-2)
  # The gradient's scale, which Adam and clipping hide from the losses (a
  # sum of the halves' gradients trains the same losses): at step 1 their
  # mean is the batch's gradient, up to the FP8 scales of each half's
  # backward GEMMs (0.2% measured).
  norms_one = _logged(one.train.run_dir, 'grad_norm')
  norms_two = _logged(two.train.run_dir, 'grad_norm')
  np.testing.assert_allclose(norms_two[0], norms_one[0], rtol=5e-3)
  np.testing.assert_allclose(norms_two, norms_one, rtol=2e-2)


def test_fused_optimizer_step_trains_like_the_optax_path(tiny_config,
                                                       tmp_path):
  plain = tiny_config(train={'run_dir': str(tmp_path / 'plain')},
                      optim={'fused': False})
  fused = tiny_config(train={'run_dir': str(tmp_path / 'fused')})
  assert config_lib.uses_fused_optimizer(fused.optim)  # the default
  _, losses_plain = _train(plain, jax.devices()[:1])
  _, losses_fused = _train(fused, jax.devices()[:1])
  np.testing.assert_allclose(losses_fused, losses_plain, rtol=1e-4)


def test_unrolled_layers_step_from_their_own_gradients(tiny_config):
  """Unrolled layers with the fused optimizer: each layer's gradient steps
  its slice of the stacked params and moments (no stacked gradient); the
  result is the fused step on the stacked gradients, and the metrics too."""
  config = tiny_config(model={'scan_layers': False},
                       optim={'warmup_steps': 0})  # params move at step 1
  assert config_lib.uses_fused_optimizer(config.optim)
  setup = training.build(config, jax.devices()[:1])
  state = setup.init_state()
  rng = np.random.default_rng(0)
  x, y = (jnp.asarray(rng.integers(0, 256, (8, 32)), jnp.int32)
          for _ in range(2))
  params, opt_state = state['params'], state['opt_state']

  @jax.jit
  def stacked_step(params, opt_state):
    loss, grads = jax.value_and_grad(lambda p: lm_loss(
        nnx.merge(setup.graphdef, p), x, y))(params)
    norm = optax.tree.norm(grads)
    return trainer._fused_update(config)(grads, norm, opt_state, params,
                                         jnp.bool_(True)), loss, norm

  (want_params, want_opt), want_loss, want_norm = stacked_step(
      params, opt_state)
  new, metrics = setup.train_step(jax.tree.map(jnp.copy, state), x, y)
  np.testing.assert_allclose(metrics['loss'], want_loss, rtol=1e-6)
  np.testing.assert_allclose(metrics['grad_norm'], want_norm, rtol=1e-5)
  for path, got, want, old in zip(
      jax.tree_util.tree_flatten_with_path(want_params)[0],
      jax.tree.leaves(new['params']), jax.tree.leaves(want_params),
      jax.tree.leaves(params)):
    assert not np.array_equal(got, old), path[0]  # every param moved
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6,
                               err_msg=str(path[0]))
  for got, want in zip(jax.tree.leaves(new['opt_state']),
                       jax.tree.leaves(want_opt)):
    got, want = (np.asarray(a).astype(np.float32) for a in (got, want))
    assert np.mean(got != want) <= 1e-3  # a rare code step from rounding


# Sharded runs repeat the single-device run: same data, same math, only the
# reduction order of the sharded matmuls differs. FP8 rounding can amplify a
# last-bit difference into one quantization step, hence 2e-3 relative for
# the losses; 5e-3 for the gradient norms (the backward GEMMs' FP8 inputs
# move more), which show a gradient summed where it should be averaged, or
# the reverse: Adam and clipping hide that from the losses.
MESHES = [dict(data=8), dict(data=1, fsdp=8), dict(data=2, fsdp=4),
          dict(data=2, fsdp=2, tensor=2)]


@pytest.mark.slow
def test_meshes_give_the_single_device_losses(tiny_config, tmp_path):
  config = tiny_config(optim={'group_size': 16},
                       mesh={'data': 1, 'fsdp': 1, 'tensor': 1})
  _, reference = _train(config, jax.devices()[:1])
  ref_norms = _logged(config.train.run_dir, 'grad_norm')
  for i, mesh in enumerate(MESHES):
    config = tiny_config(optim={'group_size': 16},
                         mesh={'data': 1, 'fsdp': 1, 'tensor': 1, **mesh},
                         train={'run_dir': str(tmp_path / f'mesh{i}')})
    _, losses = _train(config, jax.devices())
    norms = _logged(config.train.run_dir, 'grad_norm')
    print(mesh, losses, reference, norms, ref_norms)
    np.testing.assert_allclose(losses, reference, rtol=2e-3, err_msg=mesh)
    np.testing.assert_allclose(norms, ref_norms, rtol=5e-3, err_msg=mesh)


@pytest.mark.parametrize('step', ['train_step', 'eval_step'])
def test_no_collective_runs_beside_the_layer_loop(tiny_config, step):
  """With the batch sharded, no all-reduce precedes the layers' while loop.

  XLA:CPU may run such an all-reduce concurrently with the loop, whose own
  all-reduces then meet it in different orders on different devices: the
  8-device mesh test deadlocked so (the loss' token count, now reduced
  together with the loss).
  """
  config = tiny_config(model={'scan_layers': True},
                       mesh={'data': 8, 'fsdp': 1, 'tensor': 1})
  setup = training.build(config, jax.devices())
  batch = jax.ShapeDtypeStruct(
      (config.train.batch_size, config.data.seq_len), jnp.int32)
  params = setup.abstract_state['params']
  args = ((setup.abstract_state, batch, batch) if step == 'train_step'
          else (params, batch, batch))
  hlo = getattr(setup, step).lower(*args).compile().as_text()
  entry = hlo[hlo.index('\nENTRY'):]
  first_loop = entry.index(' while(')
  assert ' all-reduce(' in entry[first_loop:]  # the test sees collectives
  assert ' all-reduce(' not in entry[:first_loop], step


def test_fp8_state_carries_the_param_sharding(tiny_config):
  config = tiny_config(optim={'group_size': 16},
                       mesh={'data': 1, 'fsdp': 8, 'tensor': 1})
  setup = training.build(config, jax.devices())
  state = setup.init_state()
  mu = state['opt_state'][1][0].mu
  params = state['params']
  kernel = params['layers']['mlp']['up_proj']['kernel']  # (layers, 64, 176)
  q = mu['layers']['mlp']['up_proj']['kernel']
  assert isinstance(q, quant.QuantizedArray)
  assert kernel.sharding.spec == q.values.sharding.spec
  assert tuple(kernel.sharding.spec) == (None, 'fsdp', None)
  assert q.scale.sharding.spec == kernel.sharding.spec
  # o_proj (layers, 64 heads, 64 embed): 'embed' -> fsdp on the last axis
  # would leave 8 elements per shard, splitting the groups of 16, so fsdp
  # shards the heads axis instead.
  o = params['layers']['attn']['o_proj']['kernel']
  assert tuple(o.sharding.spec) == (None, 'fsdp', None)
  assert mu['layers']['attn']['o_proj']['kernel'].values.sharding.spec == (
      o.sharding.spec)


def test_ctrl_c_saves_and_resume_is_bit_exact(tiny_config, tmp_path,
                                               monkeypatch, ctrl_c_at_call):
  full = tiny_config(train={'steps': 6, 'run_dir': str(tmp_path / 'full')})
  _, full_losses = _train(full, jax.devices()[:1])

  part = tiny_config(train={'steps': 6, 'run_dir': str(tmp_path / 'part')})
  build = trainer.build
  ctrl_c_at_call(4)
  summary, _ = _train(part, jax.devices()[:1])
  assert summary['interrupted'] and summary['step'] == 3
  monkeypatch.setattr(trainer, 'build', build)
  summary, part_losses = _train(part, jax.devices()[:1])
  assert summary['resumed_from'] == 3 and summary['step'] == 6
  assert part_losses == full_losses  # bit for bit, every step


def test_restore_on_another_mesh_and_continue(tiny_config, tmp_path):
  run = str(tmp_path / 'run')
  config = tiny_config(optim={'group_size': 16}, train={'run_dir': run},
                       mesh={'data': 1, 'fsdp': 8, 'tensor': 1})
  _train(config, jax.devices())
  config = tiny_config(optim={'group_size': 16},
                       train={'run_dir': run, 'steps': 5},
                       mesh={'data': 2, 'fsdp': 4, 'tensor': 1})
  summary, losses = _train(config, jax.devices())
  assert summary['resumed_from'] == 3 and summary['step'] == 5
  assert len(losses) == 5 and np.isfinite(losses).all()


def test_mismatched_checkpoint_is_refused(tiny_config, tmp_path):
  run = str(tmp_path / 'run')
  _train(tiny_config(train={'run_dir': run}), jax.devices()[:1])
  other = tiny_config(train={'run_dir': run, 'steps': 4},
                      model={'hidden_size': 128})
  with pytest.raises(ValueError, match='another configuration'):
    training.train(other, devices=jax.devices()[:1])
  other = tiny_config(train={'run_dir': run, 'steps': 4},
                      optim={'moment_dtypes': ('e4m3', 'float32')})
  with pytest.raises(ValueError, match='moment_dtypes'):
    training.train(other, devices=jax.devices()[:1])


def test_checkpoint_of_an_older_config_and_runtime_changes_resume(
    tiny_config, tmp_path):
  # A checkpoint written before model.remat/recipe/... existed resumes (a
  # missing field counts as its default), and runtime fields (the recipe
  # among them) may change.
  run = str(tmp_path / 'run')
  _train(tiny_config(train={'run_dir': run}), jax.devices()[:1])
  step_dirs = glob.glob(os.path.join(run, 'checkpoints', '*', 'config'))
  assert step_dirs
  for step_dir in step_dirs:
    path = glob.glob(os.path.join(step_dir, '*'))[0]
    with open(path) as f:
      saved = json.load(f)
    for field in ('remat', 'init_from', 'qk_norm', 'sliding_window'):
      saved['model'].pop(field, None)
    saved['model']['precision'] = 'coat'  # as written before recipes
    with open(path, 'w') as f:
      json.dump(saved, f)
  later = tiny_config(train={'run_dir': run, 'steps': 4},
                      model={'remat': 'full', 'scan_layers': False,
                             'recipe': dataclasses.replace(
                                 recipes.FP8_LINEAR, fuse_qkv=False)})
  summary, _ = _train(later, jax.devices()[:1])
  assert summary['resumed_from'] == 3 and summary['step'] == 4


def test_deterministic_gpu_ops_need_the_layer_scan(monkeypatch):
  """XLA's deterministic GPU ops fail at run time with unrolled layers (jax
  0.11.2): the config is refused before compiling, naming the fix."""
  unrolled = llama.LlamaConfig.preset('tiny', scan_layers=False)
  scanned = llama.LlamaConfig.preset('tiny', scan_layers=True)
  for flags in ('--xla_gpu_deterministic_ops=true',
                '--xla_foo=1 --xla_gpu_exclude_nondeterministic_ops'):
    monkeypatch.setenv('XLA_FLAGS', flags)
    with pytest.raises(ValueError, match='set model.scan_layers=true'):
      trainer.check_deterministic_layers(unrolled, 'gpu')
    trainer.check_deterministic_layers(scanned, 'gpu')
    trainer.check_deterministic_layers(unrolled, 'cpu')
    trainer.check_deterministic_layers(
        llama.LlamaConfig.preset('tiny', num_layers=1), 'gpu')
    with pytest.raises(ValueError, match="a VLM's ViT layers are unrolled"):
      trainer.check_deterministic_layers(scanned, 'gpu', vision_layers=2)
  monkeypatch.setenv('XLA_FLAGS', '--xla_gpu_deterministic_ops=false')
  trainer.check_deterministic_layers(unrolled, 'gpu')


def test_half_written_checkpoint_leaves_the_previous_loadable(tiny_config,
                                                              tmp_path):
  run = str(tmp_path / 'run')
  _train(tiny_config(train={'run_dir': run}), jax.devices()[:1])
  ckpts = os.path.join(run, 'checkpoints')
  # What a save killed mid-write leaves: an uncommitted temporary step.
  broken = os.path.join(ckpts, '4.orbax-checkpoint-tmp-1234567')
  os.makedirs(os.path.join(broken, 'state'))
  with open(os.path.join(broken, 'state', 'garbage'), 'w') as f:
    f.write('half')
  summary, _ = _train(tiny_config(train={'run_dir': run, 'steps': 4}),
                      jax.devices()[:1])
  assert summary['resumed_from'] == 3 and summary['step'] == 4


@pytest.mark.parametrize('optim', [{}, {'name': 'coat_adamw', 'fused': True}])
def test_poisoned_gradient_is_skipped_and_counted(tiny_config, optim):
  config = tiny_config(optim=optim)
  setup = training.build(config, jax.devices()[:1])
  state = setup.init_state()
  before = jax.tree.map(np.asarray, state)
  x = jnp.zeros((8, 32), jnp.int32)
  poisoned = jax.tree.map(lambda p: p, state)
  poisoned['params'] = dict(state['params'])
  poisoned['params']['embed'] = state['params']['embed'].at[0, 0].set(jnp.nan)
  new, metrics = setup.train_step(poisoned, x, x)
  assert not bool(metrics['finite'])
  assert int(new['nonfinite']) == 1 and int(new['step']) == 1
  for a, b in zip(jax.tree.leaves(before['opt_state']),
                  jax.tree.leaves(new['opt_state'])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(
      np.asarray(new['params']['norm']['scale']),
      before['params']['norm']['scale'])


def test_default_run_from_the_command_line(tmp_path):
  """The README's `python train.py`, shortened by overrides."""
  cmd = [sys.executable, 'train.py', '--set', 'train.steps=6',
         'train.eval_every=3', 'train.log_every=3', 'data.seq_len=32',
         f'train.run_dir={tmp_path / "run"}']
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert 'done: step 6' in out.stdout
  run = tmp_path / 'run'
  assert (run / 'config.json').exists() and (run / 'metrics.jsonl').exists()
  assert os.listdir(run / 'checkpoints')
  bad = subprocess.run(cmd + ['train.batch_size=abc'], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
  assert bad.returncode == 2
  assert "train.batch_size='abc': expected a value of type int" in bad.stderr


def test_rerun_loads_the_compiled_step_from_the_cache(tmp_path):
  """train.compilation_cache_dir: the first run writes the compiled step
  there; the same command with a new run dir compiles nothing new (every
  compile is a cache hit) and trains the same losses."""
  cache = tmp_path / 'cache'
  env = {k: v for k, v in os.environ.items()
         if k != 'JAX_COMPILATION_CACHE_DIR'}  # conftest's would win
  # Every compile is cached, however fast: none may straddle jax's 1 s.
  env['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'
  outputs = []
  for run in ('first', 'second'):
    out = subprocess.run(
        [sys.executable, 'train.py', '--set', 'train.steps=2',
         'train.log_every=1', 'train.eval_every=100', 'data.seq_len=32',
         'train.sample_tokens=0', 'train.progress_bar=false',
         f'train.run_dir={tmp_path / run}',
         f'train.compilation_cache_dir={cache}'],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f'(compilation cache: {cache})' in out.stdout
    outputs.append(sorted(os.listdir(cache)))
  assert any(f.startswith('jit_train_step-') for f in outputs[0])
  assert outputs[1] == outputs[0]
  assert _losses(tmp_path / 'second') == _losses(tmp_path / 'first')


def _poison_call(n):
  """A `build` whose n-th train step sees an out-of-vocabulary token: the
  embedding lookup fills it with NaN, so loss and gradients are NaN."""
  build = trainer.build

  def patched(*args, **kwargs):
    setup = build(*args, **kwargs)
    step, calls = setup.train_step, []

    def poisoned(state, inputs, targets):
      calls.append(1)
      if len(calls) == n:
        inputs = inputs.at[0, 0].set(10**6)
      return step(state, inputs, targets)

    setup.train_step = poisoned
    return setup

  return patched


@pytest.mark.parametrize('mode', ['skip', 'stop'])
def test_nonfinite_steps_in_a_run(tiny_config, monkeypatch, mode):
  monkeypatch.setattr(trainer, 'build', _poison_call(2))
  config = tiny_config(train={'on_nonfinite': mode, 'steps': 4})
  if mode == 'stop':
    with pytest.raises(training.NonFiniteError, match='step 2: loss or'):
      training.train(config, devices=jax.devices()[:1])
    return
  summary, losses = _train(config, jax.devices()[:1])
  assert summary['nonfinite_steps'] == 1 and summary['step'] == 4
  assert np.isnan(losses[1]) and np.isfinite([losses[0]] + losses[2:]).all()


def test_ctrl_c_on_the_command_line_saves_and_exits(tmp_path):
  """A real SIGINT during training: checkpoint, message, exit code 130."""
  run = tmp_path / 'run'
  cmd = [sys.executable, 'train.py', '--set', 'train.steps=100000',
         'train.log_every=1', 'train.checkpoint_every=0', 'data.seq_len=32',
         'train.batch_size=8', f'train.run_dir={run}']
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  metrics = run / 'metrics.jsonl'
  deadline = time.time() + 300
  while time.time() < deadline and proc.poll() is None and not (
      metrics.exists() and metrics.read_text().count('\n') >= 2):
    time.sleep(0.5)
  proc.send_signal(signal.SIGINT)
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 130, err[-3000:]
  assert 'interrupted: saved step' in out + err
  steps = [int(d) for d in os.listdir(run / 'checkpoints') if d.isdigit()]
  assert steps and 'done: step' in out


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
  """jax.distributed through train.py: 2 processes x 4 CPU devices give the
  losses of 1 process x 8 devices (same mesh, same data)."""
  args = ['train.steps=3', 'train.log_every=1', 'data.seq_len=32',
          'train.progress_bar=false', 'mesh.data=8']

  def launch(run, env_extra, n):
    env = dict(os.environ, XLA_FLAGS=f'--xla_force_host_platform_device_count'
               f'={8 // n}', **env_extra)
    return subprocess.Popen(
        [sys.executable, 'train.py', '--set', *args, f'train.run_dir={run}'],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)

  port = 20000 + os.getpid() % 10000
  procs = [launch(tmp_path / 'multi', {
      'JAX_COORDINATOR_ADDRESS': f'localhost:{port}',
      'JAX_NUM_PROCESSES': '2', 'JAX_PROCESS_ID': str(i)}, 2)
      for i in range(2)]
  single = launch(tmp_path / 'single', {}, 1)
  for p in procs + [single]:
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
  multi = _losses(tmp_path / 'multi')
  assert len(multi) == 3  # one process writes the log
  np.testing.assert_allclose(multi, _losses(tmp_path / 'single'), rtol=1e-5)
  # The gradients' scale too, which Adam and clipping hide from the losses.
  np.testing.assert_allclose(_logged(tmp_path / 'multi', 'grad_norm'),
                             _logged(tmp_path / 'single', 'grad_norm'),
                             rtol=1e-5)


def test_several_devices_let_collectives_overlap():
  """A train step over several devices asks XLA for several async
  collectives at once (what lets FSDP's reduce-scatters run under GEMMs),
  unless XLA_FLAGS sets the limit; one device asks nothing. The options
  compile (8 CPU devices)."""
  flag = trainer.COLLECTIVE_OVERLAP_FLAG
  assert trainer.collective_options(1) == {}
  assert trainer.collective_options(2) == {flag: 4}
  assert trainer.collective_options(8, '--xla_foo=1') == {flag: 4}
  assert trainer.collective_options(8, f'--{flag}=2 --xla_foo=1') == {}
  f = jax.jit(lambda x: x.sum(), compiler_options=trainer.collective_options(
      len(jax.devices())))
  assert float(f(jnp.ones(8))) == 8.0
