"""Plots train.py runs: loss, validation loss and tokens/s against step.

  python -m coat_jax.plot runs/bf16 runs/coat -o curves.png

Several runs are overlaid; each is labelled from its config.json (model
preset, recipe, optimizer), with its directory's name where two labels
would be the same. Needs matplotlib (pip install matplotlib, or the `plot`
extra).
"""

import argparse
import json
import os
import sys

from coat_jax import recipes
from coat_jax.training import config as config_lib
from coat_jax.training import metrics as metrics_lib

# (metrics.jsonl key, axis title)
PANELS = (('loss', 'train loss'), ('val_loss', 'validation loss'),
          ('tokens_per_s', 'tokens/s'))


def _pyplot():
  try:
    import matplotlib  # noqa: PLC0415 (optional dependency)
  except ImportError:
    raise ImportError('coat_jax.plot needs matplotlib: pip install matplotlib'
                      " (or pip install -e '.[plot]').") from None
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # noqa: PLC0415

  return plt


def run_label(run_dir: str) -> str:
  """'<preset> <recipe>, <optimizer>' from the run's config.json, or the
  directory's name when it has none."""
  try:
    with open(os.path.join(run_dir, 'config.json')) as f:
      config = json.load(f)
    model = config_lib.from_dict(config).model
    recipe = recipes.name_of(config_lib.recipe(model)) or 'custom recipe'
    return f"{model.preset} {recipe}, {config['optim']['name']}"
  except (OSError, KeyError, ValueError, TypeError):
    return os.path.basename(os.path.normpath(run_dir))


def _labels(run_dirs: list[str]) -> list[str]:
  labels = [run_label(d) for d in run_dirs]
  return [f'{label} ({os.path.basename(os.path.normpath(d))})'
          if labels.count(label) > 1 else label
          for label, d in zip(labels, run_dirs)]


def plot_runs(run_dirs: list[str], output: str, *, title: str | None = None,
              dpi: int = 120) -> str:
  """Draws the runs' curves side by side into `output` (PNG, SVG, PDF...).

  Raises:
    ValueError: no run directories.
    FileNotFoundError: a run directory without metrics.jsonl.
    ImportError: matplotlib is missing.
  """
  if not run_dirs:
    raise ValueError('give at least one run directory to plot.')
  runs = [metrics_lib.read_metrics(d) for d in run_dirs]  # fails before plt
  plt = _pyplot()
  fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 3.6),
                           constrained_layout=True)
  for records, label in zip(runs, _labels(run_dirs)):
    for ax, (key, _) in zip(axes, PANELS):
      steps, values = metrics_lib.series(records, key)
      ax.plot(steps, values, marker='.' if len(steps) < 30 else None,
              label=label)
  for ax, (_, name) in zip(axes, PANELS):
    ax.set_title(name)
    ax.set_xlabel('step')
    ax.grid(alpha=0.3)
  axes[0].legend()
  if title:
    fig.suptitle(title)
  fig.savefig(output, dpi=dpi)
  plt.close(fig)
  return output


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('run_dirs', nargs='+', metavar='RUN_DIR',
                      help='train.py run directories (train.run_dir)')
  parser.add_argument('-o', '--output', default='curves.png',
                      help='the image to write (default curves.png)')
  parser.add_argument('--title', help='a title above the panels')
  args = parser.parse_args(argv)
  try:
    path = plot_runs(args.run_dirs, args.output, title=args.title)
  except (ValueError, FileNotFoundError, ImportError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  print(f'wrote {path}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
