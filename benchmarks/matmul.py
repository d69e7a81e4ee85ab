"""FP8 GEMMs: the Pallas Mosaic GPU kernels against cuBLASLt (RESULTS.md
"fp8-gemm", "fp8-gemm-block" and "fp8-gemm-block-in-step").

  PYTHONPATH=. python benchmarks/matmul.py --paired [--rounds 9] [--control]
  PYTHONPATH=. python benchmarks/matmul.py --block [--rounds 5] [--budget-s S]
  PYTHONPATH=. python benchmarks/matmul.py --in-step
  PYTHONPATH=. python benchmarks/matmul.py --accuracy

Operands are K-major, a (M, K) and b (N, K), out (M, N). cuBLASLt is XLA's
FP8 dot with precise accumulation (`DotAlgorithmPreset.ANY_F8_ANY_F8_F32`,
what `fp8_matmul(implementation='xla')` runs); the kernels are
`mosaic_gpu.fp8_matmul_mosaic` (per-tensor scale) and
`mosaic_gpu_block.fp8_matmul_block_scaled_mosaic` ('block' b scales: one per
128x128 block of b, as the layers run every GEMM), each with its own
`select_config` per shape.

  --paired    the per-tensor kernel against cuBLASLt at 8192^3 and the
              Llama-2-7B GEMMs (16384 tokens), bf16 out; --control adds
              cuBLASLt against itself, the A/A ratio that shows what the
              timing resolves.
  --block     the block-scaled kernel against the per-tensor kernel and
              cuBLASLt at the 7B and 1b GEMMs, bf16 out, its scales passed
              K-block first as the quantizers write them (nothing but the
              kernel runs per call).
  --in-step   the 1b block step's GEMMs in its orientations and dtypes
              (float32 wgrads), each after a memory-bound pass as in a step,
              GPU kernel time from a profiler trace, summed over the step's
              layers (beside `step_profile.py --gemms`).
  --accuracy  max |error| / max |reference| against float64, M = N = 1024,
              K up to 16384.

Paired timing: clocks drift between and within calls, so the GEMMs of one
shape are timed in mirrored rounds (f1 .. fn fn .. f1, batches of ~20 ms,
after >= 2 s of warm-up) and each ratio is taken per round: its median
and range over the rounds.
"""

import argparse
import functools
import json
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.fp8_matmul import mosaic_gpu
from pallas_kernels.fp8_matmul import mosaic_gpu_block

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
DIMS = (((1,), (1,)), ((), ()))
PRECISE = jax.lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32
T = 16384  # tokens a step: batch 8 x 2048


def _layer_gemms(prefix, layers):
  """(name, M, N, K, a dtype) of each projection (name, out, in) as forward
  (E4M3 x E4M3), dgrad dX = dY W and wgrad dW^T = dY^T X (the E5M2 gradient
  as a)."""
  return [shape for name, out, inp in layers for shape in (
      (f'{prefix} {name} fwd', T, out, inp, E4M3),
      (f'{prefix} {name} dgrad', T, inp, out, E5M2),
      (f'{prefix} {name} wgrad', out, inp, T, E5M2))]


# 8192^3, then Llama-2-7B's layers (Q/K/V fused) and the 1b model's.
SHAPES = [('8192^3', 8192, 8192, 8192, E4M3)] + _layer_gemms(
    '7B', (('qkv', 12288, 4096), ('o', 4096, 4096),
           ('gate/up', 22016, 4096), ('down', 4096, 11008)))
SHAPES_1B = _layer_gemms('1b', (('qkv', 2560, 2048), ('o', 2048, 2048),
                                ('gate/up', 5632, 2048),
                                ('down', 2048, 5632)))
GROUPS = (('7B layers', SHAPES[1:]), ('8192^3 and 7B', SHAPES),
          ('1b', SHAPES_1B), ('all', SHAPES + SHAPES_1B))

# The 1b block step's FP8 GEMMs as it runs them: (name, M, N, K, a dtype,
# b dtype, out dtype, calls per layer). wgrad is dW^T = X^T dY: a = X^T
# (E4M3, 1x128 tiles along tokens), b = dY^T (E5M2, 128x128 blocks),
# float32 out.
STEP_GEMMS_1B = [
    (f'1b {name} {kind}', *dims, calls)
    for name, out, inp, calls in (('qkv', 2560, 2048, 1), ('o', 2048, 2048, 1),
                                  ('gate/up', 5632, 2048, 2),
                                  ('down', 2048, 5632, 1))
    for kind, *dims in (
        ('fwd', T, out, inp, E4M3, E4M3, jnp.bfloat16),
        ('dgrad', T, inp, out, E5M2, E4M3, jnp.bfloat16),
        ('wgrad', inp, out, T, E4M3, E5M2, jnp.float32))]
NUM_LAYERS_1B = 22
FILLER_BYTES = 384 * 2**20  # a memory-bound pass between GEMMs
IN_STEP_REPS = 8


def operands(m, n, k, a_dtype, b_dtype=E4M3, seed=0):
  ka, kb = jax.random.split(jax.random.key(seed))
  a = jax.random.normal(ka, (m, k), jnp.float32).astype(a_dtype)
  b = jax.random.normal(kb, (n, k), jnp.float32).astype(b_dtype)
  return jax.block_until_ready((a, b))


def block_scales(m, n, k, seed=1):
  """Random positive float32 scales, K-block first: a's (K / 128, M), b's
  (K / 128, N / 128)."""
  ka, kb = jax.random.split(jax.random.key(seed))
  sa = jax.random.uniform(ka, (k // 128, m), jnp.float32, 0.5, 2.0)
  sb = jax.random.uniform(kb, (k // 128, -(-n // 128)), jnp.float32, 0.5,
                          2.0)
  return jax.block_until_ready((sa, sb))


def cublaslt(a, b, out_dtype=jnp.bfloat16):
  return jax.lax.dot_general(a, b, DIMS, precision=PRECISE,
                             preferred_element_type=out_dtype)


def per_tensor(a, b, scale=1.0, out_dtype=jnp.bfloat16, config=None):
  return mosaic_gpu.fp8_matmul_mosaic(a, b, jnp.float32(scale),
                                      out_dtype=out_dtype, config=config)


def block(a, b, sa, sb, out_dtype=jnp.bfloat16):
  """The block-scaled kernel on K-block-first scales (`block_scales`)."""
  return mosaic_gpu_block.fp8_matmul_block_scaled_mosaic(
      a, b, sa, sb, b_granularity='block', out_dtype=out_dtype,
      a_scale_transposed=True, b_scale_transposed=True)


def block_reference(a, b, sa, sb, rows):
  """float32 block-scaled product for a's `rows` (K-block-first scales),
  from the dequantized operands at HIGHEST precision."""
  a = a[rows].astype(jnp.float32) * jnp.repeat(sa.T[rows], 128, axis=1)
  b = b.astype(jnp.float32) * jnp.repeat(jnp.repeat(sb.T, 128, axis=0),
                                         128, axis=1)[:b.shape[0]]
  return jnp.dot(a, b.T, precision=jax.lax.Precision.HIGHEST)


@jax.jit
def rel_diff(out, ref):
  out = out.astype(jnp.float32)
  return jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref))


def _batch(f, args, inner):
  """Seconds per call over `inner` back-to-back calls."""
  t = time.perf_counter()
  for _ in range(inner):
    out = f(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t) / inner


def warm_up(seconds=2.0):
  """Runs cuBLASLt at 8192^3 for `seconds`: GPU clocks idle low."""
  a, b = operands(8192, 8192, 8192, E4M3)
  f = jax.jit(cublaslt)
  t0 = time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    jax.block_until_ready(f(a, b))


def time_mirrored(fns, args, rounds):
  """Seconds per call of each jitted f in fns, a list of `rounds` values
  per f. Each round times them all in mirrored order (f1 .. fn fn .. f1,
  batches of ~20 ms), so that clock drift within a round hits all alike."""
  inner = []
  for f in fns:
    jax.block_until_ready(f(*args))  # compile
    _batch(f, args, 3)
    inner.append(max(1, int(0.02 / _batch(f, args, 3))))
  times = [[] for _ in fns]
  order = list(range(len(fns)))
  for _ in range(rounds):
    t = [0.0] * len(fns)
    for i in order + order[::-1]:
      t[i] += _batch(fns[i], args, inner[i])
    for i, ti in enumerate(t):
      times[i].append(ti / 2)
  return times


def per_round(times, num, den):
  """(median, min, max) over the rounds of times[den] / times[num]: the
  speed of entry `num` relative to entry `den`."""
  r = [d / n for n, d in zip(times[num], times[den])]
  return statistics.median(r), min(r), max(r)


def parse_shapes(spec, default):
  """Indices into SHAPES + SHAPES_1B or MxNxK (E4M3 x E4M3), comma
  separated; `default` if empty."""
  if not spec:
    return default
  out = []
  for item in spec.split(','):
    if 'x' in item:
      m, n, k = map(int, item.split('x'))
      out.append((item, m, n, k, E4M3))
    else:
      out.append((SHAPES + SHAPES_1B)[int(item)])
  return out


def run_paired(args, log):
  """Per shape: each entry's speed against cuBLASLt precise per round; with
  --block the block-scaled kernel, and its speed against the per-tensor
  kernel."""
  default = SHAPES + SHAPES_1B if args.block else SHAPES
  shapes = parse_shapes(args.shapes, default)
  rounds = args.rounds or (5 if args.block else 9)
  warm_up()
  start, rows = time.perf_counter(), []
  for name, m, n, k, a_dtype in shapes:
    if args.budget_s and time.perf_counter() - start > args.budget_s:
      print(f'--budget-s spent: skipped {name} and the shapes after it',
            flush=True)
      break
    a, b = operands(m, n, k, a_dtype)
    sa, sb = block_scales(m, n, k)
    fns = {'pallas': jax.jit(lambda a, b, sa, sb: per_tensor(a, b)),
           'cublaslt': jax.jit(lambda a, b, sa, sb: cublaslt(a, b))}
    if args.block:
      fns['block'] = jax.jit(block)
    if args.control:
      fns['control'] = jax.jit(lambda a, b, sa, sb: cublaslt(a, b))
    ops = (a, b, sa, sb)
    sample = np.unique(np.linspace(0, m - 1, 64).astype(np.int32))
    ref = jax.jit(lambda a, b: cublaslt(a, b, jnp.float32))(a, b)
    row = dict(name=name, m=m, n=n, k=k, a=jnp.dtype(a_dtype).name,
               err=float(rel_diff(fns['pallas'](*ops), ref)))
    if args.block:
      row['block_err'] = float(rel_diff(
          fns['block'](*ops)[sample], block_reference(a, b, sa, sb, sample)))
    times = time_mirrored(list(fns.values()), ops, rounds)
    labels = list(fns)
    flops = 2.0 * m * n * k
    for label, t in zip(labels, times):
      row[f'{label}_tflops'] = flops / statistics.median(t) / 1e12
      if label != 'cublaslt':
        row[f'{label}_vs_cublaslt'] = per_round(
            times, labels.index(label), labels.index('cublaslt'))
    if args.block:
      row['block_vs_pallas'] = per_round(times, labels.index('block'), 0)
    rows.append(row)
    print(json.dumps(row), flush=True)
    del a, b, ref
  log['paired'] = rows
  print(paired_table(rows, args.block, args.control))


def paired_table(rows, with_block, control):
  ratio = lambda r: f'{r[0]:.3f} ({r[1]:.3f}..{r[2]:.3f})'
  head = ['GEMM', 'M x N x K', 'a', 'Pallas TFLOP/s', 'cuBLASLt TFLOP/s',
          'Pallas / cuBLASLt']
  if with_block:
    head += ['block TFLOP/s', 'block / Pallas', 'block / cuBLASLt']
  if control:
    head += ['cuBLASLt / cuBLASLt (A/A)']
  lines = ['| ' + ' | '.join(head) + ' |', '|---' * len(head) + '|']
  for r in rows:
    cells = [r['name'], f'{r["m"]}x{r["n"]}x{r["k"]}', r['a'],
             f'{r["pallas_tflops"]:.0f}', f'{r["cublaslt_tflops"]:.0f}',
             ratio(r['pallas_vs_cublaslt'])]
    if with_block:
      cells += [f'{r["block_tflops"]:.0f}', ratio(r['block_vs_pallas']),
                ratio(r['block_vs_cublaslt'])]
    if control:
      cells += [ratio(r['control_vs_cublaslt'])]
    lines.append('| ' + ' | '.join(cells) + ' |')
  for label, shapes in GROUPS:
    names = {s[0] for s in shapes}
    mine = [r for r in rows if r['name'] in names]
    if len(mine) < len(shapes):
      continue
    geomean = lambda key: statistics.geometric_mean(r[key][0] for r in mine)
    line = (f'geomean over {label} ({len(mine)}): Pallas / cuBLASLt'
            f' {geomean("pallas_vs_cublaslt"):.3f}')
    if with_block:
      line += (f', block / Pallas {geomean("block_vs_pallas"):.3f}, block /'
               f' cuBLASLt {geomean("block_vs_cublaslt"):.3f}')
    lines.append(line)
  return '\n'.join(lines)


def after_filler(gemm, reps=IN_STEP_REPS):
  """jit(f)(y, *args): `reps` calls of gemm(*args) in order, each after a
  memory-bound pass over y (float32), as GEMMs run in a train step between
  elementwise kernels rather than back to back; the barriers keep XLA from
  merging or reordering the equal calls."""
  def f(y, *args):
    total = jnp.float32(0)
    for _ in range(reps):
      y = y * 1.0001
      y, args = jax.lax.optimization_barrier((y, args))
      out = gemm(*args)
      out, y, args = jax.lax.optimization_barrier((out, y, args))
      total = total + out[0, 0].astype(jnp.float32)
    return y, total
  return jax.jit(f)


def traced_kernel_us(fns, args, kernels, calls=3):
  """{label: us per launch} of the GPU kernels whose names contain
  kernels[label], from a profiler trace of `calls` calls of each
  fns[label](*args)."""
  from benchmarks import step_profile  # noqa: PLC0415 (reads the trace)
  for f in fns.values():
    jax.block_until_ready(f(*args))  # compile and warm
  trace_dir = tempfile.mkdtemp(prefix='matmul_in_step_')
  with jax.profiler.trace(trace_dir):
    for f in fns.values():
      for _ in range(calls):
        jax.block_until_ready(f(*args))
  stats = step_profile.kernel_stats(trace_dir, calls)
  out = {}
  for label in fns:
    got = [(ms, n) for name, (ms, n) in stats.items() if kernels[label] in name]
    ms, n = sum(x for x, _ in got), sum(x for _, x in got)
    out[label] = 1e3 * ms / n if n else float('nan')
  return out


def run_in_step(args, log):
  """Each of STEP_GEMMS_1B as the block step runs it, by the block-scaled
  kernel, the per-tensor kernel and cuBLASLt precise; the sum over the
  step's layers."""
  del args
  warm_up()
  y = jnp.ones(FILLER_BYTES // 4, jnp.float32)
  kernels = {'block': 'fp8_matmul_block_mosaic', 'per-tensor Pallas':
             'fp8_matmul_mosaic', 'cuBLASLt precise': 'nvjet'}
  step_ms, rows = dict.fromkeys(kernels, 0.0), []
  print('| GEMM | M x N x K | a x b -> out | '
        + ' | '.join(f'{k} us' for k in kernels)
        + ' | block / per-tensor | block / cuBLASLt |')
  print('|---' * (5 + len(kernels)) + '|', flush=True)
  for name, m, n, k, a_dtype, b_dtype, out_dtype, calls in STEP_GEMMS_1B:
    a, b = operands(m, n, k, a_dtype, b_dtype)
    sa, sb = block_scales(m, n, k)
    gemms = (functools.partial(block, out_dtype=out_dtype),
             lambda a, b, sa, sb, o=out_dtype: per_tensor(a, b, 0.75, o),
             lambda a, b, sa, sb, o=out_dtype: cublaslt(a, b, o))
    fns = {label: functools.partial(after_filler(g), y)
           for label, g in zip(kernels, gemms)}
    us = traced_kernel_us(fns, (a, b, sa, sb), kernels)
    for label, x in us.items():
      step_ms[label] += x * calls * NUM_LAYERS_1B / 1e3
    rows.append(dict(name=name, m=m, n=n, k=k, out=jnp.dtype(out_dtype).name,
                     calls_per_layer=calls, us=us))
    dtypes = ' x '.join(jnp.dtype(d).name for d in (a_dtype, b_dtype))
    print(f'| {name} | {m}x{n}x{k} | {dtypes} -> {rows[-1]["out"]} | '
          + ' | '.join(f'{us[x]:.1f}' for x in kernels)
          + f' | {us["per-tensor Pallas"] / us["block"]:.3f}'
          f' | {us["cuBLASLt precise"] / us["block"]:.3f} |', flush=True)
  log['in_step'] = dict(rows=rows, step_ms=step_ms)
  print(f'Sum over {NUM_LAYERS_1B} layers (ms a step): ' + ', '.join(
      f'{x} {v:.1f}' for x, v in step_ms.items()))


def run_accuracy(args, log):
  """Max relative error against float64 of the per-tensor kernel with and
  without promotion, and of cuBLASLt's fast and precise accumulation."""
  del args
  no_promotion = mosaic_gpu.Config(block_m=256, block_k=128, promote=False,
                                   split_k=1)
  variants = {
      'Pallas (promote every 128)': lambda a, b: per_tensor(
          a, b, out_dtype=jnp.float32),
      'Pallas, no promotion': lambda a, b: per_tensor(
          a, b, out_dtype=jnp.float32, config=no_promotion),
      'cuBLASLt precise': lambda a, b: cublaslt(a, b, jnp.float32),
      'cuBLASLt fast': lambda a, b: jax.lax.dot_general(
          a, b, DIMS, preferred_element_type=jnp.float32)}
  rows = []
  for dist in ('uniform', 'normal'):
    draw = jax.random.uniform if dist == 'uniform' else jax.random.normal
    for a_dtype in (E4M3, E5M2):
      for k in (1024, 4096, 16384):
        ka, kb = jax.random.split(jax.random.key(k))
        a = draw(ka, (1024, k)).astype(a_dtype)
        b = draw(kb, (1024, k)).astype(E4M3)
        ref = (np.asarray(a.astype(jnp.float32), np.float64)
               @ np.asarray(b.astype(jnp.float32), np.float64).T)
        row = dict(dist=dist, a=jnp.dtype(a_dtype).name, k=k)
        for label, f in variants.items():
          out = np.asarray(jax.jit(f)(a, b), np.float64)
          row[label] = float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))
        rows.append(row)
  log['accuracy'] = rows
  print('| inputs | a | K | ' + ' | '.join(variants) + ' |')
  print('|---' * (3 + len(variants)) + '|')
  for r in rows:
    print(f'| {r["dist"]} | {r["a"]} | {r["k"]} | '
          + ' | '.join(f'{r[v]:.1e}' for v in variants) + ' |')


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      description=__doc__.split('\n\n')[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  what = parser.add_mutually_exclusive_group(required=True)
  for flag in ('--paired', '--block', '--in-step', '--accuracy'):
    what.add_argument(flag, action='store_true')
  parser.add_argument('--rounds', type=int, default=0,
                      help='mirrored rounds a shape (default: 9, --block 5)')
  parser.add_argument('--shapes', default='',
                      help='indices into SHAPES + SHAPES_1B, or MxNxK,'
                      ' comma separated (default: 8192^3 and the 7B'
                      ' GEMMs; with --block the 1b GEMMs too)')
  parser.add_argument('--control', action='store_true',
                      help='also time cuBLASLt against itself')
  parser.add_argument('--budget-s', type=float, default=0,
                      help='start no new shape after this many seconds')
  parser.add_argument('--out', help='write the results as JSON')
  args = parser.parse_args(argv)
  log = dict(device=jax.devices()[0].device_kind, jax=jax.__version__)
  print(log, flush=True)
  run = (run_in_step if args.in_step else run_accuracy if args.accuracy
         else run_paired)
  run(args, log)
  if args.out:
    with open(args.out, 'w') as f:
      json.dump(log, f, indent=1, default=str)
  return 0


if __name__ == '__main__':
  main()
