"""Periodic, async orbax checkpoints of the train state, checked on restore.

Each step directory holds the state and the config that wrote it. Orbax
commits a step by renaming a finished temporary directory, so a save killed
half way leaves the previous step loadable. Restoring compares the saved
config (model, optimizer layout, seed) and every leaf's shape and dtype with
what this run expects before reading anything, since orbax would cast.
"""

import dataclasses
import os
from typing import Any

import orbax.checkpoint as ocp

from coat_jax.checkpoint import check_matches
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


class Checkpointer:
  """Saves and restores the train state under `<run_dir>/checkpoints`."""

  def __init__(self, run_dir: str, config: Config):
    self.directory = os.path.abspath(os.path.join(run_dir, 'checkpoints'))
    self.config = config
    options = ocp.CheckpointManagerOptions(
        max_to_keep=config.train.keep_checkpoints, create=True,
        enable_async_checkpointing=True)
    self.manager = ocp.CheckpointManager(
        self.directory, options=options, item_handlers={
            'state': ocp.StandardCheckpointHandler(),
            'config': ocp.JsonCheckpointHandler()})

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state: Any, *, wait: bool = False) -> None:
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        config=ocp.args.JsonSave(_jsonable(_must_match(self.config)))),
        force=True)
    if wait:
      self.manager.wait_until_finished()

  def restore(self, step: int, template: Any) -> Any:
    """Restores `step` into `template` (abstract arrays with shardings).

    Raises:
      ValueError: the checkpoint was written by another model or optimizer
        layout, or a leaf's shape or dtype differs.
    """
    self.manager.wait_until_finished()
    saved = self.manager.restore(step, args=ocp.args.Composite(
        config=ocp.args.JsonRestore()))['config']
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
    metadata = self.manager.item_metadata(step)['state']
    tree = getattr(metadata, 'tree', metadata)
    check_matches(tree, template, what=f'checkpoint at step {step}')
    return self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(template)))['state']

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
