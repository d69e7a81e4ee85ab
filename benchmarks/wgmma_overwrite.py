"""Probe: does overwriting fresh wgmma accumulators speed up the FP8 GEMM?

The promoting kernel runs every 128 of K into a fresh wgmma accumulator that
Pallas zeroes (`plgpu.ACC` in `pl.run_scoped`), then adds it to the FP32
carry. PTX wgmma can instead ignore its input accumulator (scale-d false),
which would save the zeroing. Pallas' `plgpu.wgmma` has no such flag (only
tcgen05 has `accumulate=`), so this probe patches jax's Mosaic GPU wgmma
emitter while the kernel is lowered:

  base             the kernel as it is;
  overwrite        the first wgmma instruction of each `plgpu.wgmma` call
                   has scale-d false (the zeros are still written);
  overwrite_undef  the same, and the accumulator starts undefined.

It checks that each variant's output equals the base kernel's bit for bit,
then times paired rounds (base, overwrite, overwrite_undef, cuBLASLt precise
in mirrored order) and prints each variant / cuBLASLt precise.

  python3 benchmarks/wgmma_overwrite.py [--rounds 15]

Result (RESULTS.md, "Sixth run"): bit-exact, no faster; ptxas already
issues the first wgmma of a fresh zero accumulator with scale-d false (the
SASS shows `QGMMA ... RZ, !UPT`), so the zeros cost nothing to begin with.
Valid only for kernels whose every `plgpu.wgmma` call starts a fresh
accumulator and covers one 128-byte swizzle of K (the promoting configs).
"""

import argparse
import contextlib
import functools
import importlib
import os
import re
import statistics
import sys
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp
from jaxlib.mlir import ir
import numpy as np

from benchmarks import matmul
from pallas_kernels.fp8_matmul import mosaic_gpu

VARIANTS = ('base', 'overwrite', 'overwrite_undef')


@contextlib.contextmanager
def patched(variant):
  """Lowers `plgpu.wgmma` calls per `variant` while active."""
  if variant == 'base':
    yield
    return
  wgmma_mod = importlib.import_module('jax.experimental.mosaic.gpu.wgmma')
  fa = importlib.import_module('jax.experimental.mosaic.gpu.fragmented_array')
  real_m64, real_asm = wgmma_mod.wgmma_m64, wgmma_mod.llvm.inline_asm

  def wgmma_m64(*args, **kwargs):
    first = [True]

    def inline_asm(res, operands, asm, constraints, **kw):
      if first[0]:
        asm, n = re.subn(r'setp\.ne\.b32 p, (\$\d+), 0;',
                         r'setp.ne.b32 p, \1, \1;', asm)
        assert n == 1, asm
        first[0] = False
      return real_asm(res, operands, asm, constraints, **kw)

    with mock.patch.object(wgmma_mod.llvm, 'inline_asm', inline_asm):
      return real_m64(*args, **kwargs)

  def undef_zero(cls, m, n, dtype=None, *, is_signed=None):
    undef = wgmma_mod.llvm.UndefOp(dtype or ir.F32Type.get()).result
    return cls.from_registers(fa.FragmentedArray.splat(
        undef, (m, n), fa.WGMMA_LAYOUT, is_signed=is_signed))

  with contextlib.ExitStack() as stack:
    stack.enter_context(mock.patch.object(wgmma_mod, 'wgmma_m64', wgmma_m64))
    if variant == 'overwrite_undef':
      stack.enter_context(mock.patch.object(
          wgmma_mod.WGMMAAccumulator, 'zero', classmethod(undef_zero)))
    yield


def compiled(variant, a, b, s, config=None):
  f = jax.jit(functools.partial(matmul.pallas, config=config))
  with patched(variant):
    return f.lower(a, b, s).compile()


CASES = [  # (name, M, N, K, config)
    ('8192^3 select_config', 8192, 8192, 8192, None),
    ('8192^3 default', 8192, 8192, 8192, mosaic_gpu.DEFAULT_CONFIG),
    ('o fwd select_config', matmul.T, 4096, 4096, None),
    ('qkv wgrad select_config', 12288, 4096, matmul.T, None),
]
EDGE = ('edges 656x400x272', 656, 400, 272, None)


def run(args):
  """Checks every variant bitwise, then returns the table's rows."""
  rows = []
  matmul.global_warmup(2.0)
  s = jnp.float32(0.75)
  for name, m, n, k, cfg in [EDGE] + CASES:
    a, b = matmul.operands(m, n, k, matmul.E4M3, seed=m + n + k)
    if name == EDGE[0]:  # NaN and zero rows, an Inf and a large value
      a = a.at[3].set(jnp.nan).at[5].set(0).at[7, 9].set(jnp.inf)
      a = a.at[11, 13].set(448.0)
    fs = {v: compiled(v, a, b, s, cfg) for v in VARIANTS}
    outs = {v: np.asarray(f(a, b, s)).view(np.uint16) for v, f in fs.items()}
    same = {v: bool(np.array_equal(outs[v], outs['base'])) for v in VARIANTS}
    print(name, 'bitwise equal to base:', same, flush=True)
    assert all(same.values()), name
    if name == EDGE[0]:
      continue
    order = list(VARIANTS) + ['xla']
    fns = [fs[v] for v in VARIANTS] + [jax.jit(matmul.xla_precise)]
    times = dict(zip(order, matmul.time_mirrored(fns, (a, b, s), args.rounds)))
    ratios = {v: [x / t for x, t in zip(times['xla'], times[v])]
              for v in VARIANTS}
    flops = 2.0 * m * n * k
    cells = [f'{flops / statistics.median(times["xla"]) / 1e12:.0f}']
    for v in VARIANTS:
      r = ratios[v]
      cells.append(f'{flops / statistics.median(times[v]) / 1e12:.0f},'
                   f' {statistics.median(r):.3f} ({min(r):.3f}..{max(r):.3f})')
    rows.append(f'| {name} | ' + ' | '.join(cells) + ' |')
    print(rows[-1], flush=True)
    del a, b
  return rows


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--rounds', type=int, default=15)
  args = p.parse_args()
  rows = run(args)
  print('device:', jax.devices()[0].device_kind, 'jax', jax.__version__,
        'rounds', args.rounds)
  print('| case | cuBLASLt precise TFLOP/s | ' + ' | '.join(
      f'{v}: TFLOP/s, / precise (min..max)' for v in VARIANTS) + ' |')
  print('|---' * (2 + len(VARIANTS)) + '|')
  print('\n'.join(rows))


if __name__ == '__main__':
  main()
