"""How a run's device memory divides, from the compiled train step.

`compile_train_step` compiles a train step ahead of time from abstract state
(no param is initialized) and `breakdown` reads XLA's buffer assignment
(`compiled.memory_analysis()`); `coat_jax.training.planning` estimates a
config and searches the largest batch that fits with them. All sizes are
bytes per device.
"""

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from coat_jax import recipes
from coat_jax.models import remat as remat_lib
from coat_jax.training import config as config_lib
from coat_jax.training import sharding

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class MemoryBreakdown:
  """Bytes per device of one train step.

  params, optimizer_state: the train state (inputs of the step, updated in
  place). gradients: one float copy of the params (with
  optim.apply_in_backward, of the params outside the decoder layers, whose
  gradients die as each layer steps), a part of the step's temporaries.
  activations: the rest of the temporaries (saved activations, backward's
  working set, XLA's scratch). total: XLA's peak for the step.
  limit: what XLA may allocate on the device (None where unknown, as on
  CPU without --memory-limit-gib). host: train state kept in pinned host
  memory (train.offload), counted in none of the above, which are device
  bytes (the optimizer state's copy on the device during its step is in
  activations). layers: how the decoder layers run
  (e.g. "unrolled, remat 'none'"; 'auto' resolved), printed with the
  activations; '' where unknown. platform, device: the jax platform
  ('cpu', 'gpu', 'tpu') and the device kind (e.g. 'NVIDIA H200') the step
  was compiled for: the plan is that compiler's, and XLA:CPU's is no
  estimate of a GPU's; '' where unknown.
  """

  params: int
  optimizer_state: int
  gradients: int
  activations: int
  total: int
  limit: int | None
  layers: str = ''
  platform: str = ''
  device: str = ''
  host: int = 0

  @property
  def fits(self) -> bool:
    return self.limit is None or self.total <= self.limit

  def format(self) -> str:
    """A few lines: each part in GiB, the total against the limit."""
    rows = [('params', self.params),
            ('optimizer state', self.optimizer_state),
            ('gradients', self.gradients),
            ('activations and temporaries', self.activations)]
    lines = ['memory per device (compiled train step'
             + (f' for {self.device}' if self.device else '') + '):']
    if self.platform == 'cpu':
      lines.append(
          "  (XLA:CPU's plan, not a GPU's: a GPU compiles the step with"
          ' other fusions and kernels into a different, usually much'
          ' smaller, peak; for a GPU\'s figure compile on that GPU, e.g.'
          ' python train.py --estimate there)')
    lines += [f'  {name:<28} {format_size(size)}' for name, size in rows]
    if self.layers:
      lines[-1] += f'  ({self.layers})'
    limit = ('(no device limit known)' if self.limit is None
             else f'of {format_size(self.limit).strip()} the device allows'
             f' ({self.total / self.limit:.0%})')
    lines.append(f'  {"total":<28} {format_size(self.total)} {limit}')
    if self.host:
      lines.append(f'  {"in pinned host memory":<28}'
                   f' {format_size(self.host)}  (train.offload)')
    return '\n'.join(lines)


def format_size(n: int) -> str:
  """n bytes in GiB, or in MiB below a tenth of a GiB, 9 characters wide."""
  return (f'{n / GIB:9.2f} GiB' if n >= GIB // 10
          else f'{n / 2**20:9.2f} MiB')


def device_limit() -> int | None:
  """Bytes XLA may allocate on the first local device (None if unknown)."""
  stats = jax.local_devices()[0].memory_stats() or {}
  return stats.get('bytes_limit')


def _per_device_bytes(abstract, shardings, memory_kind: str = 'device'
                      ) -> int:
  """Bytes per device of the leaves placed in `memory_kind` ('device'
  counts those without a memory kind too)."""
  def leaf_bytes(x, s):
    kind = s.memory_kind or 'device'
    if kind != memory_kind:
      return 0
    return math.prod(s.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
  return sum(jax.tree.leaves(jax.tree.map(leaf_bytes, abstract, shardings)))


def compile_train_step(setup: Any, compiler_options: dict | None = None):
  """The train step of `setup` (a `trainer.Setup`) compiled for abstract
  state and batches: nothing is initialized or transferred.
  compiler_options: XLA's, as `jax.stages.Lowered.compile` takes them."""
  state = _placed(setup.abstract_state, setup.state_shardings)
  with jax.set_mesh(setup.mesh):
    return setup.lower_train_step(state, *_abstract_batch(setup)).compile(
        compiler_options)


def compile_eval_step(setup: Any):
  """The eval step of `setup` compiled for abstract params and batches, as
  `compile_train_step`. Compiled before the state is allocated, XLA's
  autotuner still has the device's memory (it allocates each fusion's
  operands: a whole layer stack for a fused slice)."""
  params = _placed(setup.abstract_state['params'],
                   setup.state_shardings['params'])
  with jax.set_mesh(setup.mesh):
    return setup.eval_step.lower(params, *_abstract_batch(setup)).compile()


def _placed(abstract: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs of `abstract`'s leaves with `shardings`."""
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      abstract, shardings)


def _abstract_batch(setup: Any) -> list[jax.ShapeDtypeStruct]:
  """A train batch of `setup`'s task as batch-sharded ShapeDtypeStructs."""
  batch_sharding = sharding.batch_sharding(setup.mesh)
  return [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=batch_sharding)
          for x in setup.task.batch_shapes(setup.config.train.batch_size)]


def state_bytes(setup: Any) -> tuple[int, int, int]:
  """(params, optimizer state, gradients): bytes per device of `setup`'s
  train state in device memory (train.offload's host-resident state is
  not counted: `host_bytes`) and of the gradients its step holds at once
  (all params'; with optim.apply_in_backward, those outside the decoder
  layers), read from the abstract state: nothing is compiled."""
  abstract, shardings = setup.abstract_state, setup.state_shardings
  params = _per_device_bytes(abstract['params'], shardings['params'])
  opt = _per_device_bytes(abstract['opt_state'], shardings['opt_state'])
  grads = params
  if setup.config.optim.apply_in_backward:
    grads = params - _layer_bytes(setup)
  return params, opt, grads


def host_bytes(setup: Any) -> int:
  """Bytes per device of the train state kept in pinned host memory
  (train.offload)."""
  return _per_device_bytes(setup.abstract_state, setup.state_shardings,
                           'pinned_host')


def _layer_bytes(setup: Any) -> int:
  """Bytes per device of the decoder layers' params."""
  layers = setup.task.layers_of
  return _per_device_bytes(layers(setup.abstract_state['params']),
                           layers(setup.state_shardings['params']))


def _gib(n: int) -> str:
  return f'{n / GIB:.2f} GiB'


def _in_backward_option(freed: int, up_to: bool = False) -> str:
  """The in-backward step as a way to fit, freeing `freed` bytes."""
  return ('optim.apply_in_backward=true (each decoder layer steps inside'
          ' backward, so its gradients are never all live: '
          + ('up to ' if up_to else '') + f'{_gib(freed)} less; it needs one'
          ' device, FP8 moments and unrolled layers, docs/in_backward.md)')


def _offload_option(optimizer_state: int) -> str:
  """Optimizer offload as a way to fit."""
  return ("train.offload='optimizer' (the optimizer state in pinned host"
          ' memory, on the device only for its step, or with the in-backward'
          ' step a layer\'s for that layer\'s: up to'
          f' {_gib(optimizer_state)} less)')


def check_state_fits(setup: Any, limit: int | None = None) -> None:
  """Before anything compiles: raises ValueError, naming the settings that
  would make room, if the params, optimizer state and gradients alone
  exceed `limit` (bytes per device; None reads the device's, and a device
  that reports none, as a CPU, is not checked). Activations come on top."""
  limit = device_limit() if limit is None else limit
  params, opt, grads = state_bytes(setup)
  need = params + opt + grads
  if limit is None or need <= limit:
    return
  config = setup.config
  options = []
  if not config_lib.can_fuse(config.optim):
    options.append('FP8 moments (optim.name=coat_adamw with FP8'
                   ' optim.moment_dtypes: 2.125 bytes a param, not 8)')
  if not config.optim.apply_in_backward and setup.mesh.size == 1:
    options.append(_in_backward_option(_layer_bytes(setup)))
  if opt:  # on the device
    options.append(_offload_option(opt))
  options.append('mesh.fsdp=N over N devices (params, optimizer state and'
                 ' gradients shard N ways)')
  options.append('a smaller model (model.num_layers, model.hidden_size)')
  raise ValueError(
      f'this run\'s state alone needs {_gib(need)} per device (params'
      f' {_gib(params)}, optimizer state {_gib(opt)}, gradients'
      f' {_gib(grads)}), before any activation, and the device allows'
      f' {_gib(limit)}. To make room: ' + '; '.join(options) + '.')


def breakdown(setup: Any, compiled,
              limit: int | None = None) -> MemoryBreakdown:
  """The MemoryBreakdown of `compiled` (from `compile_train_step(setup)`).

  limit: bytes the device allows; None reads the device's `bytes_limit`.
  """
  device = setup.mesh.devices.flat[0]
  params, opt, grads = state_bytes(setup)
  stats = compiled.memory_analysis()
  temp = stats.temp_size_in_bytes
  # XLA allocates the temporaries as one block next to the (donated, so
  # aliased) arguments and the outputs. Those sizes are the device's; XLA's
  # peak also counts buffers in pinned host memory (train.offload), so it
  # bounds the device's only where there are none.
  on_host = sum(getattr(stats, f'host_{kind}_size_in_bytes', 0)
                for kind in ('argument', 'output', 'temp'))
  total = max(stats.argument_size_in_bytes + stats.output_size_in_bytes
              - stats.alias_size_in_bytes + temp,
              0 if on_host else getattr(stats, 'peak_memory_in_bytes', 0))
  return MemoryBreakdown(
      host=host_bytes(setup),
      params=params, optimizer_state=opt, gradients=min(grads, temp),
      activations=max(temp - grads, 0), total=total,
      limit=device_limit() if limit is None else limit,
      layers=_layers(setup.config.model), platform=device.platform,
      device=device.device_kind)


def _layers(model: Any) -> str:
  """"unrolled, remat 'none'" (or "scanned, remat 'full' (auto)"): the
  layout and the remat policy the decoder layers run (model: a
  ModelConfig)."""
  arch = config_lib.architecture(model)
  policy = remat_lib.resolve(arch.remat, config_lib.recipe(model),
                             arch.scan_layers)
  auto = ' (auto)' if arch.remat == remat_lib.AUTO else ''
  layout = 'scanned' if arch.scan_layers else 'unrolled'
  return f'{layout}, remat {policy!r}{auto}'


def check_fits(mem: MemoryBreakdown, config: config_lib.Config) -> None:
  """Raises ValueError if `mem` won't fit, naming the settings of `config`
  that would keep less on the device (only those not set already)."""
  if mem.fits:
    return
  arch = config_lib.architecture(config.model)
  recipe = config_lib.recipe(config.model)
  policy = remat_lib.resolve(arch.remat, recipe, arch.scan_layers)
  in_backward = config.optim.apply_in_backward
  options = ['a smaller train.batch_size (or more train.microbatches)']
  # POLICIES runs from the one that keeps most to the one that keeps least.
  keep_less = list(remat_lib.POLICIES[remat_lib.POLICIES.index(policy) + 1:])
  if keep_less:
    options.append(f'a remat policy that keeps less (model.remat one of'
                   f' {keep_less}; \'full\' keeps least)')
  if not arch.scan_layers and not in_backward:
    options.append('model.scan_layers=true (with remat, less still)')
  if not in_backward:
    options.append(_in_backward_option(mem.gradients, up_to=True))
  if config.train.offload == 'none' and mem.optimizer_state:
    options.append(_offload_option(mem.optimizer_state))
  options += ['more devices, or mesh.fsdp > 1 to shard params and optimizer'
              ' state', 'a larger XLA_PYTHON_CLIENT_MEM_FRACTION']
  raise ValueError(
      f'this run needs {_gib(mem.total)} per device but the device allows'
      f' {_gib(mem.limit)} (train.batch_size={config.train.batch_size},'
      f' model.remat={arch.remat!r}, model.recipe='
      f'{recipes.name_of(recipe) or recipe}). Options: '
      + '; '.join(options) + '. `python train.py --find-max-batch ...` finds'
      ' the largest batch per layer layout and policy.')


