"""FP8 matmul benchmark: Pallas Mosaic GPU and Triton vs cuBLASLt and BF16.

  python3 benchmarks/matmul.py                 # 8192^3 + Llama-2-7B shapes
  python3 benchmarks/matmul.py --sweep         # Pallas tile configs
  python3 benchmarks/matmul.py --accuracy      # error vs K, all paths
  python3 benchmarks/matmul.py --all           # sweep, then main with the best
  python3 benchmarks/matmul.py --groups        # FP8 1x16 grouped output
  python3 benchmarks/matmul.py --paired        # Pallas / cuBLASLt, paired
  python3 benchmarks/matmul.py --paired --shapes 0 --rounds 61   # 8192^3 only
  python3 benchmarks/matmul.py --paired --shapes 0 --control  # + A/A row
  python3 benchmarks/matmul.py --paired --paired-config 1,11 \
      --shapes 0,8448x8064x8192     # two SWEEP configs, any M x N x K
  python3 benchmarks/matmul.py --k-lines --configs 1,11   # time against K
  python3 benchmarks/matmul.py --sweep --semantics warpgroup   # Mosaic's other
  python3 benchmarks/matmul.py --skip bf16 --triton-configs 0   # shorter
  python3 benchmarks/matmul.py --block [--quick]   # block-scaled, paired
  python3 benchmarks/matmul.py --block --shapes 4,3:row,2048x2048x16384:row
      # ':row': per-row b scales (the layers run 'block' everywhere)
  python3 benchmarks/matmul.py --in-step   # the 1b block step's GEMMs, each
      # after a memory-bound pass as in the step, kernel time from a trace

All operands are K-major: a (M, K), b (N, K); out (M, N) bfloat16 with the
two per-tensor scales applied. Timing: >= 2 s of warm-up, then the median over
many repetitions of back-to-back calls closed by block_until_ready. FLOPs =
2 M N K. Peak: 1979 TFLOP/s (H100 SXM dense FP8).

The Triton column (`pallas_kernels/fp8_matmul/triton_peer.py`, through
jax_triton) is the fastest of `triton_peer.CONFIGS` per shape (a short timing
of each, then the full timing of the winner; its config is printed). Without
jax_triton the column reads n/a and the reason is printed once.
"""

import argparse
import dataclasses
import datetime
import functools
import json
import os
import re
import statistics
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp
import numpy as np

from pallas_kernels.fp8_matmul import api  # pylint: disable=g-import-not-at-top
from pallas_kernels.fp8_matmul import mosaic_gpu
from pallas_kernels.fp8_matmul import mosaic_gpu_block
from pallas_kernels.fp8_matmul import triton_peer
from pallas_kernels.quantize_per_group import api as group_api

PEAK_TFLOPS = 1979.0
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
DIMS = (((1,), (1,)), ((), ()))
T = 16384  # tokens per step
# (name, M, N, K, a dtype). Llama-2-7B layers, forward E4M3 x E4M3;
# dgrad dX = dY W and wgrad dW = dY^T X take the E5M2 gradient as a.
SHAPES = [
    ('square 8192^3', 8192, 8192, 8192, E4M3),
    ('qkv fwd', T, 12288, 4096, E4M3),
    ('qkv dgrad', T, 4096, 12288, E5M2),
    ('qkv wgrad', 12288, 4096, T, E5M2),
    ('o fwd', T, 4096, 4096, E4M3),
    ('o dgrad', T, 4096, 4096, E5M2),
    ('o wgrad', 4096, 4096, T, E5M2),
    ('gate/up fwd', T, 22016, 4096, E4M3),
    ('gate/up dgrad', T, 4096, 22016, E5M2),
    ('gate/up wgrad', 22016, 4096, T, E5M2),
    ('down fwd', T, 4096, 11008, E4M3),
    ('down dgrad', T, 11008, 4096, E5M2),
    ('down wgrad', 4096, 11008, T, E5M2),
]


def xla_fast(a, b, s):
  """cuBLASLt FP8, XLA's default (fast) accumulation, BF16 out, no scale."""
  del s
  return jax.lax.dot_general(a, b, DIMS, preferred_element_type=jnp.bfloat16)


def xla_precise(a, b, s):
  """cuBLASLt FP8, precise accumulation (ANY_F8_ANY_F8_F32), BF16 out."""
  del s
  return jax.lax.dot_general(
      a, b, DIMS, precision=jax.lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32,
      preferred_element_type=jnp.bfloat16)


def xla_api(a, b, s):
  """The 'xla' implementation of fp8_matmul: f32 out, then scale and cast."""
  return api.fp8_matmul(a, b, s, 1.0, implementation='xla')


def bf16(a, b, s):
  del s
  return jax.lax.dot_general(a, b, DIMS, preferred_element_type=jnp.bfloat16)


BEST = [None]  # the config run_sweep found fastest, used by run_main


def pallas(a, b, s, config=None):
  return mosaic_gpu.fp8_matmul_mosaic(a, b, s, out_dtype=jnp.bfloat16,
                                      config=config or BEST[0])


def triton(a, b, s, config=None):
  return triton_peer.fp8_matmul_triton(a, b, s, out_dtype=jnp.bfloat16,
                                       config=config)


def triton_why_not():
  """None if the Triton peer runs here; else the reason, printed once."""
  why = triton_peer.unavailable_reason()
  if why is not None and not _TRITON_NOTE:
    _TRITON_NOTE.append(why)
    print(f'triton column: n/a ({why})', flush=True)
  return why


_TRITON_NOTE = []


def best_triton(a, b, s, flops, which=''):
  """Times triton_peer.CONFIGS briefly; returns (config, jitted fn).

  Args:
    which: comma-separated indices into CONFIGS ('' for all).

  Returns (None, None) if none ran. Each try is printed.
  """
  best = (None, None, 0.0)
  for i, cfg in enumerate(triton_peer.CONFIGS):
    if which and str(i) not in which.split(','):
      continue
    try:
      jf = jax.jit(lambda a, b, s, cfg=cfg: triton(a, b, s, cfg))
      jax.block_until_ready(jf(a, b, s))
      med, _, _ = time_fn(jf, (a, b, s), warmup_s=0.05, reps=5)
      tflops = flops / med / 1e12
      print(f'  triton {cfg.short()}: {tflops:.0f} TFLOP/s', flush=True)
      if tflops > best[2]:
        best = (cfg, jf, tflops)
    except Exception as e:  # pylint: disable=broad-except
      print(f'  triton {cfg.short()}: {type(e).__name__}: {str(e)[:300]}',
            flush=True)
  return best[0], best[1]


def operands(m, n, k, a_dtype, seed=0):
  ka, kb = jax.random.split(jax.random.key(seed))
  a = jax.random.normal(ka, (m, k), jnp.float32).astype(a_dtype)
  b = jax.random.normal(kb, (n, k), jnp.float32).astype(E4M3)
  return jax.block_until_ready((a, b))


def _batch(f, args, inner):
  """Seconds per call over `inner` back-to-back calls."""
  t = time.perf_counter()
  for _ in range(inner):
    out = f(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t) / inner


def time_fn(f, args, *, warmup_s=0.3, reps=21, inner=None):
  """Median seconds per call of jitted f(*args)."""
  jax.block_until_ready(f(*args))
  t0 = time.perf_counter()
  n = 0
  while time.perf_counter() - t0 < warmup_s:
    out = f(*args)
    n += 1
  jax.block_until_ready(out)
  per = (time.perf_counter() - t0) / max(n, 1)
  inner = inner or max(1, min(50, int(0.02 / per)))
  times = [_batch(f, args, inner) for _ in range(reps)]
  return statistics.median(times), min(times), max(times)


def time_mirrored(fns, args, rounds):
  """Seconds per call of each jitted f in fns, one list of `rounds` values
  per f. Each round times all of them in mirrored order (f1 .. fn fn .. f1,
  batches of ~20 ms), so clock drift within a round hits all alike and
  ratios are best taken per round."""
  inner = []
  for f in fns:
    time_fn(f, args, reps=1)  # compile and warm
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


def global_warmup(seconds=2.0):
  a, b = operands(8192, 8192, 8192, E4M3)
  f = jax.jit(xla_fast)
  s = jnp.float32(1.0)
  jax.block_until_ready(f(a, b, s))
  t0 = time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    jax.block_until_ready(f(a, b, s))


def hlo_check(a, b):
  """Custom-call targets of the compiled XLA paths."""
  s = jnp.float32(1.0)
  res = {}
  for name, f in (('xla_fast', xla_fast), ('xla_precise', xla_precise),
                  ('xla_api', xla_api)):
    txt = jax.jit(f).lower(a, b, s).compile().as_text()
    res[name] = {
        'cublaslt_f8': '__cublas$lt$matmul$f8' in txt,
        'fusions': txt.count(' fusion('),
    }
  return res


def cublas_algorithm(f, args) -> str:
  """The cuBLASLt algorithm(s) XLA's autotuner picked for jitted f(*args)
  ('selected_algorithm' of each GEMM custom call; it can differ between
  processes, which would move a ratio to cuBLASLt from one call to the
  next)."""
  txt = f.lower(*args).compile().as_text()
  return ','.join(re.findall(r'"selected_algorithm":"?(-?[0-9]+)', txt)) or '?'


def relerr(out, ref):
  out = np.asarray(out, np.float64)
  return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


def precise_ref(a, b, s):
  """f32 result of the cuBLASLt precise path (scaled), to check outputs."""
  return jax.jit(lambda a, b: api.fp8_matmul(
      a, b, s, 1.0, out_dtype=jnp.float32, implementation='xla'))(a, b)


@jax.jit
def rel_diff(out, ref):
  out = out.astype(jnp.float32)
  return jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref))


def check_close(out, a, b, s, ref=None):
  """Relative max difference of out from the f32 cuBLASLt precise result."""
  ref = precise_ref(a, b, s) if ref is None else ref
  return float(rel_diff(out, ref))


def run_main(args, log):
  t_start = time.perf_counter()
  global_warmup(2.0)
  rows = []
  impls = [('pallas', pallas), ('triton', None), ('xla_fast', xla_fast),
           ('xla_precise', xla_precise), ('xla_api', xla_api), ('bf16', bf16)]
  log['pallas_config'] = str(BEST[0] or 'select_config per shape')
  print('pallas config:', log['pallas_config'], flush=True)
  log['triton_unavailable'] = triton_why_not()
  shapes = SHAPES if not args.quick else SHAPES[:1]
  for name, m, n, k, a_dtype in shapes:
    a, b = operands(m, n, k, a_dtype)
    s = jnp.float32(0.75)
    flops = 2.0 * m * n * k
    res = {}
    if name.startswith('square'):
      log['hlo'] = hlo_check(a, b)
      print('hlo:', log['hlo'], flush=True)
    ref = precise_ref(a, b, s)
    for iname, f in impls:
      if iname in args.skip.split(','):
        continue
      try:
        extra = {}
        if iname == 'triton':
          if triton_why_not() is not None:
            res[iname] = dict(error='n/a')
            continue
          cfg, jf = best_triton(a, b, s, flops, args.triton_configs)
          if jf is None:
            res[iname] = dict(error='no config ran')
            continue
          extra['config'] = cfg.short()
        else:
          jf = jax.jit(f)
        if iname == 'bf16':
          xa, xb = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
        else:
          xa, xb = a, b
        out = jf(xa, xb, s)
        scaled = iname in ('pallas', 'triton', 'xla_api')
        err = check_close(out, a, b, s, ref) if scaled else None
        med, lo, hi = time_fn(jf, (xa, xb, s))
        res[iname] = dict(ms=med * 1e3, lo=lo * 1e3, hi=hi * 1e3,
                          tflops=flops / med / 1e12, err=err, **extra)
        del out, xa, xb
      except Exception as e:  # pylint: disable=broad-except
        traceback.print_exc()
        res[iname] = dict(error=f'{type(e).__name__}: {str(e)[:200]}')
    rows.append(dict(name=name, m=m, n=n, k=k, a=jnp.dtype(a_dtype).name,
                     res=res))
    del a, b, ref
    print(json.dumps(rows[-1]), flush=True)
    print(f'elapsed {time.perf_counter() - t_start:.0f} s', flush=True)
  log['main'] = rows
  print_main(rows)


def print_main(rows):
  """Markdown table; the Triton config and its ratio to Pallas per shape."""
  names = ('pallas', 'triton', 'xla_fast', 'xla_precise', 'xla_api', 'bf16')
  print('\n| GEMM | M | N | K | A | Pallas | Triton | cuBLASLt fast'
        ' | cuBLASLt precise | xla api path | BF16 | Pallas / precise'
        ' | Triton / Pallas | Pallas % peak | Pallas err | Triton err'
        ' | Triton config |')
  print('|---' * 17 + '|')
  faster = []
  for r in rows:
    res = r['res']
    tf = {k: v.get('tflops') for k, v in res.items()}
    cells = []
    for i in names:
      if tf.get(i):
        cells.append(f'{tf[i]:.0f}')
      else:
        err = res.get(i, {}).get('error')
        cells.append('-' if i not in res else 'n/a' if err == 'n/a' else 'ERR')
    ratio = (f'{tf["pallas"] / tf["xla_precise"]:.2f}'
             if tf.get('pallas') and tf.get('xla_precise') else '-')
    vs = (f'{tf["triton"] / tf["pallas"]:.2f}'
          if tf.get('triton') and tf.get('pallas') else '-')
    if tf.get('triton') and tf.get('pallas') and tf['triton'] > tf['pallas']:
      faster.append(r['name'])
    pk = f'{100 * tf["pallas"] / PEAK_TFLOPS:.0f}%' if tf.get('pallas') else '-'
    errs = []
    for i in ('pallas', 'triton'):
      e = res.get(i, {}).get('err')
      errs.append(f'{e:.1e}' if e is not None else '-')
    cfg = res.get('triton', {}).get('config', '-')
    print(f'| {r["name"]} | {r["m"]} | {r["n"]} | {r["k"]} | {r["a"]} | '
          + ' | '.join(cells) + f' | {ratio} | {vs} | {pk} | '
          + ' | '.join(errs) + f' | {cfg} |')
  if _TRITON_NOTE:
    print(f'\nTriton: n/a ({_TRITON_NOTE[0]})')
  else:
    print('\nTriton faster than Pallas on: '
          + (', '.join(faster) if faster else 'no shape'))


C = mosaic_gpu.Config
_three = functools.partial(dataclasses.replace, mosaic_gpu.THREE_WG_CONFIG)
SWEEP = [
    C(block_k=128, split_k=1),
    C(block_k=256, split_k=2),  # DEFAULT_CONFIG
    C(block_n=256, block_k=128, promote=False, split_k=1),  # fast acc.
    # Tile walk and staging around the default (3-6).
    C(block_k=256, split_k=2, grid_tile_width=4),
    C(block_k=256, split_k=2, grid_tile_width=16),
    C(block_k=256, split_k=2, grid_minor_m=False),
    C(block_k=128, split_k=1, max_stages=6),
    # cuBLASLt's own tiles here (`cublas_kernels.py`: nvjet 144x128 and
    # 128x160, K step 128, 6 and 5 stages), edges left to TMA (7, 8).
    C(block_n=144, block_k=128, split_k=1, max_stages=6, pad_mn=False),
    C(block_n=160, block_k=128, split_k=1, max_stages=5, pad_mn=False),
    # 144 wide with the default's K step 256 in two wgmmas (9).
    C(block_n=144, block_k=256, split_k=2, pad_mn=False),
    # Three compute warpgroups of 64 rows (10-12; 11 is THREE_WG_CONFIG),
    # then other tile walks (13-15).
    _three(max_stages=5),
    _three(),
    _three(pad_mn=True),
    _three(grid_tile_width=4),
    _three(grid_tile_width=16),
    _three(grid_minor_m=False),
    # Stages released after the FP32 adds (16: THREE_WG_CONFIG before
    # early_release), and before them in the default (17).
    _three(early_release=False),
    C(block_k=256, split_k=2, early_release=True),
    # THREE_WG_CONFIG draining between tiles (18: before overlap_tiles).
    _three(overlap_tiles=False),
    # Two warpgroups with overlapped tiles: K step 128 on 4 stages (19),
    # releasing stages early (20).
    C(block_k=128, split_k=1, overlap_tiles=True),
    C(block_k=128, split_k=1, overlap_tiles=True, early_release=True),
]


def run_sweep(args, log):
  global_warmup(2.0)
  rows = []
  shapes = [SHAPES[0], SHAPES[3], SHAPES[4]]  # 8192^3, qkv wgrad, o fwd
  for name, m, n, k, a_dtype in shapes:
    a, b = operands(m, n, k, a_dtype)
    s = jnp.float32(0.75)
    flops = 2.0 * m * n * k
    ref = precise_ref(a, b, s)
    for f, label in ((xla_precise, 'xla_precise'), (xla_fast, 'xla_fast')):
      med, _, _ = time_fn(jax.jit(f), (a, b, s))
      rows.append(dict(shape=name, cfg=label, tflops=flops / med / 1e12,
                       err=None))
      print(rows[-1], flush=True)
    for cfg in SWEEP:
      if args.configs and str(SWEEP.index(cfg)) not in args.configs.split(','):
        continue
      try:
        jf = jax.jit(lambda a, b, s, cfg=cfg: pallas(a, b, s, cfg))
        t0 = time.perf_counter()
        out = jax.block_until_ready(jf(a, b, s))
        compile_s = time.perf_counter() - t0
        err = check_close(out, a, b, s, ref)
        med, _, _ = time_fn(jf, (a, b, s))
        rows.append(dict(shape=name, cfg=str(cfg), tflops=flops / med / 1e12,
                         err=err, compile_s=compile_s))
      except Exception as e:  # pylint: disable=broad-except
        traceback.print_exc()
        rows.append(dict(shape=name, cfg=str(cfg),
                         error=f'{type(e).__name__}: {str(e)[:300]}'))
      print(rows[-1], flush=True)
    del a, b, ref
  log['sweep'] = rows
  # Fastest config as precise as cuBLASLt (promotion every <= 128 of K), by
  # mean TFLOP/s over the shapes.
  precise = {str(c) for c in SWEEP
             if c.promote and c.block_k // c.split_k <= 128}
  score = {}
  for r in rows:
    if 'tflops' in r and r['cfg'] in precise:
      score.setdefault(r['cfg'], []).append(r['tflops'])
  score = {c: sum(v) / len(v) for c, v in score.items()
           if len(v) == len(shapes)}
  if score:
    best = max(score, key=score.get)
    BEST[0] = next(c for c in SWEEP if str(c) == best)
    log['best'] = best
  print('\n| shape | config | TFLOP/s | err vs precise |')
  print('|---|---|---|---|')
  for r in rows:
    cfg = r['cfg'].replace('Config', '').replace('block_', '')
    if 'error' in r:
      print(f'| {r["shape"]} | {cfg} | ERROR {r["error"][:120]} | |')
    else:
      err = '-' if r['err'] is None else f'{r["err"]:.1e}'
      print(f'| {r["shape"]} | {cfg} | {r["tflops"]:.0f} | {err} |')


# 4092 = 31 x 132 tiles of 128 x 128: no partial last wave on 132 SMs, where
# 8192^3 (4096 tiles) runs a 32nd round of tiles on 4 SMs only.
WAVE_SHAPE = ('whole waves 7936x8448x8192', 7936, 8448, 8192, E4M3)


def parse_shape(spec):
  """An index into SHAPES + [WAVE_SHAPE], or MxNxK (E4M3 x E4M3)."""
  if 'x' in spec:
    m, n, k = map(int, spec.split('x'))
    return (spec, m, n, k, E4M3)
  return (SHAPES + [WAVE_SHAPE])[int(spec)]


def _tile(cfg):
  return f'{cfg.block_m}x{cfg.block_n}, {cfg.compute_wgs} wgs'


def run_paired(args, log):
  """Pallas / cuBLASLt precise per shape as the median of paired ratios.

  Clocks drift between and within calls (cuBLASLt precise at 8192^3 measured
  1194 and 1276 TFLOP/s in two calls of one session), so every Pallas config
  and cuBLASLt are timed together by `time_mirrored` and the ratio is taken
  per round. `--control` adds cuBLASLt precise itself as one more entry: its
  ratio (A/A) is what the timing can resolve.
  """
  configs = [None]  # select_config per shape
  if args.paired_config:
    configs = [SWEEP[int(i)] for i in args.paired_config.split(',')]
  print('pallas configs:', configs, flush=True)
  labels = args.paired_config.split(',') if args.paired_config else ['select']
  if args.control:
    labels.append('control')
  global_warmup(2.0)
  rounds = args.rounds or (5 if args.quick else 15)
  rows = []
  specs = (args.shapes.split(',') if args.shapes else
           [str(i) for i in range(len(SHAPES) + 1)])
  for name, m, n, k, a_dtype in map(parse_shape, specs):
    a, b = operands(m, n, k, a_dtype)
    s = jnp.float32(0.75)
    flops = 2.0 * m * n * k
    fns = [jax.jit(functools.partial(pallas, config=c)) for c in configs]
    errs = [check_close(f(a, b, s), a, b, s) for f in fns]  # ~3e-3
    tiles = [_tile(c or mosaic_gpu.select_config(m, n)) for c in configs]
    if args.control:  # cuBLASLt precise against itself: the A/A resolution
      fns.append(jax.jit(xla_precise))
      errs.append(None)
      tiles.append('cuBLASLt precise')
    fns.append(jax.jit(xla_precise))
    algo = cublas_algorithm(fns[-1], (a, b, s))
    times = time_mirrored(fns, (a, b, s), rounds)
    for j, label in enumerate(labels):
      ratios = [x / p for x, p in zip(times[-1], times[j])]
      rows.append(dict(
          name=name, m=m, n=n, k=k, a=jnp.dtype(a_dtype).name,
          config=tiles[j], sweep=label,
          pallas=flops / statistics.median(times[j]) / 1e12,
          precise=flops / statistics.median(times[-1]) / 1e12,
          ratio=statistics.median(ratios), lo=min(ratios), hi=max(ratios),
          err=errs[j], cublas_algorithm=algo))
      print(json.dumps(rows[-1]), flush=True)
    del a, b
  log['paired'] = rows
  print('\n| GEMM | M | N | K | A | Pallas tile (SWEEP) | Pallas TFLOP/s |'
        ' cuBLASLt precise | Pallas / precise (median) |'
        ' min..max over rounds |')
  print('|---|---|---|---|---|---|---|---|---|---|')
  for r in rows:
    print(f'| {r["name"]} | {r["m"]} | {r["n"]} | {r["k"]} | {r["a"]} |'
          f' {r["config"]} ({r["sweep"]}) | {r["pallas"]:.0f} |'
          f' {r["precise"]:.0f} | {r["ratio"]:.3f} |'
          f' {r["lo"]:.3f}..{r["hi"]:.3f} |')
  llama_names = {s[0] for s in SHAPES[1:]}
  for j in range(len(configs)):  # not the control
    llama = [r['ratio'] for r in rows[j::len(labels)]
             if r['name'] in llama_names]
    if llama:
      geomean = statistics.geometric_mean(llama)
      print(f'geomean over the {len(llama)} Llama shapes'
            f' ({rows[j]["sweep"]}): {geomean:.3f}')


def run_k_lines(args, log):
  """Time against K at M = N = 8192: t(K) = fixed + K / rate.

  The slope gives the mainloop's rate (TFLOP/s with the fixed cost taken
  out), the intercept what does not grow with K: prologue, epilogue and
  pipeline drain per tile, launch. Pallas configs: `--configs` indices.
  """
  global_warmup(2.0)
  m = n = 8192
  ks = (2048, 4096, 8192, 16384)
  cfgs = [int(i) for i in args.configs.split(',')] if args.configs else [1]
  fns = {'xla_precise': jax.jit(xla_precise), 'xla_fast': jax.jit(xla_fast)}
  for i in cfgs:
    fns[f'pallas {i}'] = jax.jit(
        lambda a, b, s, cfg=SWEEP[i]: pallas(a, b, s, cfg))
  times = {name: [] for name in fns}
  for k in ks:
    a, b = operands(m, n, k, E4M3)
    s = jnp.float32(0.75)
    for name, f in fns.items():
      times[name].append(time_fn(f, (a, b, s))[0])
      print(name, k, times[name][-1], flush=True)
    del a, b
  rows = []
  for name, t in times.items():
    slope, fixed = np.polyfit(np.array(ks, float), np.array(t), 1)
    rows.append(dict(
        name=name, tflops=[2 * m * n * k / x / 1e12 for k, x in zip(ks, t)],
        mainloop_tflops=2 * m * n / slope / 1e12, fixed_us=fixed * 1e6))
  log['k_lines'] = dict(m=m, n=n, ks=ks, rows=rows)
  print(f'\n| M = N = {m}, K: | ' + ' | '.join(map(str, ks))
        + ' | mainloop (slope) TFLOP/s | fixed (intercept) us |')
  print('|---|' + '---|' * (len(ks) + 2))
  for r in rows:
    print(f'| {r["name"]} | ' + ' | '.join(f'{x:.0f}' for x in r['tflops'])
          + f' | {r["mainloop_tflops"]:.0f} | {r["fixed_us"]:.1f} |')


def run_accuracy(args, log):
  """Max relative error vs float64, M = N = 1024, like perf anchors (b)."""
  del args
  rows = []
  variants = [
      ('pallas promote/128', lambda a, b: pallas32(
          a, b, C(block_k=128, split_k=1))),
      ('pallas default', lambda a, b: pallas32(a, b, None)),
      ('pallas promote/256', lambda a, b: pallas32(
          a, b, C(block_k=256, split_k=1))),
      ('pallas no promote', lambda a, b: pallas32(
          a, b, C(block_m=256, block_k=128, promote=False, split_k=1))),
      ('triton promote/128', lambda a, b: triton32(a, b, None)),
      ('triton fast', lambda a, b: triton32(
          a, b, triton_peer.Config(promote_every=None))),
      ('xla fast', lambda a, b: jax.lax.dot_general(
          a, b, DIMS, preferred_element_type=jnp.float32)),
      ('xla precise', lambda a, b: api.fp8_matmul(
          a, b, 1.0, 1.0, out_dtype=jnp.float32, implementation='xla')),
  ]
  for dist in ('uniform', 'normal'):
    for a_dtype in (E4M3, E5M2):
      for k in (1024, 4096, 16384):
        ka, kb = jax.random.split(jax.random.key(k))
        if dist == 'uniform':
          a = jax.random.uniform(ka, (1024, k)).astype(a_dtype)
          b = jax.random.uniform(kb, (1024, k)).astype(E4M3)
        else:
          a = jax.random.normal(ka, (1024, k)).astype(a_dtype)
          b = jax.random.normal(kb, (1024, k)).astype(E4M3)
        a64 = np.asarray(a.astype(jnp.float32), np.float64)
        b64 = np.asarray(b.astype(jnp.float32), np.float64)
        ref = a64 @ b64.T
        row = dict(dist=dist, a=jnp.dtype(a_dtype).name, k=k)
        for label, f in variants:
          try:
            row[label] = relerr(jax.jit(f)(a, b), ref)
          except Exception as e:  # pylint: disable=broad-except
            row[label] = f'{type(e).__name__}: {str(e)[:100]}'
        rows.append(row)
        print(row, flush=True)
  log['accuracy'] = rows
  labels = [v[0] for v in variants]
  print('\n| inputs | A | K | ' + ' | '.join(labels) + ' |')
  print('|---' * (3 + len(labels)) + '|')
  for r in rows:
    cells = [f'{r[name]:.1e}' if isinstance(r[name], float) else
             'n/a' if r[name].endswith('n/a') else 'ERR' for name in labels]
    print(f'| {r["dist"]} | {r["a"]} | {r["k"]} | ' + ' | '.join(cells) + ' |')


GROUP_SHAPES = [SHAPES[0], SHAPES[7], SHAPES[1]]  # 8192^3, gate/up, qkv fwd


def run_groups(args, log):
  """FP8 1x16 grouped output: the fused epilogue vs GEMM, then quantize.

  Every variant returns (values, scales) of `quantize_per_group(y, 16)`;
  the unfused ones write y (float32 or BF16) and read it back. Ratios are
  to the fastest unfused variant.
  """
  del args
  global_warmup(2.0)
  qpg = lambda y, impl: group_api.quantize_per_group(
      y, 16, 'e4m3', implementation=impl)[:2]
  variants = [
      ('pallas fused', lambda a, b, s: api.fp8_matmul_groups(
          a, b, s, 1.0, implementation='pallas')),
      ('xla f32 + xla quantize', lambda a, b, s: api.fp8_matmul_groups(
          a, b, s, 1.0, implementation='xla')),
      ('xla f32 + pallas quantize', lambda a, b, s: qpg(api.fp8_matmul(
          a, b, s, 1.0, out_dtype=jnp.float32, implementation='xla'),
                                                        'pallas')),
      ('xla bf16 + pallas quantize', lambda a, b, s: qpg(api.fp8_matmul(
          a, b, s, 1.0, out_dtype=jnp.bfloat16, implementation='xla'),
                                                         'pallas')),
      ('pallas f32 + pallas quantize', lambda a, b, s: qpg(api.fp8_matmul(
          a, b, s, 1.0, out_dtype=jnp.float32, implementation='pallas'),
                                                           'pallas')),
      ('xla bf16 alone (no quantize)', lambda a, b, s: api.fp8_matmul(
          a, b, s, 1.0, out_dtype=jnp.bfloat16, implementation='xla')),
  ]
  rows = []
  for name, m, n, k, a_dtype in GROUP_SHAPES:
    a, b = operands(m, n, k, a_dtype)
    s = jnp.float32(0.75)
    row = dict(shape=name, m=m, n=n, k=k)
    for label, f in variants:
      try:
        med, _, _ = time_fn(jax.jit(f), (a, b, s))
        row[label] = med * 1e3
      except Exception as e:  # pylint: disable=broad-except
        traceback.print_exc()
        row[label] = f'{type(e).__name__}: {str(e)[:200]}'
    rows.append(row)
    print(row, flush=True)
    del a, b
  log['groups'] = rows
  labels = [v[0] for v in variants]
  print('\n| shape | ' + ' | '.join(labels) + ' | fused vs best unfused |')
  print('|---' * (len(labels) + 2) + '|')
  for r in rows:
    unfused = [r[x] for x in labels[1:-1] if isinstance(r[x], float)]
    fused = r[labels[0]]
    ratio = (f'{min(unfused) / fused:.2f}x'
             if unfused and isinstance(fused, float) else '-')
    cells = [f'{r[x]:.3f}' if isinstance(r[x], float) else 'ERR'
             for x in labels]
    print(f'| {r["shape"]} | ' + ' | '.join(cells) + f' | {ratio} |')


# The 1b model's GEMMs (hidden 2048, intermediate 5632, k/v 256, T tokens):
# (name, out features, in features) of the fused Q/K/V projection (2048 +
# 2 x 256 outputs), o, gate (or up) and down, each as fwd (T x out x in),
# dgrad (T x in x out) and wgrad (out x in x T).
LAYERS_1B = [('qkv', 2560, 2048), ('o', 2048, 2048), ('gate/up', 5632, 2048),
             ('down', 2048, 5632)]
SHAPES_1B = [shape for name, out, inp in LAYERS_1B for shape in (
    (f'1b {name} fwd', T, out, inp, E4M3),
    (f'1b {name} dgrad', T, inp, out, E5M2),
    (f'1b {name} wgrad', out, inp, T, E5M2))]


def block_granularity(name):
  """'block' b scales (128x128 blocks) for every GEMM the layers run: W^T
  (forward), W (dgrad) and g^T (wgrad, quantized in blocks since the 'row'
  kernel runs at ~0.6x); 'row' (both wgrad operands tiled along tokens,
  DeepSeek-V3's granularity) for shapes named so (MxNxK:row)."""
  return 'row' if name.endswith(' row') else 'block'


def block_scales(m, n, k, granularity, seed=1):
  """Random positive float32 scales of the block kernel's shapes."""
  ka, kb = jax.random.split(jax.random.key(seed))
  nb = n if granularity == 'row' else -(-n // 128)
  sa = jax.random.uniform(ka, (m, k // 128), jnp.float32, 0.5, 2.0)
  sb = jax.random.uniform(kb, (nb, k // 128), jnp.float32, 0.5, 2.0)
  return jax.block_until_ready((sa, sb))


def block_ref_rows(a, b, sa, sb, granularity, rows):
  """float32 (HIGHEST) result of the block-scaled product for a's `rows`,
  from the dequantized operands (exact products, f32 sums)."""
  expand = lambda x, s, r: x.astype(jnp.float32) * jnp.repeat(
      jnp.repeat(s, 128, axis=1), r, axis=0)[:x.shape[0]]
  a_deq = expand(a[rows], sa[rows], 1)
  b_deq = expand(b, sb, 1 if granularity == 'row' else 128)
  return jnp.dot(a_deq, b_deq.T, precision=jax.lax.Precision.HIGHEST)


def block_alternatives(granularity):
  """(label, config) the block kernel can run for this granularity, timed
  beside select_config's choice with --block-configs."""
  out = [('192x128 3wg', mosaic_gpu_block.BLOCK_THREE_WG_CONFIG),
         ('192x128 3wg early release', mosaic_gpu.THREE_WG_CONFIG),
         ('128x128 2wg', mosaic_gpu.DEFAULT_CONFIG)]
  if granularity == 'block':
    return out
  return out + [('128x128 2wg k128', mosaic_gpu_block.ROW_TWO_WG_CONFIG),
                ('192x96 3wg', mosaic_gpu_block.ROW_THREE_WG_CONFIG)]


def parse_block_shape(spec):
  """An index into SHAPES + SHAPES_1B, or MxNxK (E4M3 x E4M3); ':row' after
  either asks for 'row' b scales (an MxNxK then runs E5M2 x E4M3, as a
  wgrad), 'block' otherwise."""
  dims, _, kind = spec.partition(':')
  if 'x' not in dims:
    shape = (SHAPES + SHAPES_1B)[int(dims)]
  else:
    m, n, k = map(int, dims.split('x'))
    shape = ((f'{dims} wgrad', m, n, k, E5M2) if kind == 'row'
             else (dims, m, n, k, E4M3))
  return ((shape[0] + ' row',) + shape[1:]) if kind == 'row' else shape


def run_block(args, log):
  """Block-scaled Pallas kernel vs the per-tensor Pallas kernel and cuBLASLt
  precise, paired rounds (`time_mirrored`) per shape: the 13 Llama-2-7B
  shapes and the 1b model's. Ratios are speeds relative to the block
  kernel's (> 1: the block kernel is faster). The block kernel gets its
  scales K-block first (no layout op per call); 'in-call layout' is what
  passing (M, K / 128) scales instead adds (the wrapper's transposes).
  --block-configs also times the other configs it can run.
  """
  t_start = time.perf_counter()
  budget = args.budget_s or (200 if args.quick else None)
  global_warmup(2.0)
  rounds = args.rounds or (5 if args.quick else 15)
  shapes = [parse_block_shape(x) for x in args.shapes.split(',')
            ] if args.shapes else SHAPES + SHAPES_1B
  rows = []
  for name, m, n, k, a_dtype in shapes:
    if budget and time.perf_counter() - t_start > budget:
      print(f'time budget of {budget} s spent: skipped {name} and the'
            ' shapes after it (--budget-s)', flush=True)
      break
    gran = block_granularity(name)
    a, b = operands(m, n, k, a_dtype)
    sa, sb = block_scales(m, n, k, gran)
    s = jnp.float32(0.75)
    cfg = mosaic_gpu_block.select_config(m, n, b_granularity=gran)
    row = dict(name=name, m=m, n=n, k=k, a=jnp.dtype(a_dtype).name,
               granularity=gran, config=_tile(cfg))
    try:
      # Timed as a train step calls it: scales K-block first, as the
      # quantizers write them; 'untransposed' passes (M, K / 128) scales,
      # which the wrapper transposes per call.
      def block_fn(config=None, transposed=True):
        def f(a, b, s, sa, sb):
          del s
          return mosaic_gpu_block.fp8_matmul_block_scaled_mosaic(
              a, b, sa.T if not transposed else sa,
              sb.T if not transposed else sb, b_granularity=gran,
              config=config, a_scale_transposed=transposed,
              b_scale_transposed=transposed)
        return jax.jit(f)
      block = block_fn()
      alts = [(label, c) for label, c in block_alternatives(gran)
              if args.block_configs and c != cfg]
      fns = [
          block,
          jax.jit(lambda a, b, s, sa, sb: pallas(a, b, s)),
          jax.jit(lambda a, b, s, sa, sb: xla_precise(a, b, s)),
          block_fn(transposed=False),
      ] + [block_fn(c) for _, c in alts]
      sa, sb = jax.block_until_ready((sa.T, sb.T))  # K-block first
      operands_ = (a, b, s, sa, sb)
      sample = np.unique(np.linspace(0, m - 1, 64).astype(np.int32))
      out = block(*operands_)
      ref = block_ref_rows(a, b, sa.T, sb.T, gran, sample)
      row['err'] = float(rel_diff(out[sample], ref))  # BF16 out: ~2e-3
      times = time_mirrored(fns, operands_, rounds)
      med = [statistics.median(t) for t in times]
      flops = 2.0 * m * n * k
      per_round = lambda j: [x / y for x, y in zip(times[j], times[0])]
      row.update(
          block=flops / med[0] / 1e12, pallas=flops / med[1] / 1e12,
          precise=flops / med[2] / 1e12,
          layout_us=(med[3] - med[0]) * 1e6,
          vs_pallas=statistics.median(per_round(1)),
          vs_pallas_lo=min(per_round(1)), vs_pallas_hi=max(per_round(1)),
          vs_precise=statistics.median(per_round(2)))
      # Each alternative config's speed relative to the per-tensor kernel.
      row['alts'] = {
          label: statistics.median(
              [p / x for p, x in zip(times[1], times[4 + i])])
          for i, (label, _) in enumerate(alts)}
    except Exception as e:  # pylint: disable=broad-except
      traceback.print_exc()
      row['error'] = f'{type(e).__name__}: {str(e)[:300]}'
    rows.append(row)
    print(json.dumps(row), flush=True)
    del a, b
  log['block'] = rows
  print('\n| GEMM | M | N | K | A | b scales | tile | block TFLOP/s |'
        ' per-tensor Pallas | cuBLASLt precise | block / per-tensor'
        ' (median, min..max) | block / precise | in-call layout (us) |'
        ' err |')
  print('|---' * 14 + '|')
  for r in rows:
    if 'error' in r:
      print(f'| {r["name"]} | {r["m"]} | {r["n"]} | {r["k"]} | {r["a"]} |'
            f' {r["granularity"]} | {r["config"]} | ERROR {r["error"]} |')
      continue
    print(f'| {r["name"]} | {r["m"]} | {r["n"]} | {r["k"]} | {r["a"]} |'
          f' {r["granularity"]} | {r["config"]} | {r["block"]:.0f} |'
          f' {r["pallas"]:.0f} | {r["precise"]:.0f} |'
          f' {r["vs_pallas"]:.3f} ({r["vs_pallas_lo"]:.3f}..'
          f'{r["vs_pallas_hi"]:.3f}) | {r["vs_precise"]:.3f} |'
          f' {r["layout_us"]:.1f} | {r["err"]:.1e} |')
    for label, ratio in r.get('alts', {}).items():
      print(f'|   {r["name"]} with {label} | | | | | | {label} | | | |'
            f' {ratio:.3f} | | | |')
  groups = (('Llama-2-7B', {x[0] for x in SHAPES}),
            ('1b', {x[0] for x in SHAPES_1B}), ('all', None))
  for label, names in groups:
    ok = [r for r in rows if 'error' not in r
          and (names is None or r['name'] in names)]
    if ok:
      vs_pallas = statistics.geometric_mean([r['vs_pallas'] for r in ok])
      vs_precise = statistics.geometric_mean([r['vs_precise'] for r in ok])
      print(f'geomean over {len(ok)} {label} shapes: block / per-tensor'
            f' Pallas {vs_pallas:.3f} (target >= 0.95), block / cuBLASLt'
            f' precise {vs_precise:.3f}')


# The 1b block step's FP8 GEMMs as it runs them (`step_profile.py --gemms`,
# H200, 2026-11-29): (name, M, N, K, a dtype, b dtype, out dtype, calls per
# layer). wgrad is dW^T = X^T dY: a = X^T (E4M3, 1x128 tiles along tokens),
# b = dY^T (E5M2, 128x128 blocks), float32 out; no c operand (the step adds
# the residual or the other gate/up dgrad in some epilogues).
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
FILLER_BYTES = 384 * 2**20  # a memory-bound pass, ~0.16 ms on an H200
IN_STEP_REPS = 8


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
  """{label: (us per launch, launches per call)} of the GPU kernels whose
  names contain kernels[label], from a profiler trace of `calls` calls of
  each fns[label](*args) (each warmed ~0.3 s first)."""
  from benchmarks import step_profile  # noqa: PLC0415 (a heavy import)
  out = {}
  for label, f in list(fns.items()):
    try:
      time_fn(f, args, warmup_s=0.3, reps=1)
    except Exception as e:  # noqa: BLE001 (a failed kernel reads nan)
      print(f'{label} failed: {str(e)[:200]}', flush=True)
      out[label] = (float('nan'), 0)
  fns = {label: f for label, f in fns.items() if label not in out}
  trace_dir = tempfile.mkdtemp(prefix='matmul_in_step_')
  with jax.profiler.trace(trace_dir):
    for f in fns.values():
      for _ in range(calls):
        jax.block_until_ready(f(*args))
  stats = step_profile.kernel_stats(trace_dir, calls)
  for label in fns:
    got = [(ms, n) for name, (ms, n) in stats.items() if kernels[label] in name]
    ms, n = sum(x for x, _ in got), sum(x for _, x in got)
    out[label] = (1e3 * ms / n if n else float('nan'), n)
  return out


def run_in_step(args, log):
  """The 1b block step's GEMMs (`STEP_GEMMS_1B`: its orientations, dtypes
  and float32 wgrad outputs) each after a memory-bound pass, as a step runs
  them: the block-scaled kernel, the per-tensor Pallas kernel and cuBLASLt
  precise, per-launch kernel time from a profiler trace, and their sum over
  the step's 22 layers, to set beside `step_profile.py --gemms`. The
  paired rounds of --block write bf16 only, while the step's wgrads write
  float32, which cost the block kernel 12-15% more than bf16 (before its
  whole-tile float32 epilogue, 42bb0e8: RESULTS.md
  "fp8-gemm-block-in-step")."""
  global_warmup(2.0)
  y = jnp.ones(FILLER_BYTES // 4, jnp.float32)
  kernels = {'block': 'fp8_matmul_block_mosaic', 'per-tensor Pallas':
             'fp8_matmul_mosaic', 'cuBLASLt precise': 'nvjet'}
  layers = NUM_LAYERS_1B
  rows, step_ms = [], dict.fromkeys(kernels, 0.0)
  print('| GEMM | M x N x K | a x b -> out | '
        + ' | '.join(f'{k} us' for k in kernels)
        + ' | block / per-tensor | block / cuBLASLt |')
  print('|---' * (5 + len(kernels)) + '|', flush=True)
  for name, m, n, k, a_dtype, b_dtype, out_dtype, calls in STEP_GEMMS_1B:
    a, b = operands(m, n, k, a_dtype)
    b = b.astype(b_dtype)
    sa, sb = block_scales(m, n, k, 'block')
    s = jnp.float32(0.75)

    def block(a, b, s, sa, sb, out_dtype=out_dtype):
      del s
      return mosaic_gpu_block.fp8_matmul_block_scaled_mosaic(
          a, b, sa, sb, b_granularity='block', out_dtype=out_dtype,
          a_scale_transposed=True, b_scale_transposed=True)

    def per_tensor(a, b, s, sa, sb, out_dtype=out_dtype):
      del sa, sb
      return mosaic_gpu.fp8_matmul_mosaic(a, b, s, out_dtype=out_dtype)

    def precise(a, b, s, sa, sb, out_dtype=out_dtype):
      del s, sa, sb
      return jax.lax.dot_general(
          a, b, DIMS, precision=jax.lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32,
          preferred_element_type=out_dtype)

    fns = {label: functools.partial(after_filler(f), y) for label, f in
           zip(kernels, (block, per_tensor, precise))}
    got = traced_kernel_us(fns, (a, b, s, sa.T, sb.T), kernels)
    for label, (us, _) in got.items():
      step_ms[label] += us * calls * layers / 1e3
    row = dict(name=name, m=m, n=n, k=k, a=jnp.dtype(a_dtype).name,
               b=jnp.dtype(b_dtype).name, out=jnp.dtype(out_dtype).name,
               calls_per_layer=calls, us={x: v[0] for x, v in got.items()},
               launches={x: v[1] for x, v in got.items()})
    rows.append(row)
    us = row['us']
    print(f'| {name} | {m}x{n}x{k} | {row["a"]} x {row["b"]} -> {row["out"]} | '
          + ' | '.join(f'{us[x]:.1f}' for x in kernels)
          + f' | {us["per-tensor Pallas"] / us["block"]:.3f}'
          f' | {us["cuBLASLt precise"] / us["block"]:.3f} |', flush=True)
  log['in_step'] = dict(rows=rows, step_ms=step_ms, layers=layers)
  print(f'Sum over {layers} layers (ms per step): ' + ', '.join(
      f'{x} {v:.1f}' for x, v in step_ms.items()))


def triton32(a, b, cfg):
  if triton_why_not() is not None:
    raise RuntimeError('n/a')
  return triton_peer.fp8_matmul_triton(a, b, jnp.float32(1.0),
                                       out_dtype=jnp.float32, config=cfg)


def pallas32(a, b, cfg):
  return mosaic_gpu.fp8_matmul_mosaic(a, b, jnp.float32(1.0),
                                      out_dtype=jnp.float32, config=cfg)


def main():
  p = argparse.ArgumentParser()
  p.add_argument('--sweep', action='store_true')
  p.add_argument('--accuracy', action='store_true')
  p.add_argument('--groups', action='store_true')
  p.add_argument('--paired', action='store_true')
  p.add_argument('--block', action='store_true',
                 help='block-scaled kernel vs per-tensor Pallas and cuBLASLt'
                 ' precise, paired (--shapes, --rounds, --quick apply)')
  p.add_argument('--in-step', action='store_true',
                 help='the 1b block step\'s GEMMs as it runs them, each'
                 ' after a memory-bound pass: block, per-tensor Pallas and'
                 ' cuBLASLt precise kernel time from a profiler trace')
  p.add_argument('--block-configs', action='store_true',
                 help='with --block: also time the other configs the block'
                 ' kernel can run (ratios to the per-tensor kernel)')
  p.add_argument('--budget-s', type=float, default=0,
                 help='with --block: start no new shape after this many'
                 ' seconds (default: 200 with --quick, else none)')
  p.add_argument('--k-lines', action='store_true',
                 help='time against K at M = N = 8192 (--configs: Pallas)')
  p.add_argument('--paired-config', default='',
                 help='with --paired: SWEEP indices to time, e.g. 11,16'
                 ' (default: select_config per shape)')
  p.add_argument('--control', action='store_true',
                 help='with --paired: also time cuBLASLt precise against'
                 ' itself (an A/A control row, sweep "control")')
  p.add_argument('--rounds', type=int, default=0,
                 help='with --paired: ABBA rounds per shape (default 15)')
  p.add_argument('--shapes', default='',
                 help='with --paired: indices into SHAPES (the whole-waves'
                 ' shape last) or MxNxK, e.g. 0,8448x8064x8192 (default:'
                 ' all); with --block: indices into SHAPES + SHAPES_1B, or'
                 ' MxNxK, or MxNxK:row')
  p.add_argument('--semantics', choices=('lane', 'warpgroup'), default=None,
                 help='Mosaic GPU lowering semantics of the Pallas kernel')
  p.add_argument('--quick', action='store_true')
  p.add_argument('--all', action='store_true', help='sweep, then main')
  p.add_argument('--configs', default='', help='sweep indices, e.g. 0,3')
  p.add_argument('--triton-configs', default='',
                 help='indices into triton_peer.CONFIGS to try (default all)')
  p.add_argument('--skip', default='',
                 help='main-table columns to skip, e.g. bf16,xla_api')
  p.add_argument('--out', default=os.environ.get('OUT', '.'))
  args = p.parse_args()
  if args.semantics:
    mosaic_gpu.LOWERING_SEMANTICS[0] = getattr(
        mosaic_gpu.plgpu.LoweringSemantics, args.semantics.capitalize())
  dev = jax.devices()[0]
  log = dict(device=dev.device_kind, jax=jax.__version__,
             date=datetime.date.today().isoformat(),
             semantics=str(mosaic_gpu.LOWERING_SEMANTICS[0]))
  print(log, flush=True)
  mode = ('all' if args.all else 'sweep' if args.sweep else
          'accuracy' if args.accuracy else 'groups' if args.groups else
          'paired' if args.paired else 'k_lines' if args.k_lines else
          'block' if args.block else 'in_step' if args.in_step else 'main')
  try:
    if mode == 'all':
      run_sweep(args, log)
      run_main(args, log)
    else:
      {'sweep': run_sweep, 'accuracy': run_accuracy, 'groups': run_groups,
       'paired': run_paired, 'k_lines': run_k_lines, 'block': run_block,
       'in_step': run_in_step, 'main': run_main}[mode](args, log)
  finally:
    tag = f'_{args.semantics}' if args.semantics else ''
    tag += '_configs' if args.block_configs else ''
    with open(os.path.join(args.out, f'matmul_{mode}{tag}.json'), 'w') as fh:
      json.dump(log, fh, indent=1, default=str)


if __name__ == '__main__':
  main()
