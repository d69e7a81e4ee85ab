"""Accuracy across learning rates: final validation loss per variant
(RESULTS.md "stability" and "vlm").

  PYTHONPATH=. python benchmarks/stability.py --out-dir runs/stability \\
      --parallel 4 --lrs 1e-3,3e-3 --variants linear=fp8_linear:optim.name=adamw
  PYTHONPATH=. python benchmarks/stability.py --config configs/vlm_1b.py \\
      --data shapes --batch 32 --steps 300 --lrs 3e-4 --no-deterministic

Trains the 125m Llama (configs/llama_125m.py) on the default corpus
(data.source=stdlib: the Python standard library, byte-level) at seq 512,
batch 16, for 800 steps (warm-up 100, cosine decay to 0.1x), at each
learning rate and seed, in each variant. Every run is `python train.py` in
its own process with its run dir under --out-dir/<variant>_lr<lr>_seed<seed>
(config.json, metrics.jsonl, train.log), so the curves can be re-plotted.
With --data shapes it trains a VLM config on the shapes questions instead,
and the report adds the held-out answer accuracy.
Variants are `name=mode:section.field=value,...` as in benchmarks/e2e.py,
over the precision overrides of e2e.MODE_OVERRIDES:

  bf16  model.recipe=bf16, optim.name=adamw (always run: the reference)
  coat  model.recipe=coat, optim.name=coat_adamw
  e.g.  moments=bf16:optim.name=coat_adamw (FP8 moments, BF16 model)
        linear=fp8_linear:optim.name=adamw (FP8 GEMMs only)
        coat_block=coat:model.scaling=block

--parallel N runs N processes at once on the one GPU, each with
XLA_PYTHON_CLIENT_MEM_FRACTION=0.9/N and, unless --no-deterministic,
XLA_FLAGS=--xla_gpu_deterministic_ops=true, so that a run repeats to the
bit (without it two runs of one seed differ by more than the differences
measured here), with scanned layers (model.scan_layers=true: unrolled ones
fail under that flag). Runs finished in --out-dir are kept (rerun the same
command to go on); unfinished ones restart.
The report (markdown table, stability.md, and the curves, stability.png)
covers every run dir found: --report-only DIR combines several calls.
"""

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time

from benchmarks import e2e

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
META = 'stability_run.json'
DETERMINISTIC = '--xla_gpu_deterministic_ops=true'
# With XLA's deterministic kernels, jax fails to run unrolled decoder layers
# (cuDNN flash attention's backward twice in one program; train.py refuses
# the combination, `trainer.check_deterministic_layers`): the runs scan
# the layers.
DETERMINISTIC_LAYERS = ('model.scan_layers=true',)
# The accuracy targets: |coat - bf16| / bf16 of the mean final val loss.
TARGETS = {1e-3: 0.005, 3e-3: 0.005, 1e-2: 0.015}


def parse_variants(specs: list[str]) -> dict:
  """{name: (mode, overrides)}: bf16 and coat, then --variants."""
  runs = {'bf16': ('bf16', []), 'coat': ('coat', [])}
  for spec in specs:
    name, mode, overrides = e2e.parse_variant(spec)
    if mode not in e2e.MODE_OVERRIDES:
      raise ValueError(f'--variants {spec!r}: mode must be one of'
                       f' {tuple(e2e.MODE_OVERRIDES)} (train.py runs).')
    if name in runs:
      raise ValueError(f'--variants: the name {name!r} is taken.')
    runs[name] = (mode, overrides)
  return runs


def check_deterministic(variants: dict, common: list[str]) -> None:
  """Raises ValueError naming --no-deterministic where a variant unrolls
  its layers (model.scan_layers=false), which XLA's deterministic kernels
  cannot run: train.py would refuse every such run after it started."""
  for name, (_, overrides) in variants.items():
    for item in [*common, *overrides]:
      key, _, value = item.partition('=')
      if key == 'model.scan_layers' and value.lower() in ('false', '0'):
        raise ValueError(
            f'variant {name!r} sets {item}: unrolled layers do not run under'
            " XLA's deterministic kernels (--deterministic, the default);"
            ' pass --no-deterministic, or drop the override.')


def run_name(variant: str, lr: float, seed: int) -> str:
  return f'{variant}_lr{lr:g}_seed{seed}'


def train_command(args, mode: str, overrides: list[str], lr: float,
                  seed: int, run_dir: str) -> list[str]:
  data = (['data.source=shapes'] if args.data == 'shapes' else
          ['data.source=stdlib', f'data.seq_len={args.seq}'])
  return [sys.executable, os.path.join(ROOT, 'train.py'),
          '--config', args.config, '--set', *data,
          f'train.batch_size={args.batch}', f'train.steps={args.steps}',
          f'optim.learning_rate={lr}', f'train.seed={seed}',
          f'train.eval_every={args.eval_every}',
          f'train.eval_batches={args.eval_batches}', 'train.log_every=10',
          'train.save_checkpoints=false', 'train.progress_bar=false',
          f'train.run_dir={run_dir}', *e2e.MODE_OVERRIDES[mode],
          *(DETERMINISTIC_LAYERS if args.deterministic else ()),
          *args.set, *overrides]


def read_run(run_dir: str) -> dict | None:
  """The run's metadata with its curves: train [(step, loss)], val
  [(step, loss)], final_val (nan unless the last step was evaluated),
  tokens_per_s (median of the logged intervals but the first); a VLM's
  also accuracy [(step, held-out answer accuracy)] and final_accuracy."""
  path = os.path.join(run_dir, META)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    run = json.load(f)
  train, val, accuracy, rates, nonfinite = [], [], [], [], 0
  metrics = os.path.join(run_dir, 'metrics.jsonl')
  if os.path.exists(metrics):
    with open(metrics) as f:
      for line in f:
        r = json.loads(line)
        if 'val_loss' in r:
          val.append((r['step'], r['val_loss']))
          if 'val_accuracy' in r:
            accuracy.append((r['step'], r['val_accuracy']))
        else:
          train.append((r['step'], r['loss']))
          rates.append(r['tokens_per_s'])
          nonfinite = r['nonfinite_steps']
  evaluated = bool(val) and val[-1][0] == run['steps']
  return dict(run, train=train, val=val, evaluated=evaluated,
              final_val=val[-1][1] if evaluated else math.nan,
              accuracy=accuracy,
              final_accuracy=(accuracy[-1][1] if evaluated and accuracy
                              else math.nan),
              nonfinite_steps=nonfinite,
              tokens_per_s=statistics.median(rates[1:] or rates
                                             or [math.nan]))


def is_finished(run: dict | None) -> bool:
  """Exited cleanly after evaluating its last step (a diverged run with a
  nan loss is finished too: that is its result)."""
  return bool(run) and run.get('returncode') == 0 and run['evaluated']


def run_meta(args, name, mode, overrides, lr, seed) -> dict:
  """What a run dir's stability_run.json records before the outcome."""
  return dict(variant=name, mode=mode, overrides=overrides, lr=lr, seed=seed,
              steps=args.steps, data=args.data,
              seq=args.seq if args.data == 'stdlib' else None,
              batch=args.batch,
              config=args.config, set=args.set, eval_every=args.eval_every,
              eval_batches=args.eval_batches,
              deterministic=args.deterministic)


def run_env(parallel: int, deterministic: bool) -> dict:
  """The environment of each train.py run: its share of the GPU memory and,
  when deterministic, XLA's deterministic GPU kernels (scatter-add,
  attention's backward), without which two runs of one seed end up further
  apart than the differences measured here."""
  env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=str(
      round(0.9 / parallel, 4)), PYTHONPATH=os.pathsep.join(
          filter(None, [ROOT, os.environ.get('PYTHONPATH')])))
  if deterministic:
    env['XLA_FLAGS'] = ' '.join(
        filter(None, [env.get('XLA_FLAGS'), DETERMINISTIC]))
  return env


def run_all(args, variants: dict, lrs: list[float], seeds: list[int]):
  """Runs every (variant, lr, seed) not finished yet, --parallel at once."""
  todo = []
  for name, (mode, overrides) in variants.items():
    for lr in lrs:
      for seed in seeds:
        run_dir = os.path.join(args.out_dir, run_name(name, lr, seed))
        meta = run_meta(args, name, mode, overrides, lr, seed)
        old = read_run(run_dir)
        if old and not args.fresh:
          changed = sorted(k for k in meta if old.get(k) != meta[k])
          if changed:
            raise ValueError(
                f'{run_dir} holds a run with other settings ({changed});'
                ' pass another --out-dir, or --fresh to replace it.')
          if is_finished(old):
            print(f'  {run_name(name, lr, seed)}: finished before, kept',
                  flush=True)
            continue
        todo.append((meta, run_dir))
  env = run_env(args.parallel, args.deterministic)
  fraction = env['XLA_PYTHON_CLIENT_MEM_FRACTION']
  print(f'{len(todo)} runs to go, {args.parallel} at a time,'
        f' XLA_PYTHON_CLIENT_MEM_FRACTION={fraction} each'
        + (f', {DETERMINISTIC}' if args.deterministic else ''), flush=True)
  running = []
  walls = []
  start_all = time.perf_counter()

  def in_budget():
    if not args.budget_s:
      return True
    elapsed = time.perf_counter() - start_all
    return elapsed + (max(walls) if walls else 0.0) <= args.budget_s

  while (todo and in_budget()) or running:
    while todo and len(running) < args.parallel and in_budget():
      meta, run_dir = todo.pop(0)
      # Unfinished (or --fresh): train.py would append to its metrics.
      shutil.rmtree(run_dir, ignore_errors=True)
      os.makedirs(run_dir)
      cmd = train_command(args, meta['mode'], meta['overrides'], meta['lr'],
                          meta['seed'], run_dir)
      log = open(os.path.join(run_dir, 'train.log'), 'w')
      log.write('$ ' + ' '.join(cmd) + '\n')
      log.flush()
      proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log,
                              stderr=subprocess.STDOUT)
      running.append((proc, log, meta, run_dir, time.perf_counter()))
      print(f'  started {os.path.basename(run_dir)}', flush=True)
    time.sleep(0.5)
    for item in list(running):
      proc, log, meta, run_dir, start = item
      if proc.poll() is None:
        continue
      running.remove(item)
      log.close()
      wall = time.perf_counter() - start
      walls.append(wall)
      with open(os.path.join(run_dir, META), 'w') as f:
        json.dump(dict(meta, returncode=proc.returncode, wall_s=wall), f)
      run = read_run(run_dir)
      status = ('ok' if is_finished(run) else
                f'FAILED (exit {proc.returncode}, see {run_dir}/train.log)')
      print(f'  {os.path.basename(run_dir)}: {status}, final val loss'
            f' {run["final_val"]:.4f}, {run["tokens_per_s"]:,.0f} tokens/s,'
            f' {wall:.0f} s wall (imports, compile and evals included)',
            flush=True)
  if todo:
    print(f'stopped: --budget-s {args.budget_s:.0f} would be exceeded by'
          f' the next run; {len(todo)} runs left. Rerun the same command'
          ' (same --out-dir) to go on.', flush=True)
  if walls:
    per_run = max(statistics.median(walls), 1.0)
    print(f'\nsizing: a run takes ~{per_run:.0f} s wall at --parallel'
          f' {args.parallel}', flush=True)


def report(out_dir: str) -> str:
  """Markdown table of every run dir in out_dir; writes stability.md and
  stability.png there."""
  runs = [read_run(os.path.join(out_dir, d)) for d in sorted(
      os.listdir(out_dir))]
  runs = [r for r in runs if r is not None]
  if not runs:
    raise FileNotFoundError(f'{out_dir}: no run dirs with {META}.')
  variants = list(dict.fromkeys(
      ['bf16', 'coat'] + [r['variant'] for r in runs]))
  variants = [v for v in variants if any(r['variant'] == v for r in runs)]
  lrs = sorted({r['lr'] for r in runs})
  finals = {}
  for r in runs:
    finals.setdefault((r['variant'], r['lr']), {})[r['seed']] = r['final_val']
  r0 = runs[0]
  extra = ' --set ' + ' '.join(r0['set']) if r0['set'] else ''
  data = (f'seq {r0["seq"]}, stdlib corpus' if r0.get('seq') else
          'the shapes questions')
  lines = [f'{r0["config"]}{extra}: {data}, batch {r0["batch"]},'
           f' {r0["steps"]} steps; final validation loss, mean of seeds'
           ' (each seed), and the relative difference of the means to'
           ' bf16', '', *_header(lrs)]

  def loss_cell(lr, seeds, ref):
    mean = statistics.mean(seeds.values())
    cell = (f'{mean:.4f} ('
            + ', '.join(f'{seeds[s]:.4f}' for s in sorted(seeds)) + ')')
    if ref:
      diff = mean / statistics.mean(ref.values()) - 1
      cell += f' {100 * diff:+.2f}%'
      if lr in TARGETS:
        cell += ' ok' if abs(diff) <= TARGETS[lr] else ' MISS'
    return cell

  lines += _rows(finals, variants, lrs, loss_cell)
  lines += ['', 'ok/MISS: within the target of bf16 (0.5% at 1e-3 and'
            ' 3e-3, 1.5% at 1e-2; same seeds on both sides).']
  lines += _paired_table(finals, variants, lrs)
  lines += _accuracy_table(runs, variants, lrs)
  bad = [r for r in runs if r['nonfinite_steps'] or not math.isfinite(
      r['final_val'])]
  for r in bad:
    lines.append(f'- {run_name(r["variant"], r["lr"], r["seed"])}:'
                 f' {r["nonfinite_steps"]} skipped non-finite steps, exit'
                 f' {r.get("returncode")}')
  text = '\n'.join(lines)
  with open(os.path.join(out_dir, 'stability.md'), 'w') as f:
    f.write(text + '\n')
  plot(runs, variants, lrs, os.path.join(out_dir, 'stability.png'))
  return text


def _paired_table(finals: dict, variants: list[str],
                  lrs: list[float]) -> list[str]:
  """Markdown lines: each variant's final loss over bf16's of the same seed,
  minus 1, as mean +- standard error over the seeds (how far the seed noise
  lets a mean of this many seeds resolve the targets) and, from three
  seeds on, the standard deviation of a mean of two seeds (the targets'
  measure)."""
  rows = []
  for v in [name for name in variants if name != 'bf16']:
    cells = []
    for lr in lrs:
      seeds, ref = finals.get((v, lr), {}), finals.get(('bf16', lr), {})
      common = sorted(set(seeds) & set(ref))
      diffs = [100 * (seeds[s] / ref[s] - 1) for s in common]
      if not diffs:
        cells.append('')
      elif len(diffs) == 1:
        cells.append(f'{diffs[0]:+.2f}% (1 seed)')
      else:
        sd = statistics.stdev(diffs)
        two = (f'; two seeds +- {sd / math.sqrt(2):.2f}' if len(diffs) > 2
               else '')
        cells.append(f'{statistics.mean(diffs):+.2f}% +-'
                     f' {sd / math.sqrt(len(diffs)):.2f} ({len(diffs)}'
                     f' seeds{two})')
    if any(cells):
      rows.append(f'| {v} | ' + ' | '.join(cells) + ' |')
  if not rows:
    return []
  return ['', 'Per seed, variant / bf16 - 1 (mean +- standard error'
          ' over the seeds; two seeds: +- the standard deviation of a'
          ' mean of two):', '', *_header(lrs), *rows]


def _accuracy_table(runs: list[dict], variants: list[str],
                    lrs: list[float]) -> list[str]:
  """Markdown lines of a VLM's final held-out answer accuracy: mean of
  seeds (each seed) and the difference of the means to bf16's in points;
  [] when no run measured one."""
  finals = {}
  for r in runs:
    if math.isfinite(r.get('final_accuracy', math.nan)):
      finals.setdefault((r['variant'], r['lr']), {})[r['seed']] = (
          r['final_accuracy'])
  if not finals:
    return []
  def accuracy_cell(lr, seeds, ref):
    mean = statistics.mean(seeds.values())
    cell = (f'{100 * mean:.1f}% ('
            + ', '.join(f'{100 * seeds[s]:.1f}' for s in sorted(seeds)) + ')')
    if ref:
      cell += f' {100 * (mean - statistics.mean(ref.values())):+.1f}'
    return cell

  return ['', 'Final held-out answer accuracy, mean of seeds (each seed),'
          ' and the difference of the means to bf16 in points:', '',
          *_header(lrs), *_rows(finals, variants, lrs, accuracy_cell)]


def _header(lrs: list[float]) -> list[str]:
  return ['| variant | ' + ' | '.join(f'lr {lr:g}' for lr in lrs) + ' |',
          '|---' * (len(lrs) + 1) + '|']


def _rows(finals: dict, variants: list[str], lrs: list[float],
          cell) -> list[str]:
  """A markdown row per variant of `finals` ({(variant, lr): {seed:
  value}}): cell(lr, seeds, ref) at each lr it ran, ref being bf16's
  {seed: value} when the variant is not bf16 and bf16 ran the same seeds,
  else None."""
  rows = []
  for v in variants:
    cells = []
    for lr in lrs:
      seeds, ref = finals.get((v, lr)), finals.get(('bf16', lr))
      same = v != 'bf16' and ref and set(ref) == set(seeds or ())
      cells.append(cell(lr, seeds, ref if same else None) if seeds else '')
    rows.append(f'| {v} | ' + ' | '.join(cells) + ' |')
  return rows


def _over_seeds(curves: list[list[tuple[int, float]]]):
  """(steps, low, high, mean_steps, mean) of curves [(step, loss)] of
  several seeds: low and high over the finite losses at each step, the mean
  only at the steps where every seed's loss is finite (it ends where a seed
  diverged)."""
  by_step = {}
  for curve in curves:
    for step, loss in curve:
      if math.isfinite(loss):
        by_step.setdefault(step, []).append(loss)
  steps = sorted(by_step)
  full = [s for s in steps if len(by_step[s]) == len(curves)]
  return (steps, [min(by_step[s]) for s in steps],
          [max(by_step[s]) for s in steps], full,
          [statistics.mean(by_step[s]) for s in full])


def plot(runs: list[dict], variants: list[str], lrs: list[float],
         path: str) -> None:
  """Train (top) and validation (bottom) loss per learning rate; one color
  per variant: the mean over its seeds, shaded from the lowest to the
  highest seed, and each seed's validation losses as dots."""
  import matplotlib  # noqa: PLC0415 (only the report needs it)

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # noqa: PLC0415

  fig, axes = plt.subplots(2, len(lrs), figsize=(5 * len(lrs), 7),
                           squeeze=False, sharex=True)
  colors = dict(zip(variants, plt.rcParams['axes.prop_cycle'].by_key()[
      'color'] * 4))
  for col, lr in enumerate(lrs):
    for i, variant in enumerate(variants):
      mine = [r for r in runs if r['lr'] == lr and r['variant'] == variant]
      if not mine:
        continue
      color = colors[variant]
      label = f'{variant} ({len(mine)} seed{"s" * (len(mine) > 1)})'
      for row, key in enumerate(('train', 'val')):
        ax = axes[row][col]
        steps, low, high, full, mean = _over_seeds([r[key] for r in mine])
        if len(mine) > 1:
          ax.fill_between(steps, low, high, color=color, alpha=0.2,
                          linewidth=0)
        ax.plot(full, mean, color=color, linewidth=1.2,
                marker='.' if len(full) < 3 else None,
                label=label if row == 0 else None)
        if key == 'val':  # each seed, a little apart from the others
          shift = (i - (len(variants) - 1) / 2) * 0.01 * mine[0]['steps']
          dots = [(s + shift, v) for r in mine for s, v in r['val']
                  if math.isfinite(v)]
          if dots:
            ax.plot(*zip(*dots), linestyle='none', marker='o', markersize=2,
                    color=color, alpha=0.6)
    for row, label in enumerate(('train loss', 'validation loss')):
      ax = axes[row][col]
      ax.set_title(f'lr {lr:g}: {label}')
      ax.grid(alpha=0.3)
      values = sorted(v for r in runs if r['lr'] == lr
                      for s, v in (r['train'], r['val'])[row]
                      if math.isfinite(v) and s >= r['steps'] // 10)
      if values:  # Zoom past the first tenth of training.
        lo, hi = values[0], values[int(0.95 * (len(values) - 1))]
        ax.set_ylim(lo - 0.05 * (hi - lo + 1e-3), hi + 0.1 * (hi - lo + 1e-3))
    axes[1][col].set_xlabel('step')
  # The legend goes where the most runs are (not every lr runs every variant).
  fullest = max(axes[0], key=lambda ax: len(ax.get_legend_handles_labels()[0]))
  if fullest.get_legend_handles_labels()[0]:
    fullest.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      description=__doc__.split('\n\n')[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--out-dir', default='runs/stability')
  parser.add_argument('--variants', nargs='*', default=[],
                      metavar='NAME=MODE:OVERRIDES',
                      help='runs besides bf16 and coat')
  parser.add_argument('--only', help='comma-separated variant names to run'
                      ' (default: all)')
  parser.add_argument('--lrs', default='1e-3,3e-3,1e-2')
  parser.add_argument('--seeds', default='0,1')
  parser.add_argument('--steps', type=int, default=800)
  parser.add_argument('--seq', type=int, default=512)
  parser.add_argument('--batch', type=int, default=16)
  parser.add_argument('--eval-every', type=int, default=100)
  parser.add_argument('--eval-batches', type=int, default=16)
  parser.add_argument('--config', default='configs/llama_125m.py')
  parser.add_argument('--data', default='stdlib', choices=('stdlib',
                                                           'shapes'),
                      help="the training data: 'stdlib' at --seq, or"
                      " 'shapes' (a VLM config's images and questions,"
                      ' whose text length is fixed; --seq is unused)')
  parser.add_argument('--set', nargs='*', default=[],
                      metavar='SECTION.FIELD=VALUE',
                      help='overrides for every run, before the variant\'s')
  parser.add_argument('--parallel', type=int, default=4)
  parser.add_argument('--deterministic', default=True,
                      action=argparse.BooleanOptionalAction,
                      help='XLA\'s deterministic GPU kernels, so that a run'
                      ' repeats to the bit (default; --no-deterministic'
                      ' for the faster, non-repeatable ones)')
  parser.add_argument('--budget-s', type=float, default=0,
                      help='start no run that might end after this many'
                      ' seconds (0: no limit)')
  parser.add_argument('--fresh', action='store_true',
                      help='rerun runs already finished in --out-dir')
  parser.add_argument('--report-only', metavar='DIR',
                      help='print the table of the run dirs in DIR, write'
                      ' its stability.md and stability.png, and exit')
  args = parser.parse_args(argv)
  if args.report_only:
    print(report(args.report_only))
    return 0
  try:
    variants = parse_variants(args.variants)
    lrs = [float(x) for x in args.lrs.split(',')]
    seeds = [int(x) for x in args.seeds.split(',')]
  except ValueError as e:
    parser.error(str(e))
  if args.only:
    unknown = set(args.only.split(',')) - set(variants)
    if unknown:
      parser.error(f'--only: {sorted(unknown)} are not variants; they are'
                   f' {sorted(variants)}.')
    variants = {k: v for k, v in variants.items()
                if k in args.only.split(',')}
  if args.parallel < 1:
    parser.error('--parallel must be >= 1.')
  if args.deterministic:
    try:
      check_deterministic(variants, args.set)
    except ValueError as e:
      parser.error(str(e))
  print(f'stability: {args.config}, data {args.data}, seq {args.seq},'
        f' batch {args.batch},'
        f' {args.steps} steps, lrs {lrs}, seeds {seeds}, variants'
        f' {list(variants)}, into {args.out_dir}', flush=True)
  os.makedirs(args.out_dir, exist_ok=True)
  try:
    run_all(args, variants, lrs, seeds)
  except ValueError as e:
    parser.error(str(e))
  print(report(args.out_dir))
  return 0


if __name__ == '__main__':
  sys.exit(main())
