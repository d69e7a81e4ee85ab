"""The FP8 fan-out backward (Q/K/V, gate/up): one concatenated GEMM vs a sum.

`coat_jax.nn.linear` runs the backward of several kernels sharing one input
as one dgrad and one wgrad GEMM over the concatenated output gradients
(quantized once). The baselines, in the same run: the earlier per-kernel
backward (a quantization, a dgrad and a wgrad GEMM per kernel, dgrad parts
summed in float32) and the same with bfloat16 parts. For each: the median
time of the backward (>= 2 s warm-up) and the compiled temp bytes.

  PYTHONPATH=. python benchmarks/fanout_bwd.py
"""

import argparse
import datetime
import statistics
import time

import jax
import jax.numpy as jnp

from coat_jax.nn import linear
from coat_jax.nn.fp8_matmul import fp8_matmul

# (name, tokens M, in K, outs N_i): Llama 1b and Llama-2-7B, batch 8 x 2048.
SHAPES = (
    ('1b qkv', 16384, 2048, (2048, 256, 256)),
    ('1b gate/up', 16384, 2048, (5632, 5632)),
    ('7b qkv', 16384, 4096, (4096, 4096, 4096)),
    ('7b gate/up', 16384, 4096, (11008, 11008)),
)


def per_kernel_bwd(x_t, x_scale, kernels, grads, parts_dtype):
  """The earlier backward: per kernel, quantize g_i, dgrad, wgrad; sum."""
  dx = None
  dkernels = []
  for i, (w, g) in enumerate(zip(kernels, grads, strict=True)):
    g_values, g_scale, g_t = linear._quantize_with_transpose(g, 'e5m2')  # pylint: disable=protected-access
    wq = linear._quantize_weight(w, None, i)  # pylint: disable=protected-access
    part = fp8_matmul(g_values, wq.values, g_scale, wq.scale,
                      out_dtype=parts_dtype)
    dx = part if dx is None else dx + part
    dkernels.append(fp8_matmul(x_t, g_t, x_scale, g_scale,
                               out_dtype=w.dtype))
  return dx.astype(grads[0].dtype), tuple(dkernels)


def concat_bwd(x_t, x_scale, kernels, grads):
  """coat_jax's backward (one dgrad, one wgrad GEMM)."""
  return linear._fp8_dense_bwd(None, None, (x_t, x_scale, kernels), grads)  # pylint: disable=protected-access


def _time(fn, args, warmup_s, runs):
  jax.block_until_ready(fn(*args))
  start = time.perf_counter()
  while time.perf_counter() - start < warmup_s:
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(runs):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times), min(times), max(times)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--warmup_s', type=float, default=2.0)
  parser.add_argument('--runs', type=int, default=50)
  parser.add_argument('--tokens', type=int, default=None,
                      help='override M (tokens) of every shape')
  args = parser.parse_args()
  print(f'jax {jax.__version__}, {jax.devices()[0].device_kind},'
        f' {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC')
  variants = {  # the first is the baseline of the ratios
      'sum, f32 parts': lambda *a: per_kernel_bwd(*a, jnp.float32),
      'sum, bf16 parts': lambda *a: per_kernel_bwd(*a, jnp.bfloat16),
      'concat (coat_jax)': concat_bwd,
  }
  print('| GEMMs | M | K | N | variant | ms (median) | min-max |'
        ' vs f32 sum | temp MiB |')
  print('|---|---|---|---|---|---|---|---|---|')
  for name, m, k, ns in SHAPES:
    m = args.tokens or m
    keys = jax.random.split(jax.random.key(0), 2 + 2 * len(ns))
    x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    _, x_scale, x_t = linear._quantize_with_transpose(x, 'e4m3')  # pylint: disable=protected-access
    kernels = tuple(jax.random.normal(keys[1 + i], (k, n)) * 0.02
                    for i, n in enumerate(ns))
    grads = tuple(jax.random.normal(keys[1 + len(ns) + i], (m, n),
                                    jnp.bfloat16) * 1e-3
                  for i, n in enumerate(ns))
    operands = (x_t, x_scale, kernels, grads)
    base = None  # per shape
    for variant, fn in variants.items():
      compiled = jax.jit(fn).lower(*operands).compile()
      temp = compiled.memory_analysis().temp_size_in_bytes
      med, lo, hi = _time(compiled, operands, args.warmup_s, args.runs)
      base = base or med
      print(f'| {name} | {m} | {k} | {"+".join(map(str, ns))} | {variant} |'
            f' {med * 1e3:.3f} | {lo * 1e3:.3f}-{hi * 1e3:.3f} |'
            f' {med / base:.3f} | {temp / 2**20:.0f} |', flush=True)
    del operands


if __name__ == '__main__':
  main()
