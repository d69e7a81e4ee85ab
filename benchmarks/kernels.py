"""Memory-bound kernels against their XLA references and a copy: the FP8
quantizers, and COAT's FP8 RMSNorm and SwiGLU (RESULTS.md "kernels",
"quantize-blockwise" and "kernels-fused").

  PYTHONPATH=. python benchmarks/kernels.py [--out results.jsonl]
  PYTHONPATH=. python benchmarks/kernels.py --blockwise
  PYTHONPATH=. python benchmarks/kernels.py --fused

Each op runs through its public entry (`pallas_kernels.<op>.api`) on the
same input with implementation='xla' (the jnp reference, as XLA fuses it)
and 'pallas' (the kernel the op runs on a Hopper GPU). Its bandwidth is its
logical bytes (each input read once, each output written once) per second,
set against a copy (`x * 2`) timed in the same run:

  (default)    per-group (1x128, 1x16, with expansion, dequantize) and
               per-tensor (amax in the kernels, amax given, with the
               transposed copy) quantizers on 1 GiB working sets, against
               a float32 copy of 2^28 elements; wall clock (`time_call`).
  --blockwise  the two-layout block quantizer at the 1b step's shapes
               (16384 tokens): x and x^T in 1x128 tiles (a linear layer's
               input), g in 1x128 tiles with g^T in 128x128 blocks (its
               output gradient), against a bf16 copy of the same shape; GPU
               kernel time (`device_time_call`: at these sizes wall clock
               measures the host's dispatch).
  --fused      FP8 RMSNorm and SwiGLU, forward and backward, at the 1b and
               Llama-2-7B widths, against a bf16 copy of the same width;
               wall clock.

`time_call` is optimizer.py's timer too.
"""

import argparse
import json
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp

from pallas_kernels.quantize_blockwise import api as blockwise
from pallas_kernels.quantize_per_group import api as group
from pallas_kernels.quantize_per_tensor import api as tensor
from pallas_kernels.rms_norm_fp8 import api as norm
from pallas_kernels.swiglu_fp8 import api as swiglu

IMPLEMENTATIONS = ('xla', 'pallas')
# 2^28 float32 elements, a (32768, 8192) matrix; smaller for dry runs.
N = 1 << int(os.environ.get('BENCH_LOG2_N', 28))
COLS = 1 << 13
# Tokens of the 1b step (batch 8 x 2048); smaller for dry runs.
TOKENS = int(os.environ.get('BENCH_TOKENS', 16384))
BLOCKWISE_WIDTHS = (2048, 4096, 5632)  # the 1b model's hidden, 2x, MLP
FUSED_SHAPES = ((2048, 5632), (4096, 11008))  # (hidden, MLP): 1b, 7B


def _block(tree):
  jax.tree.map(lambda a: a.block_until_ready(), tree)


def time_call(fn, args, *, iters=20, warm_s=1.0, repeats=5, carry=None):
  """Median seconds per call of fn(*args) over `repeats` runs of `iters`
  calls, each run closed by block_until_ready, after `warm_s` of calls.

  With carry=(state, *extra): fn(state, *extra) -> state, state donated.
  """
  if carry is not None:
    state, *extra = carry
    call = lambda: fn(state, *extra)
  else:
    call = lambda: fn(*args)
  out = call()
  _block(out)
  if carry is not None:
    state = out
  t0 = time.perf_counter()
  while time.perf_counter() - t0 < warm_s:
    out = call()
    if carry is not None:
      state = out
  _block(out)
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    for _ in range(iters):
      out = call()
      if carry is not None:
        state = out
    _block(out)
    times.append((time.perf_counter() - t) / iters)
  return statistics.median(times)


def device_time_call(fn, args, *, calls=30, warm_s=1.0):
  """GPU kernel seconds per call of fn(*args), from a profile of `calls`
  calls (every kernel of the call, the host's dispatch left out). Off the
  GPU (dry runs): `time_call` once."""
  if jax.default_backend() != 'gpu':
    return time_call(fn, args, warm_s=0.0, repeats=1, iters=1)
  from benchmarks import step_profile  # noqa: PLC0415 (reads the trace)
  time_call(fn, args, warm_s=warm_s, repeats=1)
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir):
      for _ in range(calls):
        out = fn(*args)
      _block(out)
    stats = step_profile.kernel_stats(trace_dir, calls)
  return sum(ms for ms, _ in stats.values()) / 1e3


def _normal(key, shape, dtype, std=1.0):
  return (jax.random.normal(jax.random.key(key), shape, jnp.float32)
          * std).astype(dtype)


def _copy(x, timer, **timing):
  """A row for `x * 2` of x's shape and dtype: the ceiling of the ops."""
  name = f'copy x*2 {jnp.dtype(x.dtype).name} {x.shape}'
  s = timer(jax.jit(lambda x: x * 2), (x,), **timing)
  return dict(name=name, impl='xla', bytes=2 * x.nbytes, copy=name, s=s)


def _both(name, op, args, nbytes, copy, timer, **timing):
  """A row per implementation of op(*args, implementation=...)."""
  return [dict(name=name, impl=impl, bytes=nbytes, copy=copy['name'],
               s=timer(jax.jit(lambda *a, impl=impl: op(
                   *a, implementation=impl)), args, **timing))
          for impl in IMPLEMENTATIONS]


def bench_quantizers():
  """The per-group and per-tensor quantizers on 1 GiB working sets."""
  x = _normal(0, (N // COLS, COLS), jnp.float32, 1e-3)
  copy = _copy(x, time_call, warm_s=3.0)  # also brings the clocks up
  rows = [copy]
  cases = (  # (name, input dtype, group size, expansion)
      ('quantize 1x128 e4m3, f32 in', jnp.float32, 128, False),
      ('quantize 1x16 e4m3, bf16 in', jnp.bfloat16, 16, False),
      ('quantize 1x128 e4m3 + expansion, f32 in', jnp.float32, 128, True))
  for name, dtype, g, expansion in cases:
    n = N * 4 // jnp.dtype(dtype).itemsize  # 1 GiB in
    x = _normal(1, (n // COLS, COLS), dtype, 1e-3)
    meta = (8 if expansion else 4) * n // g  # scale (and exponent) per group
    rows += _both(name, lambda x, implementation, g=g, e=expansion:
                  group.quantize_per_group(x, g, 'e4m3', e,
                                           implementation=implementation),
                  (x,), n * (x.dtype.itemsize + 1) + meta, copy, time_call)
  v, s, e = jax.jit(lambda x: group.quantize_per_group(
      x, 128, 'e4m3', True, implementation='xla'))(
          _normal(1, (N // COLS, COLS), jnp.float32, 1e-3))
  rows += _both('dequantize 1x128 + expansion -> f32',
                lambda v, s, e, implementation: group.dequantize_per_group(
                    v, s, e, 128, implementation=implementation),
                (v, s, e), N * 5 + 8 * N // 128, copy, time_call)
  del v, s, e
  x = _normal(2, (2 * N // COLS, COLS), jnp.bfloat16, 3.0)  # 1 GiB
  amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
  for name, given, transpose in (
      ('per-tensor bf16 -> e4m3, amax in the kernels', False, False),
      ('per-tensor bf16 -> e4m3, amax given', True, False),
      ('per-tensor + transposed copy, amax given', True, True)):
    rows += _both(name, lambda x, a, implementation, given=given,
                  transpose=transpose: tensor.quantize_per_tensor(
                      x, 'e4m3', amax=a if given else None,
                      transpose=transpose, implementation=implementation),
                  (x, amax), x.size * (3 + transpose), copy, time_call)
  return rows


def bench_blockwise():
  """The two-layout block quantizer against a same-shape bf16 copy."""
  rows = []
  for width in BLOCKWISE_WIDTHS:
    x = _normal(5, (TOKENS, width), jnp.bfloat16, 3.0)
    copy = _copy(x, device_time_call, warm_s=2.0)
    rows.append(copy)
    # 2 B in, 2 x (1 B + 4 B / 128) out an element (g^T's 128x128 block
    # scales counted as tiles' too).
    for name, transpose_block in (
        ('x, x^T in 1x128 tiles', (1, 128)),
        ('g in 1x128 tiles, g^T in 128x128 blocks', (128, 128))):
      rows += _both(f'{name} {x.shape}', lambda x, implementation, tb=(
          transpose_block): blockwise.quantize_blockwise(
              x, (1, 128), 'e4m3', transpose=True, transpose_block=tb,
              implementation=implementation),
                    (x,), x.size * (2 + 2 * (1 + 4 / 128)), copy,
                    device_time_call)
  return rows


def bench_fused():
  """FP8 RMSNorm and SwiGLU, forward and backward, against a bf16 copy.

  Logical bytes an element: RMSNorm forward reads x (2), writes y (2), the
  codes (1) and bf16 scales (2 / 16); backward reads the codes, scales, g
  and the residual stream's gradient (as in the decoder layer) and writes
  dx. SwiGLU forward reads gate and up (4), writes h (2) and two codes with
  their scales (2.25); backward reads those groups and dh, writes dgate and
  dup.
  """
  timing = dict(warm_s=2.0, iters=50, repeats=9)
  rows = []
  for hidden, inter in FUSED_SHAPES:
    x = _normal(8, (TOKENS, hidden), jnp.bfloat16, 3.0)
    copy = _copy(x, time_call, **timing)
    gain = jax.random.uniform(jax.random.key(9), (hidden,), jnp.float32,
                              0.5, 1.5)
    g, r = (_normal(k, x.shape, jnp.bfloat16) for k in (10, 11))
    _, codes, scales, rstd, _ = norm.rms_norm_fp8_fwd(
        x, gain, implementation='xla')
    rows.append(copy)
    rows += _both(f'rms_norm_fp8 fwd {x.shape}',
                  lambda x, s, implementation: norm.rms_norm_fp8_fwd(
                      x, s, implementation=implementation),
                  (x, gain), x.size * 5.125, copy, time_call, **timing)
    rows += _both(f'rms_norm_fp8 bwd {x.shape}',
                  lambda c, s, rs, gn, g, r, implementation:
                  norm.rms_norm_fp8_bwd(c, s, rs, gn, g, residual_grad=r,
                                        implementation=implementation),
                  (codes, scales, rstd, gain, g, r), x.size * 7.125, copy,
                  time_call, **timing)
    del x, g, r, codes, scales, rstd
    gate, up, dh = (_normal(k, (TOKENS, inter), jnp.bfloat16, std)
                    for k, std in ((12, 3.0), (13, 1.0), (14, 1.0)))
    copy = _copy(gate, time_call, **timing)
    _, gate_q, up_q, _ = swiglu.swiglu_fp8_fwd(gate, up, implementation='xla')
    rows.append(copy)
    rows += _both(f'swiglu_fp8 fwd {gate.shape}', swiglu.swiglu_fp8_fwd,
                  (gate, up), gate.size * 8.25, copy, time_call, **timing)
    rows += _both(f'swiglu_fp8 bwd {gate.shape}', swiglu.swiglu_fp8_bwd,
                  (gate_q, up_q, dh), gate.size * 8.25, copy, time_call,
                  **timing)
  return rows


def table(rows: list[dict]) -> str:
  """Markdown: each op's time, GB/s, share of its copy's GB/s and speed
  against the XLA reference of the same op."""
  gbps = lambda r: r['bytes'] / r['s'] / 1e9
  by_name = {(r['name'], r['impl']): r for r in rows}
  lines = ['| op | impl | us | GB/s | % of copy | vs xla |',
           '|---|---|---|---|---|---|']
  for r in rows:
    copy = by_name[(r['copy'], 'xla')]
    xla = by_name[(r['name'], 'xla')]
    lines.append(f'| {r["name"]} | {r["impl"]} | {r["s"] * 1e6:.1f} |'
                 f' {gbps(r):.0f} | {100 * gbps(r) / gbps(copy):.0f}% |'
                 f' {xla["s"] / r["s"]:.2f}x |')
  return '\n'.join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      description=__doc__.split('\n\n')[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  what = parser.add_mutually_exclusive_group()
  what.add_argument('--blockwise', action='store_true',
                    help='the two-layout block quantizer')
  what.add_argument('--fused', action='store_true',
                    help='the FP8 RMSNorm and SwiGLU kernels')
  parser.add_argument('--out', help='write the rows as JSON lines')
  args = parser.parse_args(argv)
  device = jax.devices()[0].device_kind
  print(f'{device}, jax {jax.__version__}', flush=True)
  bench = (bench_blockwise if args.blockwise else bench_fused if args.fused
           else bench_quantizers)
  rows = bench()
  if args.out:
    with open(args.out, 'w') as f:
      for r in rows:
        f.write(json.dumps(dict(r, device=device, jax=jax.__version__))
                + '\n')
  print(table(rows))
  return 0


if __name__ == '__main__':
  main()
