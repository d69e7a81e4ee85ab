"""What a finished train.py run left: its logged metrics and saved states."""

import json
import os

import jax

from coat_jax.training import checkpoints
from coat_jax.training import trainer


def logged(run_dir: str, key: str) -> list:
  """The values of `key` in run_dir's metrics.jsonl, in order."""
  with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
    return [r[key] for r in map(json.loads, f) if key in r]


def saved_state(config, step: int, devices=None):
  """The state a run of `config` saved at `step`, restored on `devices`
  (default: the first one)."""
  setup = trainer.build(config, devices or jax.devices()[:1])
  checkpointer = checkpoints.Checkpointer(config.train.run_dir, config)
  try:
    return trainer.restore_state(setup, checkpointer, step)
  finally:
    checkpointer.close()
