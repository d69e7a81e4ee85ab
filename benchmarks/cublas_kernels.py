"""Which cuBLASLt kernels XLA runs for the FP8 GEMMs (names from a trace).

  PYTHONPATH=. python3 benchmarks/cublas_kernels.py

Runs cuBLASLt precise (and fast) on a few of `matmul.SHAPES` under
`jax.profiler.trace` and prints the GPU kernel names found in the trace
file: cuBLASLt's names carry its tile shape, cluster shape and schedule,
the configuration the Pallas kernel is compared with.
"""

import glob
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402  pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # noqa: E402  pylint: disable=g-import-not-at-top
import matmul  # noqa: E402  pylint: disable=g-import-not-at-top


def kernel_names(f, args):
  """GPU kernel names in a profiler trace of f(*args)."""
  jax.block_until_ready(f(*args))
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      jax.block_until_ready(f(*args))
    files = glob.glob(f'{d}/**/*', recursive=True)
    data = b''.join(open(p, 'rb').read() for p in files if os.path.isfile(p))
  if not data:
    print('# no trace files:', files)
  names = set(re.findall(rb'[A-Za-z_][A-Za-z0-9_]*(?:gemm|xmma|cutlass|sm90)'
                         rb'[A-Za-z0-9_]*', data))
  return sorted(n.decode() for n in names)


def main():
  for name, m, n, k, a_dtype in (matmul.SHAPES[0], matmul.SHAPES[4],
                                 matmul.SHAPES[7]):
    a, b = matmul.operands(m, n, k, a_dtype)
    s = jnp.float32(1)
    for label, f in (('precise', matmul.xla_precise),
                     ('fast', matmul.xla_fast)):
      print(f'{name} {label}:', kernel_names(jax.jit(f), (a, b, s)),
            flush=True)
    del a, b


if __name__ == '__main__':
  main()
