"""Orbax checkpoints that refuse a template that does not match what was saved.

Orbax casts a restored array to the template's dtype without a word (and an
FP32 value cast into E4M3 can overflow to NaN), so `restore` first compares the
stored tree, shapes and dtypes with the template and raises on any difference.
A file that is missing or cannot be read raises `DamagedCheckpointError`,
naming the file, instead of orbax's and tensorstore's traceback.
"""

import contextlib
import os
import re
from typing import Any

from etils import epath
import jax
import numpy as np
import orbax.checkpoint as ocp


class DamagedCheckpointError(ValueError):
  """A file of a checkpoint is missing or cannot be read.

  Attributes:
    path: the file (or directory) that is missing or unreadable.
    why: what is wrong, on one line.
    step: the train step the checkpoint holds (None outside a run).
  """

  def __init__(self, path: str, why: str, step: int | None = None):
    self.path, self.why, self.step = path, why, step
    what = 'checkpoint' if step is None else f'checkpoint of step {step}'
    super().__init__(f'the {what} is damaged: {path}: {why}')


# The files tensorstore names in its errors, e.g. `Error reading "..." in
# OCDBT database at local file "<dir>/state/": ...`.
_LOCAL_FILE = re.compile(r'local file "([^"]+)"')
_MAX_WHY = 500


@contextlib.contextmanager
def reading(path: str, step: int | None = None):
  """Turns an error raised while orbax reads `path` into a
  `DamagedCheckpointError` naming the file (the one tensorstore names where
  it names one, else `path`) and the error, on one line. Running out of
  memory is no damage and propagates as it is."""
  try:
    yield
  except MemoryError:
    raise
  except Exception as e:  # orbax and tensorstore raise many kinds
    # tensorstore's data errors come as the cause of orbax's.
    while e.__cause__ is not None:
      e = e.__cause__
    text = str(e).split(' [tensorstore_spec=')[0].strip()
    if 'RESOURCE_EXHAUSTED' in text:
      raise
    text = text.splitlines()[0] if text else ''
    files = [f for f in _LOCAL_FILE.findall(text) if not f.endswith('/')]
    why = f'{type(e).__name__}: {text}'
    if len(why) > _MAX_WHY:
      why = why[:_MAX_WHY] + ' ...'
    raise DamagedCheckpointError(files[-1] if files else path, why,
                                 step) from e


def _key_name(key: Any) -> str:
  """A key path entry as orbax names it (dict keys are saved as strings)."""
  for attr in ('key', 'name', 'idx'):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def _flat(tree: Any, is_leaf=None) -> dict[tuple, Any]:
  leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_leaf)
  return {tuple(_key_name(k) for k in path): x for path, x in leaves}


def _path_str(path: tuple) -> str:
  return '/'.join(str(k) for k in path) or '<root>'


def check_matches(stored: Any, template: Any, what: str = 'checkpoint') -> None:
  """Raises ValueError unless `template` has the stored tree, shapes, dtypes.

  Args:
    stored: the tree of array metadata orbax reports for a saved item (leaves
      with `.shape` and `.dtype`).
    template: the tree to restore into (arrays or jax.ShapeDtypeStruct).
    what: how to name the saved item in the message.
  """
  saved = _flat(stored, is_leaf=lambda x: hasattr(x, 'dtype'))
  wanted = _flat(template)
  problems = []
  for path in sorted(set(saved) | set(wanted), key=str):
    if path not in wanted:
      problems.append(f'{_path_str(path)}: in the {what}, not in the template')
    elif path not in saved:
      problems.append(f'{_path_str(path)}: in the template, not in the {what}')
    else:
      s, w = saved[path], wanted[path]
      if tuple(s.shape) != tuple(w.shape) or np.dtype(s.dtype) != np.dtype(
          w.dtype):
        problems.append(
            f'{_path_str(path)}: {what} has {np.dtype(s.dtype)}'
            f'{list(s.shape)}, template has {np.dtype(w.dtype)}'
            f'{list(w.shape)}')
  if problems:
    shown = '\n  '.join(problems[:20])
    more = (f'\n  ... and {len(problems) - 20} more'
            if len(problems) > 20 else '')
    raise ValueError(
        f'The {what} does not match the state to restore into (orbax would'
        f' silently cast or fail deep inside):\n  {shown}{more}\nRestore with'
        ' the same model config and optimizer settings that wrote it.')


def save(directory: str | os.PathLike, tree: Any) -> None:
  """Saves a pytree (FP8 arrays included, bit-exact) and waits until done."""
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(os.path.abspath(directory), tree)
  checkpointer.wait_until_finished()


def restore(directory: str | os.PathLike, template: Any) -> Any:
  """Restores into `template`'s structure, dtypes and shardings, or raises.

  Args:
    directory: where `save` wrote the tree.
    template: a tree of arrays or jax.ShapeDtypeStruct (with `sharding` to
      restore onto another mesh) that must match the saved tree exactly.

  Raises:
    FileNotFoundError: nothing was saved there.
    DamagedCheckpointError: a file of it is missing or cannot be read.
    ValueError: the tree, a shape or a dtype differs from what was saved.
  """
  directory = os.path.abspath(directory)
  if not os.path.isdir(directory):
    raise FileNotFoundError(f'No checkpoint at {directory}.')
  # The handler's metadata raises where StandardCheckpointer's logs and
  # returns None.
  with reading(os.path.join(directory, '_METADATA')):
    stored = ocp.StandardCheckpointHandler().metadata(epath.Path(directory))
  check_matches(stored.tree, template)
  with reading(directory):
    return ocp.StandardCheckpointer().restore(directory, template)
