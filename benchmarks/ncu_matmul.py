"""Runs the Pallas FP8 GEMM and cuBLASLt precise for Nsight Compute.

Both are compiled and warmed first; only `--calls` calls of each run between
cudaProfilerStart and cudaProfilerStop, so XLA's autotuning and the input
generation stay out of the report:

  ncu --profile-from-start off --clock-control none --set full \\
      -o prof python3 benchmarks/ncu_matmul.py --shape 8192x8192x8192
  ncu -i prof.ncu-rep --page details            # per-kernel sections
  ncu -i prof.ncu-rep --page source --csv --print-source sass   # stalls
"""

import argparse
import ctypes
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp

from benchmarks import matmul
from pallas_kernels.fp8_matmul import mosaic_gpu


def _cudart():
  """The CUDA runtime library jax loaded, for cudaProfilerStart/Stop."""
  for name in ('libcudart.so.13', 'libcudart.so.12', 'libcudart.so'):
    try:
      return ctypes.CDLL(name)
    except OSError:
      continue
  import nvidia.cuda_runtime  # pylint: disable=g-import-not-at-top
  lib = os.path.join(list(nvidia.cuda_runtime.__path__)[0], 'lib')
  so = sorted(f for f in os.listdir(lib) if f.startswith('libcudart.so'))
  return ctypes.CDLL(os.path.join(lib, so[-1]))


def profile_calls(fns, args, calls):
  """Warms each jitted f(*args), then runs each `calls` times, in order,
  between cudaProfilerStart and cudaProfilerStop."""
  for f in fns:
    for _ in range(3):
      jax.block_until_ready(f(*args))
  cudart = _cudart()
  cudart.cudaProfilerStart()
  for f in fns:
    for _ in range(calls):
      jax.block_until_ready(f(*args))
  cudart.cudaProfilerStop()


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--shape', default='0',
                 help='as matmul.py --shapes, one shape (default: 8192^3)')
  p.add_argument('--config', type=int, default=None,
                 help='index into matmul.SWEEP; default select_config')
  p.add_argument('--calls', type=int, default=2)
  args = p.parse_args()
  _, m, n, k, a_dtype = matmul.parse_shape(args.shape)
  config = None if args.config is None else matmul.SWEEP[args.config]
  print('pallas config:', config or mosaic_gpu.select_config(m, n))
  a, b = matmul.operands(m, n, k, a_dtype)
  s = jnp.float32(1.0)
  profile_calls([jax.jit(functools.partial(matmul.pallas, config=config)),
                 jax.jit(matmul.xla_precise)], (a, b, s), args.calls)


if __name__ == '__main__':
  main()
