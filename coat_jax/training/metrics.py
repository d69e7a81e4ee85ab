"""A run's metrics: `<run_dir>/metrics.jsonl`, optionally TensorBoard too.

Each line of metrics.jsonl is one JSON record with a `step` and the scalars
logged at it (`loss`, `grad_norm`, `learning_rate`, `tokens_per_s`,
`nonfinite_steps`, `peak_memory_bytes` on training lines; `val_loss` on
validation lines). A resumed run first drops the records past the step it
resumes from (`MetricsLog.drop_after`: it replays those steps), then appends.
"""

import json
import math
import os
from typing import Any

METRICS_FILE = 'metrics.jsonl'
TENSORBOARD_DIR = 'tensorboard'

# metrics.jsonl key -> TensorBoard tag.
_TAGS = {
    'loss': 'train/loss',
    'val_loss': 'val/loss',
    'learning_rate': 'train/learning_rate',
    'grad_norm': 'train/grad_norm',
    'tokens_per_s': 'perf/tokens_per_s',
    'nonfinite_steps': 'train/skipped_steps',
    'peak_memory_bytes': 'perf/peak_memory_gib',
}


def _tensorboardx():
  try:
    import tensorboardX  # noqa: PLC0415 (optional dependency)
  except ImportError:
    raise ImportError(
        'train.tensorboard=true needs tensorboardX: pip install tensorboardX'
        " (or pip install -e '.[tensorboard]'), or set"
        ' train.tensorboard=false.') from None
  return tensorboardX


class MetricsLog:
  """Appends records to metrics.jsonl and, if asked, to TensorBoard.

  Args:
    run_dir: the run directory (must exist by the first write).
    write: False makes every call a no-op (processes other than 0).
    tensorboard: also write scalars under `<run_dir>/tensorboard` (its
      event file is opened by the first write, so a run that logs nothing
      leaves none).

  Raises:
    ImportError: tensorboard=True without tensorboardX installed.
  """

  def __init__(self, run_dir: str, *, write: bool = True,
               tensorboard: bool = False):
    self._path = os.path.join(run_dir, METRICS_FILE) if write else None
    self._file = None
    self._writer = None
    self._make_writer = None
    self._purge_step = None
    if write and tensorboard:
      module = _tensorboardx()  # Fails now, not after the first steps.
      logdir = os.path.join(run_dir, TENSORBOARD_DIR)
      self._make_writer = lambda: module.SummaryWriter(
          logdir, purge_step=self._purge_step)

  def drop_after(self, step: int) -> None:
    """Drops the records past `step` (a run resumed from `step` replays
    those steps): from metrics.jsonl now, and from TensorBoard's view by a
    purge at the first write. Call it before the first write."""
    if self._path is None:
      return
    if self._file is not None:  # appends would go to the replaced file
      raise RuntimeError('MetricsLog.drop_after must precede the first write.')
    self._purge_step = step + 1
    if not os.path.isfile(self._path):
      return
    with open(self._path) as f:
      kept = [line for line in f if _step_of(line) <= step]
    tmp = self._path + '.tmp'
    with open(tmp, 'w') as f:
      f.writelines(kept)
    os.replace(tmp, self._path)  # a kill leaves the old file or the new

  def write(self, step: int, **scalars: float | int | None) -> None:
    """Logs `scalars` at `step`; None values are left out."""
    if self._path is None:
      return
    if self._file is None:
      self._file = open(self._path, 'a')
      if self._make_writer is not None:
        self._writer = self._make_writer()
    record = {'step': step, **{k: v for k, v in scalars.items()
                               if v is not None}}
    self._file.write(json.dumps(record) + '\n')
    self._file.flush()
    if self._writer is not None:
      for key, value in record.items():
        if key in _TAGS:
          if key == 'peak_memory_bytes':
            value = value / 2**30
          self._writer.add_scalar(_TAGS[key], value, step)
      self._writer.flush()

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
    if self._writer is not None:
      self._writer.close()


def _step_of(line: str) -> float:
  """The step of a metrics.jsonl line; inf (past any step) for a blank line
  or one cut short by a kill."""
  try:
    return json.loads(line)['step']
  except (json.JSONDecodeError, KeyError, TypeError):
    return math.inf


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
  """The records of `<run_dir>/metrics.jsonl` in step order, one per (step,
  kind), the later of repeated records winning (a resumed run appends).

  Raises:
    FileNotFoundError: the run directory has no metrics.jsonl.
  """
  path = os.path.join(run_dir, METRICS_FILE)
  if not os.path.isfile(path):
    raise FileNotFoundError(f'{run_dir}: no {METRICS_FILE}; is it a run'
                            ' directory written by train.py?')
  by_key = {}
  with open(path) as f:
    for line in f:
      line = line.strip()
      if not line:
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError:  # A line cut short by a kill.
        continue
      by_key[(record['step'], 'val_loss' in record)] = record
  return [by_key[k] for k in sorted(by_key)]


def series(records: list[dict[str, Any]], key: str):
  """(steps, values) of `key` over `records`, finite values only."""
  pairs = [(r['step'], r[key]) for r in records
           if key in r and r[key] is not None and math.isfinite(r[key])]
  return [s for s, _ in pairs], [v for _, v in pairs]


def latest(records: list[dict[str, Any]]) -> dict[str, tuple[int, Any]]:
  """For each key, (step, value) of its last finite record."""
  out = {}
  for r in records:
    for key, value in r.items():
      if key != 'step' and value is not None and math.isfinite(value):
        out[key] = (r['step'], value)
  return out
