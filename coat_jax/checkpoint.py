"""Orbax checkpoints that refuse a template that does not match what was saved.

Orbax casts a restored array to the template's dtype without a word (and an
FP32 value cast into E4M3 can overflow to NaN), so `restore` first compares the
stored tree, shapes and dtypes with the template and raises on any difference.
"""

import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


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
    ValueError: the tree, a shape or a dtype differs from what was saved.
  """
  directory = os.path.abspath(directory)
  if not os.path.isdir(directory):
    raise FileNotFoundError(f'No checkpoint at {directory}.')
  checkpointer = ocp.StandardCheckpointer()
  check_matches(checkpointer.metadata(directory).item_metadata.tree, template)
  return checkpointer.restore(directory, template)
