"""train.py on one GPU in each precision mode: tokens/s, peak memory, loss.

Each mode runs `python train.py --config configs/llama_1b.py` in its own
process (peak memory is per process), for --steps steps from scratch, and
the table compares the modes. bf16 uses optax.adamw (float32 moments), the
FP8 modes use coat_adamw.

  PYTHONPATH=. python benchmarks/train_modes.py --steps 200
"""

import argparse
import re
import subprocess
import sys
import tempfile

import jax

MODES = {
    'bf16': ['model.precision=bf16', 'optim.name=adamw'],
    'fp8_linear': ['model.precision=fp8_linear', 'optim.name=adamw'],
    'coat': ['model.precision=coat', 'optim.name=coat_adamw'],
}
DONE = re.compile(
    r'done: step (\d+), train loss ([\d.nan]+), validation loss ([\d.nan]+),'
    r' ([\d,.nan]+) tokens/s, peak device memory ([\d.]+ GiB|n/a)')


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--config', default='configs/llama_1b.py')
  parser.add_argument('--steps', type=int, default=200)
  parser.add_argument('--modes', default=','.join(MODES))
  parser.add_argument('--set', nargs='*', default=[])
  args = parser.parse_args()
  rows = []
  for mode in args.modes.split(','):
    run_dir = tempfile.mkdtemp(prefix=f'coat_{mode}_')
    cmd = [sys.executable, 'train.py', '--config', args.config, '--set',
           f'train.steps={args.steps}', f'train.run_dir={run_dir}',
           'train.progress_bar=false', f'train.eval_every={args.steps}',
           'train.checkpoint_every=0', 'train.log_every=20',
           *MODES[mode], *args.set]
    print('$', ' '.join(cmd), flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True)
    print(out.stdout[-2000:], out.stderr[-3000:], flush=True)
    match = DONE.search(out.stdout)
    rows.append((mode, match.groups() if match else None, out.returncode))
  print(f'\n{jax.devices()[0].device_kind}, jax {jax.__version__},'
        f' {args.config}, {args.steps} steps')
  print('| mode | tokens/s | peak memory | final train loss | val loss |')
  print('|---|---|---|---|---|')
  for mode, g, rc in rows:
    if g is None:
      print(f'| {mode} | failed (exit {rc}) | | | |')
    else:
      print(f'| {mode} | {g[3]} | {g[4]} | {g[1]} | {g[2]} |')


if __name__ == '__main__':
  main()
