"""Periodic, async orbax checkpoints of the train state, checked on restore.

Each step directory holds the state and the config that wrote it. Orbax
commits a step by renaming a finished temporary directory, so a save killed
half way leaves the previous step loadable. Restoring compares the saved
config (model, optimizer layout, seed) and every leaf's shape and dtype with
what this run expects before reading anything, since orbax would cast. A step
whose files are missing or unreadable raises `DamagedCheckpointError` naming
the step and the file; `Checkpointer.restore_newest` then moves it aside and
resumes from the newest step that restores.
"""

from collections.abc import Callable
from concurrent import futures
import copy
import ctypes
import dataclasses
import gc
import os
from typing import Any

import jax
import orbax.checkpoint as ocp
# Orbax's transfer priorities and dispatchers: not exported; the one way to
# have it copy a save off the device and write it part by part
# (`_streaming_arrays`).
from orbax.checkpoint._src.multihost import dispatchers
from orbax.checkpoint._src.serialization import types as ocp_types

from coat_jax.checkpoint import DamagedCheckpointError
from coat_jax.checkpoint import check_matches
from coat_jax.checkpoint import reading
from coat_jax.training.config import Config
from coat_jax.training.config import ModelConfig

# Optimizer fields that decide the layout of the state.
_OPTIM_LAYOUT = ('name', 'group_size', 'moment_dtypes', 'expansion')
# Model fields that change how a step runs, not what the state holds (a
# resumed run may change them; model.init_from only seeds a new run). The
# recipe, and its older names, are among them: every recipe trains the
# same params and optimizer state.
_MODEL_RUNTIME = ('recipe', 'precision', 'fp8_weight_gather', 'fuse_qkv',
                  'remat', 'scaling', 'scan_layers', 'init_from')
_MODEL_DEFAULTS = dataclasses.asdict(ModelConfig())
# Orbax's own cap on the bytes (GB) a save or restore holds in host memory
# at once.
_ORBAX_CONCURRENT_GB = 96
# XLA's pinned host memory pool on GPUs (GB), into which orbax copies a whole
# save at once: XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB, 64 unless set.
_PINNED_HOST_LIMIT_VAR = 'XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB'
_PINNED_HOST_DEFAULT_GB = 64
# glibc, whose `malloc_trim` hands freed heap memory back to the system;
# None elsewhere.
try:
  _LIBC = ctypes.CDLL('libc.so.6')
  _LIBC.malloc_trim  # noqa: B018
except (OSError, AttributeError):
  _LIBC = None


def _nbytes(template: Any) -> list[int]:
  return [leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(template)]


def _pinned_pool_gb() -> float:
  return float(os.environ.get(_PINNED_HOST_LIMIT_VAR,
                              _PINNED_HOST_DEFAULT_GB))


def _free_host_gb() -> float | None:
  try:
    return os.sysconf('SC_AVPHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 1e9
  except (ValueError, OSError, AttributeError):
    return None


def _host_share_gb(template: Any, cap_gb: float, free_share: float) -> float:
  """min(cap_gb, free_share of the host's free memory), above `template`'s
  largest leaf."""
  gb = cap_gb
  free = _free_host_gb()
  if free is not None:
    gb = min(gb, free * free_share)
  # Orbax refuses a leaf as large as its budget.
  return max([gb] + [n * 1.01 / 1e9 for n in _nbytes(template)])


def host_transfer_gb(template: Any) -> float:
  """The bytes (GB) a save may hold in host memory while writing, or a
  restore while reading, `template`'s leaves: an eighth of the memory this
  host has free (a save's buffers, its compression's and, on a RAM disk,
  the checkpoint itself share the rest), a quarter of XLA's pinned host
  pool, at most orbax's default, and above the largest leaf. A state
  larger than this streams (`streams_to_host`)."""
  return _host_share_gb(
      template, min(_ORBAX_CONCURRENT_GB, _pinned_pool_gb() / 4), 1 / 8)


def stream_part_gb(template: Any, budget_gb: float | None = None) -> float:
  """The bytes (GB) of each part a streaming save copies off the device
  and writes before the next, and a streaming restore reads at once: a
  sixty-fourth of the host's free memory, at most `budget_gb` (default
  `host_transfer_gb`), above the largest leaf. A part's host copy, its
  compression's buffers and tensorstore's take a few parts of memory,
  beside what a checkpoint on a RAM disk takes."""
  if budget_gb is None:
    budget_gb = host_transfer_gb(template)
  return _host_share_gb(template, budget_gb, 1 / 64)


def fits_pinned_host(gb: float) -> bool:
  """Whether `gb` (GB) copied off a GPU at once takes at most half of XLA's
  pinned host pool (host offload shares the pool). Orbax copies a save
  into that pool: a whole 13B state (80 GB) overflows the default 64 GB and
  the save fails."""
  return gb <= _pinned_pool_gb() / 2


def streams_to_host(template: Any, budget_gb: float | None = None) -> bool:
  """Whether a save of `template`'s state moves it off the device in parts
  (`stream_part_gb`), each written before the next is copied, instead of
  all at once: a state larger than `budget_gb` (default
  `host_transfer_gb`), such as a 13B state (80 GB) beside a checkpoint on
  a RAM disk. Such a save blocks the train loop until it is written, since
  the step donates the state."""
  if budget_gb is None:
    budget_gb = host_transfer_gb(template)
  return sum(_nbytes(template)) / 1e9 > budget_gb


class _Deprioritized(ocp_types.DefaultSerializationStatusCallback):
  """Every array's device-to-host copy deprioritized: orbax then copies them
  `save_device_host_concurrent_gb` at a time, each batch written before the
  next (by default every copy is synchronous, the whole state at once)."""

  def key_priority(self, keypath: Any) -> ocp_types.TransferPriority:
    del keypath
    return ocp_types.TransferPriority.ASYNCHRONOUS_DEPRIORITIZED


def _alias(x: jax.Array) -> jax.Array:
  """A new jax.Array object, and new shard objects, over `x`'s device
  buffers (no copy)."""
  return jax.make_array_from_single_device_arrays(
      x.shape, x.sharding, [s.data for s in x.addressable_shards])


def _return_freed_host_memory() -> None:
  """Frees a written part's host copies and hands the freed memory back to
  the system. A jax array's host copy sits in a reference cycle, which only
  Python's cyclic collector frees; a part's writes free their buffers in
  the arenas of tensorstore's many threads, where glibc keeps them
  (`malloc_trim` returns them; elsewhere nothing). Part after part, a
  save's process would otherwise grow toward the whole state."""
  gc.collect()
  if _LIBC is not None:
    _LIBC.malloc_trim(0)


class _PartWriter(dispatchers.Dispatcher):
  """Runs orbax's writer of each part of a streaming save in this process,
  on new array objects over the part's device buffers (`_alias`).

  jax keeps the host copy of an array on the object it copied (`np.asarray`
  caches it), and orbax copies each shard object of the arrays it was
  given: the train state's own, alive until the save ends, so the parts'
  host copies would pile up to the whole state. The aliases die with their
  part, and its host copy is collected before the next
  (`_return_freed_host_memory`). A streaming restore's reads run here
  too, all in one call.
  """

  def __init__(self):
    # Orbax calls `dispatch` from its event loop; its writer runs an event
    # loop of its own, so it runs on this thread (it blocks that loop).
    self._thread = futures.ThreadPoolExecutor(
        max_workers=1, thread_name_prefix='coat_jax_checkpoint_part')

  def name(self) -> str:
    return 'coat_jax_part_writer'

  def device_to_host(self, arrays: Any) -> Any:
    # Each part is copied where it is written (`dispatch`).
    return arrays

  def dispatch(self, func: Callable[..., Any], *, input_arrays: Any = None,
               result_specs: Any = None, func_args: tuple[Any, ...] = (),
               func_kwargs: dict[str, Any] | None = None) -> Any:
    def run():
      args = func_args
      if input_arrays is not None:
        args = (jax.tree.map(_alias, input_arrays),) + args
      return func(*args, **(func_kwargs or {}))
    result = self._thread.submit(run).result()
    _return_freed_host_memory()
    return result if result_specs is not None else None


def _streaming_arrays() -> Any:
  """A type handler registry whose jax.Array handler is orbax's own (its
  settings kept) with every copy off the device deprioritized and, in a
  single-process run, each part written by a `_PartWriter` (orbax's
  dispatchers read every device's worker from one process: several
  processes write as orbax does)."""
  arrays = copy.copy(ocp.type_handlers.get_type_handler(jax.Array))
  arrays._callback = _Deprioritized()  # noqa: SLF001
  if jax.process_count() == 1:
    arrays._dispatcher = _PartWriter()  # noqa: SLF001
  return ocp.type_handlers.create_type_handler_registry((jax.Array, arrays))


def _state_handler(template: Any, budget_gb: float | None, streams: bool
                   ) -> ocp.StandardCheckpointHandler:
  """The orbax handler of the state item: orbax's defaults without a
  template; with one, `budget_gb` bounds its writes and reads and with
  `streams` (`streams_to_host`; `budget_gb` is then `stream_part_gb`) the
  state leaves the device a part at a time through ordinary host memory
  (`_PartWriter`). A save that is not streamed copies the whole state off
  the device at once, into XLA's pinned host pool where it fits
  (`fits_pinned_host`), else into ordinary host memory."""
  if template is None:
    return ocp.StandardCheckpointHandler()
  handler = ocp.StandardCheckpointHandler(save_concurrent_gb=budget_gb,
                                          restore_concurrent_gb=budget_gb)
  pinned = fits_pinned_host(sum(_nbytes(template)) / 1e9)
  if streams or not pinned:
    # StandardCheckpointHandler does not pass these options on; its
    # implementation is the PyTreeCheckpointHandler that takes them (the
    # same format on disk).
    streaming = dict(save_device_host_concurrent_gb=budget_gb,
                     type_handler_registry=_streaming_arrays()
                     ) if streams else {}
    handler._impl = ocp.PyTreeCheckpointHandler(  # noqa: SLF001
        save_concurrent_gb=budget_gb, restore_concurrent_gb=budget_gb,
        enable_pinned_host_transfer=None if pinned else False, **streaming)
  return handler


def _must_match(config: Config) -> dict:
  optim = dataclasses.asdict(config.optim)
  return {
      'model': {k: v for k, v in dataclasses.asdict(config.model).items()
                if k not in _MODEL_RUNTIME},
      'optim': {k: optim[k] for k in _OPTIM_LAYOUT},
      'train.seed': config.train.seed,
  }


def _jsonable(x: Any) -> Any:
  if isinstance(x, dict):
    return {k: _jsonable(v) for k, v in x.items()}
  if isinstance(x, tuple | list):
    return [_jsonable(v) for v in x]
  return x


def latest_step_on_disk(run_dir: str) -> int | None:
  """The newest committed step under `<run_dir>/checkpoints`, read from the
  directory names (orbax commits a step by renaming its temporary directory
  to the bare step number), without opening a manager; None if there is
  none."""
  directory = os.path.join(run_dir, 'checkpoints')
  if not os.path.isdir(directory):
    return None
  steps = [int(d) for d in os.listdir(directory) if d.isdigit()]
  return max(steps) if steps else None


# Where `Checkpointer.restore_newest` moves damaged steps, in the run
# directory: out of the way of this run's saves, kept for inspection.
DAMAGED_DIR = 'damaged_checkpoints'
# The two items of a step directory.
_ITEMS = ('state', 'config')


class Checkpointer:
  """Saves and restores the train state under `<run_dir>/checkpoints`.

  template: the state's tree of arrays or shapes, when known: it bounds the
  host memory a save or restore holds at once (`host_transfer_gb`), keeps
  a large state's save out of the pinned host pool (`fits_pinned_host`)
  and streams one larger than the budget off the device in parts
  (`stream_part_gb`), a save then blocking until written
  (`blocking_saves`); without it orbax's defaults apply.
  """

  def __init__(self, run_dir: str, config: Config, template: Any = None):
    self.directory = os.path.abspath(os.path.join(run_dir, 'checkpoints'))
    self.config = config
    options = ocp.CheckpointManagerOptions(
        max_to_keep=config.train.keep_checkpoints, create=True,
        enable_async_checkpointing=True)
    # One budget for the handler and for whether saves wait: free memory
    # changes between reads.
    budget = None if template is None else host_transfer_gb(template)
    # Whether every save waits until written (`streams_to_host`).
    self.blocking_saves = (template is not None
                           and streams_to_host(template, budget))
    if self.blocking_saves:
      budget = stream_part_gb(template, budget)
    self.manager = ocp.CheckpointManager(
        self.directory, options=options, item_handlers={
            'state': _state_handler(template, budget, self.blocking_saves),
            'config': ocp.JsonCheckpointHandler()})

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state: Any, *, wait: bool = False) -> None:
    """Saves `state` as `step` in the background (wait, or
    `blocking_saves`: until it is committed); a step saved already (a stop
    right after a periodic save) is not saved again."""
    if step not in self.manager.all_steps():
      self.manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state),
          config=ocp.args.JsonSave(_jsonable(_must_match(self.config)))),
          force=True)
    if wait or self.blocking_saves:
      self.manager.wait_until_finished()

  def restore_newest(self, template: Any, *,
                     report: Callable[[str], None] = print
                     ) -> tuple[int | None, Any]:
    """(step, state) of the newest step that restores into `template`;
    (None, None) when there is no step.

    A damaged step is reported; with train.on_damaged_checkpoint='stop' its
    error is raised, else the step before it is tried, and once one
    restores, the damaged ones are moved to `<run_dir>/damaged_checkpoints`
    (out of the way of this run's saves).

    Raises:
      DamagedCheckpointError: the newest step is damaged and
        train.on_damaged_checkpoint='stop'.
      ValueError: no step restores (nothing is moved), or one was written
        with another configuration (`restore`).
    """
    damaged = []
    for step in sorted(self.manager.all_steps(), reverse=True):
      try:
        state = self.restore(step, template)
      except DamagedCheckpointError as e:
        if self.config.train.on_damaged_checkpoint == 'stop':
          raise DamagedCheckpointError(e.path, e.why + (
              '\nSet train.on_damaged_checkpoint=fallback to resume from the'
              ' newest intact checkpoint before it (this one is then moved to'
              f' {self._damaged_dir()}), or move'
              f' {self._step_dir(step)} away.'), step) from e
        report(f'{e}\n  trying the checkpoint before it'
               ' (train.on_damaged_checkpoint=stop stops instead).')
        damaged.append(step)
        continue
      for bad in damaged:
        report(f'moved the damaged step {bad} to {self._set_aside(bad)}.')
      return step, state
    if damaged:
      raise ValueError(
          f'no checkpoint under {self.directory} restores (steps'
          f' {damaged}, each damaged as reported above): move the directory'
          ' away to start afresh.')
    return None, None

  def restore(self, step: int, template: Any) -> Any:
    """Restores `step` into `template` (abstract arrays with shardings).

    Raises:
      DamagedCheckpointError: a file of the step is missing or cannot be
        read (it names the step and the file).
      ValueError: the checkpoint was written by another model or optimizer
        layout, or a leaf's shape or dtype differs.
    """
    self.manager.wait_until_finished()
    self._check_items(step)
    step_dir = self._step_dir(step)
    with reading(os.path.join(step_dir, 'config'), step):
      saved = self.manager.restore(step, args=ocp.args.Composite(
          config=ocp.args.JsonRestore()))['config']
    self._check_config(saved, step)
    with reading(os.path.join(step_dir, 'state', '_METADATA'), step):
      metadata = self.manager.item_metadata(step)['state']
    tree = getattr(metadata, 'tree', metadata)
    check_matches(tree, template, what=f'checkpoint at step {step}')
    with reading(os.path.join(step_dir, 'state'), step):
      return self.manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(template)))['state']

  def _step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def _damaged_dir(self) -> str:
    return os.path.join(os.path.dirname(self.directory), DAMAGED_DIR)

  def _check_items(self, step: int) -> None:
    """Raises DamagedCheckpointError for an empty step directory or one
    without both items."""
    step_dir = self._step_dir(step)
    present = sorted(os.listdir(step_dir))
    if not present:
      raise DamagedCheckpointError(step_dir, 'the step directory is empty',
                                   step)
    for item in _ITEMS:
      if item not in present:
        raise DamagedCheckpointError(
            os.path.join(step_dir, item),
            f'missing (the step directory holds {present})', step)

  def _set_aside(self, step: int) -> str:
    """Moves `step`'s directory to `<run_dir>/damaged_checkpoints/<step>`
    (`<step>.2`, ... if taken); returns where. One process moves it."""
    target = base = os.path.join(self._damaged_dir(), str(step))
    n = 1
    while os.path.exists(target):
      n += 1
      target = f'{base}.{n}'
    if jax.process_index() == 0:
      os.makedirs(self._damaged_dir(), exist_ok=True)
      os.rename(self._step_dir(step), target)
    self.manager.reload()
    return target

  def _check_config(self, saved: dict, step: int) -> None:
    """Raises ValueError unless `saved` (a step's config item) describes the
    model, optimizer layout and seed of this run."""
    wanted = _jsonable(_must_match(self.config))
    # A model field newer than the checkpoint counts as its default.
    saved['model'] = {**_jsonable(_MODEL_DEFAULTS), **saved.get('model', {})}
    saved['model'] = {k: saved['model'][k] for k in wanted['model']
                      if k in saved['model']}
    diffs = [f'{k}: checkpoint {saved.get(k)!r}, this run {v!r}'
             for k, v in wanted.items() if saved.get(k) != v]
    if diffs:
      raise ValueError(
          f'The checkpoint at {self.directory}/{step} was written with another'
          ' configuration:\n  ' + '\n  '.join(diffs) + '\nUse a new'
          ' train.run_dir, or the settings that wrote it.')

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
