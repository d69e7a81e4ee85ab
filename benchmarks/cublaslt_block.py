"""cuBLASLt's own block-scaled FP8 GEMM on Hopper, against its per-tensor one.

What the block-scaled Pallas kernel (`pallas_kernels/fp8_matmul/
mosaic_gpu_block.py`, `matmul.py --block`) is measured against: CUDA 12.9+
cuBLASLt multiplies E4M3/E5M2 operands with DeepSeek-V3's scales (A in 1x128
tiles, B in 128x128 blocks, or both in 1x128 tiles) on sm_90, and torch
reaches it through `torch._scaled_mm` (XLA does not: its block-scaled dots
lower natively on Blackwell only). Same 25 GEMMs as `matmul.py --block`
(13 Llama-2-7B shapes, 12 of the 1b model, 16384 tokens), precise
accumulation on both sides, bf16 out; paired rounds (per-tensor then
block, three rounds, the ratio per round, median) after >= 2 s of warm-up;
first a check of the block results against a float32 reference.

GPU only, and torch (preinstalled on the lent GPU machines, not a
dependency of coat-jax):

  PYTHONPATH=. python benchmarks/cublaslt_block.py [--rounds 3]
"""

import argparse
import functools
import statistics
import time

import numpy as np

from benchmarks import matmul

# matmul.py's: (name, M, N, K, a's dtype), the 7B layers' then the 1b's.
SHAPES = [(f'7B {name}', *rest) for name, *rest in matmul.SHAPES] + list(
    matmul.SHAPES_1B)


def tile_scales(torch, rows, k):
  """1x128 scales of a (rows, K) operand as `_scaled_mm` takes them for A:
  (rows, K / 128) with the rows contiguous."""
  return (torch.rand(k // 128, rows, device='cuda') + 0.5).t()


def b_tile_scales(torch, n, k):
  """1x128 scales of B (N, K), passed for b = B.t(): their .t() is the
  (N, K / 128) array with the rows contiguous."""
  return torch.rand(k // 128, n, device='cuda') + 0.5


def b_block_scales(torch, n, k):
  """128x128 block scales of B (N, K), passed for b = B.t(): their .t() is
  the row-major (ceil(N / 128), K / 128) array."""
  return (torch.rand(-(-n // 128), k // 128, device='cuda') + 0.5).t()


def operands(torch, m, n, k, a_dtype):
  a = (torch.randn(m, k, device='cuda') * 2).to(a_dtype)
  b = (torch.randn(n, k, device='cuda') * 2).to(torch.float8_e4m3fn)
  return a, b


def scaled_mm(torch, a, b, a_scale, b_scale):
  """(a @ b.T) with the scales, bf16 out; b (N, K) enters as b.t()."""
  return torch._scaled_mm(a, b.t(), scale_a=a_scale, scale_b=b_scale,
                          out_dtype=torch.bfloat16)


def check(torch):
  """Max error of the block results against float32 dequantized operands,
  relative to the largest output: cuBLASLt's own rounding only."""
  m, n, k = 512, 384, 1024
  for a_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
    a, b = operands(torch, m, n, k, a_dtype)
    a_scale = tile_scales(torch, m, k)
    af = (a.float().view(m, k // 128, 128) * a_scale[:, :, None]).view(m, k)
    for name, b_scale in (('128x128', b_block_scales(torch, n, k)),
                          ('1x128', b_tile_scales(torch, n, k))):
      per_row = b_scale.t()
      if name == '128x128':
        per_row = per_row.repeat_interleave(128, 0)[:n]
      bf = (b.float().view(n, k // 128, 128) * per_row[:, :, None]).view(n, k)
      ref = af @ bf.t()
      out = scaled_mm(torch, a, b, a_scale, b_scale).float()
      err = ((out - ref).abs().max() / ref.abs().max()).item()
      print(f'check: A {a_dtype} 1x128 x B {name}: max error {err:.1e}'
            ' of the largest output')
      if not err < 1e-2:
        raise SystemExit(f'block-scaled result off by {err}: scale layouts?')


def kernel_ms(torch, fn, warm_s, reps=15, inner=10):
  """Median ms per call over `reps` batches of `inner` calls (CUDA
  events), after `warm_s` seconds of calls."""
  t0 = time.perf_counter()
  while time.perf_counter() - t0 < warm_s:
    fn()
  times = []
  for _ in range(reps):
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(inner):
      fn()
    end.record()
    end.synchronize()
    times.append(start.elapsed_time(end) / inner)
  return statistics.median(times)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--rounds', type=int, default=3)
  args = parser.parse_args()
  import torch  # noqa: PLC0415 (GPU machines only)
  print(f'torch {torch.__version__}, CUDA {torch.version.cuda},'
        f' {torch.cuda.get_device_name()}')
  check(torch)
  one = torch.ones((), device='cuda')
  print('| GEMM | M x N x K | per-tensor TFLOP/s | 1x128 x 128x128'
        ' TFLOP/s | / per-tensor | 1x128 x 1x128, / per-tensor |')
  print('|---|---|---|---|---|---|')
  ratios, warm = [], 2.0
  for name, m, n, k, a_dtype in SHAPES:
    a, b = operands(torch, m, n, k, getattr(torch, np.dtype(a_dtype).name))
    a_scale = tile_scales(torch, m, k)
    b_scales = {'tensor': one, 'block': b_block_scales(torch, n, k),
                'tiles': b_tile_scales(torch, n, k)}
    variants = {v: functools.partial(
        scaled_mm, torch, a, b, one if v == 'tensor' else a_scale, s)
                for v, s in b_scales.items()}
    ms = {v: [] for v in variants}
    for _ in range(args.rounds):  # paired: the ratio per round
      for v, fn in variants.items():
        ms[v].append(kernel_ms(torch, fn, warm))
        warm = 0.3
    per_round = lambda v: statistics.median(
        t / u for t, u in zip(ms['tensor'], ms[v]))
    flop = 2 * m * n * k
    tflops = lambda v: flop / statistics.median(ms[v]) / 1e9
    ratios.append(per_round('block'))
    print(f'| {name} | {m} x {n} x {k} | {tflops("tensor"):.0f} |'
          f' {tflops("block"):.0f} | {ratios[-1]:.3f} |'
          f' {per_round("tiles"):.3f} |', flush=True)
  print(f'geomean 1x128 x 128x128 / per-tensor: '
        f'{statistics.geometric_mean(ratios):.3f} over {len(ratios)} GEMMs')


if __name__ == '__main__':
  main()
