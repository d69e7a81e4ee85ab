"""SM clock and board power while the FP8 GEMMs run: clocks or efficiency?

  PYTHONPATH=. python3 benchmarks/matmul_power.py
  PYTHONPATH=. python3 benchmarks/matmul_power.py --shapes all --repeats 3
  PYTHONPATH=. python3 benchmarks/matmul_power.py --configs 1,19  # SWEEP

For each shape, runs the Pallas kernel (select_config, or each `--configs`
index into matmul.py's SWEEP) and cuBLASLt precise back to back for
`--seconds` each (alternating, `--repeats` times) while `nvidia-smi` samples
the SM clock and the power draw every 50 ms, and prints TFLOP/s, the mean
clock and power over each run's last 2/3, and TFLOP per clock cycle. If the
Pallas kernel runs at a lower clock under the power cap, it spends more
energy per FLOP; at equal clocks its gap is work per cycle. Last, per
shape, each Pallas impl's mean TFLOP/s over cuBLASLt's: the sustained
counterpart of `matmul.py --paired`, whose ~20 ms batches see the clocks of
bursts.
"""

import argparse
import collections
import functools
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402  pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # noqa: E402  pylint: disable=g-import-not-at-top
import matmul  # noqa: E402  pylint: disable=g-import-not-at-top

DEFAULT_SHAPES = '0,7,4'  # 8192^3, gate/up fwd, o fwd


def run_for(f, args, seconds):
  """(start, end, calls) of back-to-back calls for about `seconds`."""
  jax.block_until_ready(f(*args))
  t0 = time.time()
  calls = 0
  while time.time() - t0 < seconds:
    for _ in range(5):
      out = f(*args)
    calls += 5
    jax.block_until_ready(out)
  return t0, time.time(), calls


def pallas_impls(configs=()):
  """[(label, jitted Pallas GEMM)]: 'pallas' is select_config, 'pallas I'
  SWEEP config I."""
  pallas = [('pallas', None)] if not configs else [
      (f'pallas {i}', matmul.SWEEP[i]) for i in configs]
  return [(label, jax.jit(functools.partial(matmul.pallas, config=cfg)))
          for label, cfg in pallas]


def measure(specs, repeats, seconds, impls):
  """[(shape name, impl, start, end, FLOP/s)] of the alternating runs of
  `impls` (label, f(a, b, s)) and cuBLASLt precise."""
  runs = []
  impls = [*impls, ('precise', jax.jit(matmul.xla_precise))]
  for name, m, n, k, a_dtype in map(matmul.parse_shape, specs):
    a, b = matmul.operands(m, n, k, a_dtype)
    s = jnp.float32(0.75)
    for _ in range(repeats):
      for label, f in impls:
        t0, t1, calls = run_for(f, (a, b, s), seconds)
        runs.append((name, label, t0, t1, 2.0 * m * n * k * calls / (t1 - t0)))
    del a, b
  return runs


def sampled(run):
  """(run(), [(unix time, SM MHz, W)]): nvidia-smi samples every 50 ms."""
  # To a file: a pipe read only at the end fills up and stalls nvidia-smi.
  smi_path = os.path.join(os.environ.get('OUT', '.'), 'smi.csv')
  with open(smi_path, 'w') as smi_file:
    smi = subprocess.Popen(
        ['nvidia-smi', '--query-gpu=timestamp,clocks.sm,power.draw',
         '--format=csv,noheader,nounits', '-lms', '50'], stdout=smi_file,
        text=True)
    try:
      result = run()
      time.sleep(0.2)
    finally:
      smi.terminate()
      smi.wait()
  with open(smi_path) as f:
    lines = f.readlines()
  samples = []
  for line in lines:
    stamp, mhz, watts = [x.strip() for x in line.split(',')]
    t = time.mktime(time.strptime(stamp.split('.')[0], '%Y/%m/%d %H:%M:%S'))
    t += float('0.' + stamp.split('.')[1]) if '.' in stamp else 0.0
    samples.append((t, float(mhz), float(watts)))
  return result, samples


def report(runs, samples):
  """Prints each run's TFLOP/s, clock and power, then each impl's mean
  TFLOP/s over cuBLASLt precise's per shape."""
  print('\n| GEMM | impl | TFLOP/s | SM MHz | W | TFLOP per 1e9 cycles |')
  print('|---|---|---|---|---|---|')
  for name, label, t0, t1, flops in runs:
    lo = t0 + (t1 - t0) / 3
    window = [(mhz, w) for t, mhz, w in samples if lo <= t <= t1]
    if not window:
      print(f'| {name} | {label} | {flops / 1e12:.0f} | n/a | n/a | |')
      continue
    mhz = statistics.mean(x for x, _ in window)
    watts = statistics.mean(w for _, w in window)
    print(f'| {name} | {label} | {flops / 1e12:.0f} | {mhz:.0f} |'
          f' {watts:.0f} | {flops / 1e12 / (mhz / 1e3):.0f} |')
  labels = list(dict.fromkeys(r[1] for r in runs if r[1] != 'precise'))
  print('\nMean TFLOP/s over the runs, Pallas / cuBLASLt precise:')
  print('\n| GEMM | ' + ' | '.join(labels) + ' |')
  print('|---|' + '---|' * len(labels))
  tflops = collections.defaultdict(list)
  for name, label, *_, flops in runs:
    tflops[name, label].append(flops)
  ratios = collections.defaultdict(dict)  # impl -> shape -> ratio
  for name in dict.fromkeys(r[0] for r in runs):
    precise = statistics.mean(tflops[name, 'precise'])
    for label in labels:
      ratios[label][name] = statistics.mean(tflops[name, label]) / precise
    print(f'| {name} | ' + ' | '.join(
        f'{ratios[x][name]:.3f}' for x in labels) + ' |')
  for label in labels:
    llama = [v for k, v in ratios[label].items() if k != matmul.SHAPES[0][0]]
    if len(llama) > 1:
      print(f'{label}: geomean over {len(llama)} shapes but 8192^3:'
            f' {statistics.geometric_mean(llama):.3f}')


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--shapes', default=DEFAULT_SHAPES,
                 help="as matmul.py --shapes, or 'all' (default: 0,7,4)")
  p.add_argument('--repeats', type=int, default=2,
                 help='alternations of the impls per shape')
  p.add_argument('--seconds', type=float, default=3.0,
                 help='seconds per run')
  p.add_argument('--configs', default='',
                 help='SWEEP indices in matmul.py, each its own Pallas impl'
                      ' (default: select_config)')
  args = p.parse_args()
  specs = (args.shapes.split(',') if args.shapes != 'all' else
           [str(i) for i in range(len(matmul.SHAPES))])
  print(f'# {jax.devices()[0].device_kind}, jax {jax.__version__},'
        f' {time.strftime("%Y-%m-%d %H:%M:%S")}', flush=True)
  matmul.global_warmup(2.0)
  configs = [int(i) for i in args.configs.split(',') if i]
  runs, samples = sampled(lambda: measure(
      specs, args.repeats, args.seconds, pallas_impls(configs)))
  report(runs, samples)


if __name__ == '__main__':
  main()
