"""Smoke test of the Triton FP8 matmul peer (jax_triton); run it first on a GPU.

  python3 benchmarks/triton_smoke.py           # a few small shapes, ~30 s
  python3 benchmarks/triton_smoke.py --time    # plus one 8192^3 timing

Prints the versions, then for each case the max |error| / max |reference|
against a float64 reference (and, for small-integer inputs, whether the
result is exact), and exits with status 1 on the first failure.
"""

import argparse
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp
import numpy as np

from pallas_kernels.fp8_matmul import api  # pylint: disable=g-import-not-at-top
from pallas_kernels.fp8_matmul import triton_peer

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def versions():
  out = {'jax': jax.__version__, 'device': str(jax.devices()[0])}
  for name in ('triton', 'jax_triton'):
    try:
      out[name] = __import__(name).__version__
    except Exception as e:  # pylint: disable=broad-except
      out[name] = f'{type(e).__name__}: {e}'
  return out


def operands(m, n, k, a_dtype, b_dtype, kind, seed=0):
  ka, kb = jax.random.split(jax.random.key(seed))
  if kind == 'ints':  # exact in both formats; f32 sums are exact
    a = jax.random.randint(ka, (m, k), -8, 8).astype(jnp.float32)
    b = jax.random.randint(kb, (n, k), -8, 8).astype(jnp.float32)
  elif kind == 'uniform':  # all positive: the worst case for accumulation
    a = jax.random.uniform(ka, (m, k))
    b = jax.random.uniform(kb, (n, k))
  else:
    a = jax.random.normal(ka, (m, k))
    b = jax.random.normal(kb, (n, k))
  return a.astype(a_dtype), b.astype(b_dtype)


def f64(a, b, scale):
  a64 = np.asarray(a.astype(jnp.float32), np.float64)
  b64 = np.asarray(b.astype(jnp.float32), np.float64)
  return (a64 @ b64.T) * scale


def rel(out, ref):
  out = np.asarray(out.astype(jnp.float32), np.float64)
  return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


CASES = [  # (M, N, K, a dtype, b dtype, inputs, out dtype, scale)
    (256, 256, 512, E4M3, E4M3, 'ints', jnp.float32, 1.0),
    (256, 256, 512, E5M2, E4M3, 'ints', jnp.float32, 1.0),
    (272, 400, 208, E5M2, E4M3, 'ints', jnp.float32, 0.25),
    (48, 80, 112, E4M3, E5M2, 'ints', jnp.bfloat16, 8.0),
    (512, 512, 16384, E4M3, E4M3, 'uniform', jnp.float32, 1.0),
    (512, 512, 4096, E5M2, E4M3, 'normal', jnp.bfloat16, 0.37),
]


def main():
  p = argparse.ArgumentParser()
  p.add_argument('--time', action='store_true', help='time one 8192^3')
  args = p.parse_args()
  print(versions(), flush=True)
  why = triton_peer.unavailable_reason()
  if why is not None:
    print(f'FAIL: the Triton peer cannot run here: {why}')
    sys.exit(1)
  ok = True
  for m, n, k, at, bt, kind, out_dtype, scale in CASES:
    label = (f'{m}x{n}x{k} {jnp.dtype(at).name} x {jnp.dtype(bt).name}'
             f' {kind} -> {jnp.dtype(out_dtype).name} scale {scale}')
    try:
      a, b = operands(m, n, k, at, bt, kind)
      f = jax.jit(lambda a, b, out_dtype=out_dtype, scale=scale: (
          api.fp8_matmul(a, b, jnp.float32(scale), 1.0, out_dtype=out_dtype,
                         implementation='triton')))
      t0 = time.perf_counter()
      out = jax.block_until_ready(f(a, b))
      first_s = time.perf_counter() - t0
      ref = f64(a, b, scale)
      err = rel(out, ref)
      xla = api.fp8_matmul(a, b, jnp.float32(scale), 1.0,
                           out_dtype=out_dtype, implementation='xla')
      xla_err = rel(xla, ref)
      line = (f'{label}: err {err:.2e} (xla precise {xla_err:.2e}),'
              f' first call {first_s:.1f} s')
      if kind == 'ints':
        want = ref.astype(np.float32).astype(out_dtype).astype(np.float32)
        exact = np.array_equal(np.asarray(out, np.float32), want)
        line += ', exact' if exact else ', NOT EXACT'
        ok &= exact
      else:
        ok &= bool(np.isfinite(err)) and err <= 2 * xla_err + 1e-6
      print(line, flush=True)
    except Exception:  # pylint: disable=broad-except
      traceback.print_exc()
      print(f'{label}: FAILED', flush=True)
      ok = False
    if not ok:
      print('FAIL')
      sys.exit(1)
  if args.time:
    a, b = operands(8192, 8192, 8192, E4M3, E4M3, 'normal')
    for cfg in triton_peer.CONFIGS:
      f = jax.jit(lambda a, b, cfg=cfg: triton_peer.fp8_matmul_triton(
          a, b, jnp.float32(1.0), config=cfg))
      jax.block_until_ready(f(a, b))
      t0 = time.perf_counter()
      for _ in range(20):
        out = f(a, b)
      jax.block_until_ready(out)
      dt = (time.perf_counter() - t0) / 20
      print(f'8192^3 {cfg.short()}: {2 * 8192**3 / dt / 1e12:.0f} TFLOP/s',
            flush=True)
  print('OK')


if __name__ == '__main__':
  main()
