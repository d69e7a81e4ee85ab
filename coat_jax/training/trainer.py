"""The training loop: sharded jit steps, evaluation, checkpoints, faults."""

import dataclasses
import json
import math
import os
import signal
import sys
import threading
import time
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm

from coat_jax import optim
from coat_jax.models import decoder
from coat_jax.models import hf
from coat_jax.models import remat as remat_lib
from coat_jax.models import vit
from coat_jax.training import checkpoints as checkpoints_lib
from coat_jax.training import compilation_cache
from coat_jax.training import config as config_lib
from coat_jax.training import data as data_lib
from coat_jax.training import in_backward
from coat_jax.training import memory
from coat_jax.training import metrics as metrics_lib
from coat_jax.training import sharding
from coat_jax.training import tasks
from coat_jax.training.checkpoints import Checkpointer
import pallas_kernels


class NonFiniteError(RuntimeError):
  """Raised with train.on_nonfinite='stop' when a step's loss or grads are not
  finite; the state was left as it was before that step."""


def _adamw_args(config: config_lib.Config) -> dict:
  """AdamW on a warmup-cosine schedule; weight decay on matrices only."""
  o, t = config.optim, config.train
  warmup = min(o.warmup_steps, t.steps - 1)
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, o.learning_rate, warmup, max(t.steps, warmup + 1),
      end_value=o.learning_rate * o.end_learning_rate_ratio)
  return dict(learning_rate=schedule, b1=o.b1, b2=o.b2, eps=o.eps,
              weight_decay=o.weight_decay,
              mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params))


def make_optimizer(config: config_lib.Config) -> optax.GradientTransformation:
  """Global-norm clipping, then AdamW (COAT FP8 or optax); with
  optim.apply_in_backward, the in-backward step's clipping instead
  (`in_backward.clipping`), whose state that step keeps."""
  o = config.optim
  if o.name == 'coat_adamw':
    adamw = optim.coat_adamw(
        **_adamw_args(config), group_size=o.group_size,
        moment_dtypes=tuple(o.moment_dtypes), expansion=o.expansion)
  else:
    adamw = optax.adamw(**_adamw_args(config))
  clip = (in_backward.clipping(o.in_backward_clip, o.clip_norm)
          if o.apply_in_backward else optax.clip_by_global_norm(o.clip_norm))
  return optax.chain(clip, adamw)


def _fused_update(config: config_lib.Config, specs: Any = None):
  """(grads, grad_norm, opt_state, params, apply_if) -> (params, opt_state)
  through `fused_coat_adamw`, on the state of `make_optimizer(config)`;
  apply_if False leaves params and state as they are. `specs`: the params'
  PartitionSpecs on the step's mesh (several GPUs then step each device's
  shards with the Pallas kernel).

  The global-norm clipping of `make_optimizer` is folded into the kernel as
  a gradient scale (optax's clip writes a scaled copy of every gradient,
  docs/decisions.md#comment-figures). It scales
  by max_norm / norm where optax divides by the norm and multiplies by
  max_norm: the same up to rounding.
  """
  o = config.optim
  apply = optim.fused_coat_adamw(**_adamw_args(config),
                                 group_size=o.group_size,
                                 expansion=o.expansion)

  def update(grads, grad_norm, opt_state, params, apply_if):
    clip_state, adamw_state = opt_state  # optax's clip keeps no state
    scale = optim.clip_scale(grad_norm, o.clip_norm)
    params, adamw_state = apply(grads, adamw_state, params, apply_if, scale,
                                specs)
    return params, (clip_state, adamw_state)

  return update


@dataclasses.dataclass
class Setup:
  """Everything a run needs that is not the mutable train state."""

  config: config_lib.Config
  task: tasks.Task
  mesh: jax.sharding.Mesh
  architecture: decoder.DecoderConfig  # the task's decoder
  graphdef: Any
  tx: optax.GradientTransformation
  state_shardings: Any
  abstract_state: Any
  init_state: Any  # () -> state, placed with the state shardings.
  # (state, *batch) -> (state, metrics). On several devices its
  # jit carries XLA compiler options (`collective_options`): call it at top
  # level (jax refuses them inside another jit or trace).
  train_step: Any
  eval_step: Any
  # train_step's `.lower` (for ahead-of-time compiles; kept apart so that
  # wrapping train_step leaves it usable).
  lower_train_step: Any = None


# XLA_FLAGS under which jax 0.11.2 fails to run a GPU program that holds
# cuDNN flash attention's backward more than once (IndexError: absl ...
# raw_hash_map<>::at, at the first step): unrolled layers do, a layer scan
# holds one.
_DETERMINISTIC_FLAGS = ('--xla_gpu_deterministic_ops',
                        '--xla_gpu_exclude_nondeterministic_ops')


def check_deterministic_layers(model: decoder.DecoderConfig,
                               platform: str, vision_layers: int = 0
                               ) -> None:
  """Raises ValueError naming the fix where XLA_FLAGS asks for XLA's
  deterministic GPU ops and the step would run unrolled layers there
  (vision_layers: a VLM's ViT layers, always unrolled)."""
  flags = [f for f in os.environ.get('XLA_FLAGS', '').split()
           if f.split('=')[0] in _DETERMINISTIC_FLAGS
           and f.split('=', 1)[-1].lower() not in ('false', '0')]
  if flags and platform == 'gpu' and vision_layers > 1:
    raise ValueError(
        f'XLA_FLAGS has {flags[0]}, under which jax 0.11.2 fails at the'
        ' first step with unrolled layers (cuDNN flash attention\'s backward'
        ' more than once in one program), and a VLM\'s ViT layers are'
        ' unrolled: drop the flag.')
  if flags and platform == 'gpu' and model.num_layers > 1 and not (
      model.scan_layers):
    raise ValueError(
        f'XLA_FLAGS has {flags[0]}, under which jax 0.11.2 fails at the'
        ' first step with unrolled layers (cuDNN flash attention\'s backward'
        ' more than once in one program): set model.scan_layers=true (the'
        ' same model under a layer scan, which runs), or drop the flag.')


# XLA's GPU scheduler lets one async collective run at a time unless told
# otherwise; with four, the FSDP step's gradient reduce-scatters run under
# the next layers' GEMMs (docs/decisions.md#comment-figures). One device has
# no collectives to overlap.
COLLECTIVE_OVERLAP_FLAG = (
    'xla_gpu_experimental_parallel_collective_overlap_limit')
COLLECTIVE_OVERLAP_LIMIT = 4


def collective_options(num_devices: int, xla_flags: str = '') -> dict:
  """XLA compiler options for a train step over `num_devices`: the
  collective overlap limit on several devices, unless `xla_flags` (the
  XLA_FLAGS in effect) sets it; {} otherwise."""
  if num_devices == 1 or f'--{COLLECTIVE_OVERLAP_FLAG}' in xla_flags:
    return {}
  return {COLLECTIVE_OVERLAP_FLAG: COLLECTIVE_OVERLAP_LIMIT}


def model_factory(config: config_lib.Config
                  ) -> tuple[tasks.Task, Any]:
  """(the task, make_model) of config: make_model(seed) builds the model
  (random params from seed, an int or an int32 scalar array; train.seed by
  default), unplaced."""
  task = tasks.of_config(config)
  recipe = config_lib.recipe(config.model)

  def make_model(seed=None):
    seed = config.train.seed if seed is None else seed
    # Placement comes from this module's fitted rules, not from eager
    # sharding by the logical names.
    with nnx.use_eager_sharding(False):
      return task.make_model(recipe, nnx.Rngs(jax.random.key(seed)))
  return task, make_model


def _state_shardings(config, mesh, abstract_model, abstract_state):
  """The train state's NamedShardings: params by their logical axis names
  (`sharding.param_specs`), each optimizer state leaf like its param."""
  names = {path: v.get_metadata().get('out_sharding') for path, v in
           nnx.to_flat_state(nnx.state(abstract_model, nnx.Param))}
  group = (config.optim.group_size if config.optim.name == 'coat_adamw'
           else None)
  axis_names = jax.tree_util.tree_map_with_path(
      lambda path, _: names[tuple(_key(k) for k in path)],
      abstract_state['params'])
  p_specs = sharding.param_specs(abstract_state['params'], axis_names, mesh,
                                 group)
  specs = {'params': p_specs,
           'opt_state': sharding.state_specs(abstract_state['opt_state'],
                                             p_specs),
           'step': jax.sharding.PartitionSpec(),
           'nonfinite': jax.sharding.PartitionSpec()}
  shardings = sharding.named(mesh, specs, abstract_state)
  if config.train.offload == 'optimizer':
    shardings['opt_state'] = jax.tree.map(
        lambda s: s.with_memory_kind('pinned_host'), shardings['opt_state'])
  return shardings


def _on_device(shardings: Any) -> Any:
  """`shardings` with every memory kind the device's."""
  return jax.tree.map(lambda s: s.with_memory_kind('device'), shardings)


def _loss_and_grads(task: tasks.Task, graphdef, per_layer: bool):
  """(params, *batch) -> (loss, grads) of `task.loss`.

  per_layer (unrolled layers, fused optimizer): the decoder layers' params
  enter the loss as num_layers per-layer trees, so each stacked leaf's
  gradient is a tuple of num_layers per-layer gradients, which XLA would
  otherwise stack (a copy of every float32 gradient, fused with the norm);
  where the fused optimizer's Pallas kernel runs, each layer then steps in
  place (RESULTS.md "e2e-1b").
  """
  def loss_fn(params, *batch):
    return task.loss(nnx.merge(graphdef, params), *batch)

  if not per_layer:
    return jax.value_and_grad(loss_fn)

  def loss_and_grads(params, *batch):
    stacked = task.layers_of(params)
    rest = task.with_layers(params, None)
    layers = [jax.tree.map(lambda a, i=i: a[i], stacked)
              for i in range(task.decoder.num_layers)]

    def loss_of(rest, layers):
      model = nnx.merge(graphdef, task.with_layers(rest, stacked))
      return task.loss(model, *batch, layers=layers)

    loss, (grads, layer_grads) = jax.value_and_grad(
        loss_of, argnums=(0, 1))(rest, layers)
    grads = task.with_layers(grads,
                             jax.tree.map(lambda *g: g, *layer_grads))
    return loss, grads

  return loss_and_grads


def _accumulated(loss_and_grads, n: int, micro_sharding):
  """loss_and_grads over `n` microbatches of the batch: their mean."""
  if n == 1:
    return loss_and_grads

  def mean_over_microbatches(params, *batch):
    split = lambda x: jax.lax.with_sharding_constraint(
        x.reshape((n, x.shape[0] // n) + x.shape[1:]), micro_sharding)
    batches = tuple(split(x) for x in batch)

    def accumulate(carry, batch):
      return jax.tree.map(jnp.add, carry,
                          loss_and_grads(params, *batch)), None

    zero = jax.tree.map(
        lambda a: jnp.zeros(a.shape, a.dtype),
        jax.eval_shape(loss_and_grads, params,
                       *jax.tree.map(lambda x: x[0], batches)))
    total, _ = jax.lax.scan(accumulate, zero, batches)
    return jax.tree.map(lambda x: x / n, total)

  return mean_over_microbatches


def _train_step(loss_and_grads, tx, fused_update, opt_shardings=None):
  """(state, *batch) -> (state, metrics): one optimizer step; a step whose
  loss or gradient norm is not finite changes nothing but the step and the
  fault count. opt_shardings (train.offload='optimizer'): the optimizer
  state's host shardings; it comes to the device after backward, for the
  optimizer's step only, and goes back."""
  def train_step(state, *batch):
    params = state['params']
    loss, grads = loss_and_grads(params, *batch)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    old_opt_state = state['opt_state']
    if opt_shardings is not None:
      # Its users wait for every gradient: the step reads the state after
      # backward (where XLA starts the transfer is XLA's schedule).
      grads, old_opt_state = jax.lax.optimization_barrier(
          (grads, jax.device_put(old_opt_state, _on_device(opt_shardings))))
    if fused_update is None:
      updates, opt_state = tx.update(grads, old_opt_state, params)
      new_params, opt_state = jax.tree.map(
          lambda a, b: jnp.where(finite, a, b),
          (optax.apply_updates(params, updates), opt_state),
          (params, old_opt_state))
    else:  # Skipped inside, so that the kernel updates in place.
      new_params, opt_state = fused_update(
          grads, grad_norm, old_opt_state, params, finite)
    if opt_shardings is not None:
      opt_state = jax.device_put(opt_state, opt_shardings)
    new_state = {
        'params': new_params,
        'opt_state': opt_state,
        'step': state['step'] + 1,
        'nonfinite': state['nonfinite'] + (~finite).astype(jnp.int32),
    }
    return new_state, {'loss': loss, 'grad_norm': grad_norm,
                       'finite': finite}
  return train_step


def _step_function(config: config_lib.Config, task: tasks.Task, graphdef,
                   tx: optax.GradientTransformation, state_shardings: Any,
                   mesh: jax.sharding.Mesh):
  """(state, *batch) -> (state, metrics), to be jitted: the in-backward
  step with optim.apply_in_backward, else `_train_step` (the fused
  optimizer's where it runs, with per-layer gradients under unrolled
  layers)."""
  o = config.optim
  if o.apply_in_backward:
    return in_backward.make_train_step(
        task, graphdef, **_adamw_args(config), group_size=o.group_size,
        expansion=o.expansion, clip=o.in_backward_clip,
        clip_norm=o.clip_norm, offload=config.train.offload == 'optimizer')
  uses_fused = config_lib.uses_fused_optimizer(o)
  # The params' specs as placed (`sharding.named` fits each to its leaf's
  # shape), which the optimizer's per-shard kernels must match.
  fused_update = (_fused_update(config, jax.tree.map(
      lambda s: s.spec, state_shardings['params'])) if uses_fused else None)
  micro_sharding = jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec(None, sharding.BATCH_AXES, None))
  loss_and_grads = _accumulated(
      _loss_and_grads(task, graphdef,
                      per_layer=uses_fused and not task.decoder.scan_layers),
      config.train.microbatches, micro_sharding)
  offloaded = config.train.offload == 'optimizer'
  return _train_step(loss_and_grads, tx, fused_update,
                     state_shardings['opt_state'] if offloaded else None)


def build(config: config_lib.Config, devices=None) -> Setup:
  """Builds the mesh, model, optimizer and jitted steps for `config`."""
  devices = jax.devices() if devices is None else devices
  config_lib.validate(config, len(devices))
  task, make_model = model_factory(config)
  arch = task.decoder
  recipe = config_lib.recipe(config.model)
  remat_lib.jax_policy(remat_lib.resolve(  # offloading needs a GPU
      arch.remat, recipe, arch.scan_layers))
  vision = config_lib.vlm_architecture(config.model)
  check_deterministic_layers(arch, devices[0].platform,
                             vision.vision.num_layers if vision else 0)
  mesh = sharding.make_mesh(
      config_lib.mesh_shape(config.mesh, len(devices)), devices)

  abstract_model = nnx.eval_shape(make_model)
  graphdef, _ = nnx.split(abstract_model)
  tx = make_optimizer(config)

  def model_params(seed=None):
    return nnx.to_pure_dict(nnx.state(make_model(seed), nnx.Param))

  def new_state(params):
    return {'params': params, 'opt_state': tx.init(params),
            'step': jnp.zeros((), jnp.int32),
            'nonfinite': jnp.zeros((), jnp.int32)}

  abstract_state = jax.eval_shape(lambda: new_state(model_params()))
  state_shardings = _state_shardings(config, mesh, abstract_model,
                                     abstract_state)

  vision_from = config.model.vision_init_from
  if vision_from is not None:
    check_vision_checkpoint(vision_from, config_lib.vlm_architecture(
        config.model).vision)

  def init_state():
    """A new run's state, placed: random params, or model.init_from's
    (model.vision_init_from's in a VLM's vision tower)."""
    # The seed enters each jit as an argument: with a constant key XLA may
    # fold the random params into constants while compiling, slow for a
    # model of many separately initialized weights (a ViT).
    seed = jax.device_put(np.int32(config.train.seed),
                          jax.sharding.NamedSharding(
                              mesh, jax.sharding.PartitionSpec()))
    if vision_from is not None:
      params = jax.jit(model_params,
                       out_shardings=state_shardings['params'])(seed)
      params['vision'] = jax.device_put(
          nnx.to_pure_dict(nnx.state(hf.load_siglip(vision_from),
                                     nnx.Param)),
          state_shardings['params']['vision'])
      return jax.jit(new_state, out_shardings=state_shardings,
                     donate_argnums=0)(params)
    if config.model.init_from is None:
      # Made under jit, each device its own shard (partitionable threefry:
      # the same values on any mesh). Made eagerly, the whole float32 params
      # would sit on one device first, so FSDP could not start a model
      # larger than one GPU.
      return jax.jit(lambda seed: new_state(model_params(seed)),
                     out_shardings=state_shardings)(seed)
    params = hf.load_hf_params(config.model.init_from,
                               abstract_state['params'],
                               state_shardings['params'],
                               norm_names=task.family.norm_names)
    return jax.jit(new_state, out_shardings=state_shardings,
                   donate_argnums=0)(params)

  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  batch_sharding = sharding.batch_sharding(mesh)
  batch_shardings = (batch_sharding,) * len(task.batch_shapes(1))

  def eval_step(params, *batch):
    return task.loss(nnx.merge(graphdef, params), *batch)

  train_step = jax.jit(
      _step_function(config, task, graphdef, tx, state_shardings, mesh),
      in_shardings=(state_shardings, *batch_shardings),
      out_shardings=(state_shardings, replicated), donate_argnums=0,
      compiler_options=collective_options(
          mesh.size, os.environ.get('XLA_FLAGS', '')))
  return Setup(
      config=config, task=task, mesh=mesh, architecture=arch,
      graphdef=graphdef, tx=tx,
      state_shardings=state_shardings, abstract_state=abstract_state,
      init_state=init_state,
      train_step=train_step,
      eval_step=jax.jit(
          eval_step, in_shardings=(state_shardings['params'],
                                   *batch_shardings),
          out_shardings=replicated),
      lower_train_step=train_step.lower,
  )


def check_vision_checkpoint(path: str, want: vit.ViTConfig) -> None:
  """Raises ValueError unless the SigLIP checkpoint at `path` has the
  architecture `want` (a VLM preset's ViT), naming the fields that differ."""
  got = hf.config_from_siglip(hf.read_hf_config(path))
  differ = [f'{f.name}: {getattr(got, f.name)!r} there,'
            f' {getattr(want, f.name)!r} here'
            for f in dataclasses.fields(want)
            if f.name != 'init_std'
            and getattr(got, f.name) != getattr(want, f.name)]
  if differ:
    raise ValueError(
        f'model.vision_init_from={path} is not the preset\'s vision tower ('
        + '; '.join(differ) + '): use a checkpoint of the preset\'s ViT, or'
        ' a preset whose ViT it is.')


def _key(k: Any) -> Any:
  return getattr(k, 'key', getattr(k, 'idx', getattr(k, 'name', k)))


def device_batch(batch: Any, sharding_: jax.sharding.Sharding):
  """A global array from an array (on the host or one device) that every
  process computes identically: each device receives only its slice.

  The slices are cut where the array is: under a caller's jax.set_mesh an
  eager slice of a device array is replicated on every device of the mesh,
  with the whole array copied there first (for FSDP's params: twice the
  float32 layer stack on every device).
  """
  def slice_of(idx):
    with jax.set_mesh(None):
      return batch[idx]
  return jax.make_array_from_callback(batch.shape, sharding_, slice_of)


def state_is_finite(state: Any) -> bool:
  return all(bool(jnp.all(jnp.isfinite(x)))
             for x in jax.tree.leaves(state['params']))


def _peak_memory() -> int | None:
  """The largest peak_bytes_in_use of this process's devices (None where the
  backend reports none, e.g. CPU)."""
  peaks = [(d.memory_stats() or {}).get('peak_bytes_in_use')
           for d in jax.local_devices()]
  peaks = [p for p in peaks if p is not None]
  return max(peaks) if peaks else None


def state_template(setup: Setup) -> Any:
  """The train state's abstract arrays, with `setup`'s shardings (what a
  checkpoint restores into)."""
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      setup.abstract_state, setup.state_shardings)


def restore_state(setup: Setup, checkpointer: Checkpointer, step: int):
  """The train state saved at `step`, placed with `setup`'s shardings."""
  return checkpointer.restore(step, state_template(setup))


def train(config: config_lib.Config, devices=None) -> dict:
  """Trains (or resumes) per `config`; returns the final summary.

  Writes `<run_dir>/config.json`, `<run_dir>/metrics.jsonl` (and TensorBoard
  scalars with train.tensorboard) and checkpoints under
  `<run_dir>/checkpoints` (every train.checkpoint_every steps and the last
  one). Ctrl-C or SIGTERM saves a checkpoint and returns with
  `summary['interrupted'] = True` and `summary['signal']` the signal's
  number. A run resumes from the newest checkpoint that restores
  (`summary['resumed_from']`; None: a new run), dropping metrics.jsonl's
  records of the steps it replays. A run whose checkpoint already reached
  train.steps trains nothing: `summary['complete']` is True and the losses
  and tokens/s are the last ones metrics.jsonl recorded. A run that trained
  ends with `summary['sample']` (`tasks.sample`: a greedy continuation of
  train.sample_prompt, or a VLM's answer to a held-out question).
  Evaluation adds `summary['val_accuracy']` for a VLM.
  `summary['compile_s']` is how long the step took to lower and compile
  (None if it did not); jax's persistent cache in
  train.compilation_cache_dir (`compilation_cache.use_compilation_cache`)
  shortens a rerun's.
  """
  # Mosaic GPU lowering asks ptxas for its version on every 8-bit cast
  # unless told once (`pallas_kernels.ask_ptxas_once`): the FP8 GEMMs'
  # lowering, in the ahead-of-time compile and the steps' first calls.
  with pallas_kernels.ask_ptxas_once():
    return _train(config, devices)


def _train(config: config_lib.Config, devices) -> dict:
  t = config.train
  lead = jax.process_index() == 0
  # One process writes the log; every process computes the same metrics.
  # Made first: a missing tensorboardX fails before any compilation.
  log = metrics_lib.MetricsLog(t.run_dir, write=lead,
                               tensorboard=t.tensorboard)
  cache = compilation_cache.use_compilation_cache(
      t.compilation_cache_dir, t.compilation_cache_max_gib)
  setup = build(config, devices)
  # The data is read and checked before the step compiles: its errors come
  # at once.
  data = tasks.load_data(config, setup.task)
  if lead and not t.save_checkpoints:
    print(_NO_CHECKPOINTS_WARNING, file=sys.stderr, flush=True)
  done = checkpoints_lib.latest_step_on_disk(t.run_dir)
  mem, compile_s, eval_step = None, None, setup.eval_step
  if done is None or done < t.steps:  # a finished run compiles nothing
    # Compiled ahead of time (the jitted step reuses this compilation): the
    # memory it needs is known before any allocation, and a run that cannot
    # fit stops here with its options.
    memory.check_state_fits(setup)
    start = time.perf_counter()
    compiled = memory.compile_train_step(setup)
    compile_s = time.perf_counter() - start
    mem = memory.breakdown(setup, compiled)
    if lead:
      print(f'train step lowered and compiled in {compile_s:.1f} s ('
            + (f'compilation cache: {cache}' if cache else
               'no compilation cache: set train.compilation_cache_dir')
            + ')', flush=True)
      print(mem.format(), flush=True)
    memory.check_fits(mem, config)
    # Before the state's allocation too, and evaluated with this executable.
    eval_step = memory.compile_eval_step(setup)
  os.makedirs(t.run_dir, exist_ok=True)
  if lead:
    with open(os.path.join(t.run_dir, 'config.json'), 'w') as f:
      json.dump(config_lib.to_dict(config), f, indent=2)
  learning_rate = _adamw_args(config)['learning_rate']
  checkpointer = Checkpointer(t.run_dir, config,
                              template=setup.abstract_state)
  with jax.set_mesh(setup.mesh):
    resumed_from, state = _start_state(setup, checkpointer, lead)
    log.drop_after(int(state['step']))
    batch_sharding = sharding.batch_sharding(setup.mesh)
    bs = t.batch_size
    tokens_per_step = bs * setup.task.tokens_per_example

    def batch(split, index):
      return tuple(device_batch(x, batch_sharding)
                   for x in data.batch(split, index, bs))

    def evaluate():
      losses = [eval_step(state['params'], *batch('val', i))
                for i in range(t.eval_batches)]
      model = nnx.merge(setup.graphdef, state['params'])
      return {'val_loss': float(np.mean(jax.device_get(losses))),
              **tasks.evaluate_more(setup.task, config, model)}

    step = start_step = int(state['step'])
    bar = tqdm.tqdm(total=t.steps, initial=step, disable=not (
        lead and t.progress_bar) or step >= t.steps, dynamic_ncols=True,
                    desc='train')
    summary = {'resumed_from': resumed_from, 'interrupted': False,
               'signal': None,
               'complete': step >= t.steps, 'train_steps': t.steps,
               'sample': None,
               'train_loss': math.nan, 'val_loss': math.nan,
               'tokens_per_s': math.nan}
    recent, tick, tick_step = [], time.perf_counter(), step
    stop = _StopSignals()
    # The host makes the next batches while the device runs the step.
    batches = data_lib.Prefetch(
        lambda i: data.batch('train', i, bs), step, t.steps)
    try:
      while step < t.steps and stop.signal is None:
        state, metrics = setup.train_step(
            state, *(device_batch(x, batch_sharding) for x in next(batches)))
        step += 1
        bar.update(1)
        if t.on_nonfinite == 'stop' and not bool(metrics['finite']):
          raise NonFiniteError(
              f'step {step}: loss or gradients are not finite; the step was'
              ' skipped and the state is the one before it'
              ' (train.on_nonfinite=stop).')
        if step % t.log_every == 0 or step == t.steps:
          metrics = jax.device_get(metrics)
          now = time.perf_counter()
          tok_s = (step - tick_step) * tokens_per_step / (now - tick)
          tick, tick_step = now, step
          recent.append(float(metrics['loss']))
          log.write(step, loss=float(metrics['loss']),
                    grad_norm=float(metrics['grad_norm']),
                    learning_rate=float(learning_rate(step - 1)),
                    tokens_per_s=tok_s,
                    nonfinite_steps=int(state['nonfinite']),
                    peak_memory_bytes=_peak_memory())
          bar.set_postfix(loss=f'{recent[-1]:.3f}', tok_s=f'{tok_s:,.0f}')
          summary['tokens_per_s'] = tok_s
        if step % t.eval_every == 0 or step == t.steps:
          evaluation = evaluate()
          summary.update(evaluation)
          log.write(step, **evaluation)
          bar.write(f'step {step}: ' + _evaluation_text(evaluation))
        if _save_due(t, step):
          seconds = _save(checkpointer, step, state)
          if checkpointer.blocking_saves:
            bar.write(f'step {step}: saved to {checkpointer.directory} in'
                      f' {seconds:.0f} s (a state larger than the host'
                      ' memory budget saves before the next step)')
      if stop.signal is not None:
        raise KeyboardInterrupt
      if step > start_step:
        summary['sample'] = tasks.sample(
            setup.task, config, nnx.merge(setup.graphdef, state['params']),
            data)
    except KeyboardInterrupt:  # stop.signal, or a second Ctrl-C
      summary.update(interrupted=True,
                     signal=int(stop.signal or signal.SIGINT))
      bar.write(_save_on_stop(checkpointer, state, summary['signal'], t))
    finally:
      batches.close()
      stop.restore()
      bar.close()
      log.close()
      checkpointer.close()
  summary.update(
      step=int(state['step']), nonfinite_steps=int(state['nonfinite']),
      train_loss=recent[-1] if recent else math.nan,
      peak_memory_bytes=_peak_memory(), run_dir=os.path.abspath(t.run_dir),
      memory=dataclasses.asdict(mem) if mem else None, compile_s=compile_s)
  if summary['complete']:
    summary.update(_last_recorded(t.run_dir))
  return summary


def _evaluation_text(evaluation: dict) -> str:
  """'validation loss 1.2345' (', answer accuracy 87.5%' for a VLM)."""
  text = f"validation loss {evaluation['val_loss']:.4f}"
  if 'val_accuracy' in evaluation:
    text += f", answer accuracy {evaluation['val_accuracy']:.1%}"
  return text


def _last_recorded(run_dir: str) -> dict:
  """The summary's metrics from what metrics.jsonl last recorded (a
  finished run trains nothing, so it measures nothing new)."""
  try:
    last = metrics_lib.latest(metrics_lib.read_metrics(run_dir))
  except FileNotFoundError:
    last = {}
  out = {'last_recorded': last}
  for key, summary_key in (('loss', 'train_loss'), ('val_loss', 'val_loss'),
                           ('val_accuracy', 'val_accuracy'),
                           ('tokens_per_s', 'tokens_per_s')):
    if key in last:
      out[summary_key] = last[key][1]
  return out


def _start_state(setup: Setup, checkpointer: Checkpointer,
                 lead: bool) -> tuple[int | None, Any]:
  """(resumed_from, state): the newest checkpoint that restores (damaged
  ones reported and set aside, `Checkpointer.restore_newest`), else a new
  run's state (resumed_from None)."""
  def say(text):
    if lead:
      print(text, flush=True)

  start = time.perf_counter()
  step, state = checkpointer.restore_newest(state_template(setup),
                                            report=say)
  if step is None:
    return None, setup.init_state()
  say(f'resuming from step {step} ({checkpointer.directory}/{step},'
      f' restored in {time.perf_counter() - start:.1f} s)')
  return step, state


_NO_CHECKPOINTS_WARNING = (
    'warning: train.save_checkpoints=false: this run saves no checkpoint,'
    ' not even its final state or on Ctrl-C or SIGTERM; a rerun starts from'
    ' step 0, and generate and export have nothing to read.')


def _save_due(t: config_lib.TrainConfig, step: int) -> bool:
  """Whether the loop saves after `step`: every train.checkpoint_every
  steps (0: no periodic saves) and at the last step, unless
  train.save_checkpoints is false."""
  periodic = t.checkpoint_every > 0 and step % t.checkpoint_every == 0
  return t.save_checkpoints and (periodic or step == t.steps)


class _StopSignals:
  """Turns Ctrl-C (SIGINT) and SIGTERM (how schedulers preempt a job) into
  a flag the loop checks between steps: `signal`, the first one's number.

  A KeyboardInterrupt in the middle of a step could land after the state's
  buffers were donated to it, leaving nothing to save; the flag stops the
  loop at a step boundary instead. A second Ctrl-C interrupts at once; a
  repeated SIGTERM changes nothing (schedulers and process-group kills may
  send it more than once; SIGKILL ends a run that overstays).
  """

  def __init__(self):
    self.signal = None
    self._previous = {}
    if threading.current_thread() is threading.main_thread():
      for signum in (signal.SIGINT, signal.SIGTERM):
        self._previous[signum] = signal.signal(signum, self._handle)

  def _handle(self, signum, frame):
    if self.signal is None:
      self.signal = signum
    elif signum == signal.SIGINT:
      signal.default_int_handler(signum, frame)

  def restore(self):
    for signum, previous in self._previous.items():
      signal.signal(signum, previous)


def _save_on_stop(checkpointer: Checkpointer, state: Any, signum: int,
                  t: config_lib.TrainConfig) -> str:
  """Saves the state of a run stopped by `signum` (unless
  train.save_checkpoints is false) and waits; returns what to tell."""
  step = int(state['step'])
  what = ('interrupted' if signum == signal.SIGINT else
          f'stopped by {signal.Signals(signum).name}')
  if not t.save_checkpoints:
    return (f'{what} at step {step}: nothing saved'
            ' (train.save_checkpoints=false).')
  _save(checkpointer, step, state, wait=True)
  return (f'{what}: saved step {step} to {checkpointer.directory}; run the'
          ' same command to resume.')


def _save(checkpointer: Checkpointer, step: int, state: Any, *,
          wait: bool = False) -> float:
  """Saves `state` as `step`; returns the seconds the loop waited."""
  if not state_is_finite(state):  # Never persist a poisoned state.
    raise NonFiniteError(f'step {step}: params are not finite; not saving.')
  start = time.perf_counter()
  checkpointer.save(step, state, wait=wait)
  return time.perf_counter() - start
