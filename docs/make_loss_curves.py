"""Makes docs/loss_curves.png: the same run in BF16 and in COAT, overlaid.

  PYTHONPATH=. python docs/make_loss_curves.py                 # tiny, CPU
  PYTHONPATH=. python docs/make_loss_curves.py --config configs/llama_1b.py \
      --set train.steps=300 --title '1b, H200'

Runs `train.py` twice with the same config, seed and data: `bf16` (BF16
model, optax AdamW with float32 moments) and `coat` (COAT FP8 activations
and FP8 AdamW moments), each into a fresh `<runs>/<mode>` directory, then
draws both with `coat_jax.plot`.
"""

import argparse
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from coat_jax import plot  # noqa: E402 (after the path)

MODES = {
    'bf16': ['model.precision=bf16', 'optim.name=adamw'],
    'coat': ['model.precision=coat', 'optim.name=coat_adamw'],
}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--config', help='a configs/*.py file (default: the'
                      ' embedded tiny run)')
  parser.add_argument('--set', nargs='+', default=[], action='extend',
                      metavar='SECTION.FIELD=VALUE',
                      help='overrides for both runs')
  parser.add_argument('--runs', default=os.path.join(ROOT, 'runs',
                                                     'loss_curves'),
                      help='where the two run directories go')
  parser.add_argument('-o', '--output', default=os.path.join(
      ROOT, 'docs', 'loss_curves.png'))
  parser.add_argument('--title', default='tiny Llama, stdlib bytes, CPU')
  args = parser.parse_args(argv)
  run_dirs = []
  for mode, overrides in MODES.items():
    run_dir = os.path.join(args.runs, mode)
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, os.path.join(ROOT, 'train.py'),
           *(['--config', args.config] if args.config else []),
           '--set', *args.set, *overrides, f'train.run_dir={run_dir}',
           'train.progress_bar=false']
    print('+', ' '.join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT,
                   env=dict(os.environ, PYTHONPATH=ROOT))
    run_dirs.append(run_dir)
  print('wrote', plot.plot_runs(run_dirs, args.output, title=args.title))
  return 0


if __name__ == '__main__':
  sys.exit(main())
