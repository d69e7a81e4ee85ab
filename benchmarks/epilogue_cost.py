"""What the epilogue of a tile costs THREE_WG_CONFIG, and why.

Diagnostic for issue 6 (NOTES.md, "The epilogue's cost"). The K sweep puts
a fixed cost per call of 22-26 us on the Pallas kernel, and both a fifth
pipeline stage (which shrinks the epilogue's SMEM chunks from 64 to 32
columns) and a whole-tile epilogue buffer measured slower. Each variant
changes one thing and is timed in mirrored rounds (`matmul.time_mirrored`)
against the committed kernel A and cuBLASLt precise:

  A  THREE_WG_CONFIG: 4 stages; each warpgroup writes its 64 x 128 output
     in 2 chunks of 64 columns through one 24 KiB SMEM buffer (TMA store,
     then a wait for its read before the next chunk); 184 KiB of SMEM
  B  A whose epilogue never stores (a runtime-false `pl.when` on the scale)
  M  A storing only its first chunk (no wait inside the tile; ptxas then
     also drops the FP32 adds of the unstored half, so M is not A minus
     one chunk)
  C  A in 4 chunks of 32 columns (the chunks a fifth stage forces)
  D  A in 1 chunk of 128 columns (a 48 KiB buffer, no wait; 208 KiB)
  N  A without the wait before the second chunk (a race; timing only)
  S  A's second chunk into a second 24 KiB buffer, without the wait
  R  A with that second buffer allocated and unused (208 KiB)
  E  5 stages (so 4 chunks of 32 columns; 212 KiB; its tiles drain, since
     5 stages divide no K steps of the shapes here)
  F  E whose epilogue never stores
  H  A writing its registers straight to GMEM (st.global): no SMEM, no TMA
     store, no wait

B, F, M and N leave the output wrong by construction and are not checked;
the others are checked against cuBLASLt precise. The variants patch module
attributes of `mosaic_gpu` while they are traced and compiled (jit keeps the
executable).

  python3 benchmarks/epilogue_cost.py [--groups ABM,ACD] [--shapes 0,4,1]

With `--profile`, the variants of the first group each run once on the
first shape between cudaProfilerStart and cudaProfilerStop, in order, for
Nsight Compute (see `ncu_matmul.py`):

  ncu --profile-from-start off --clock-control none --set full -o prof \
      python3 benchmarks/epilogue_cost.py --profile --groups AB --shapes 0
"""

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import statistics
import sys
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=g-import-not-at-top
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp

from benchmarks import matmul
from benchmarks import ncu_matmul
from pallas_kernels.fp8_matmul import mosaic_gpu

# pylint: disable=protected-access
_STORE_TILE = mosaic_gpu._store_tile
_PLAN_SMEM = mosaic_gpu._plan_smem
# pylint: enable=protected-access
NEVER = -12345.0  # a scale no call passes: B's runtime-false store guard


def _store_never(acc, scale_ref, out_tile, out_smem, wg):
  pl.when(scale_ref[0] == NEVER)(
      lambda: _STORE_TILE(acc, scale_ref, out_tile, out_smem, wg))


def _store_chunks(chunks=2, wait=True, second_buffer=False):
  """A's store of its first `chunks` 64-column chunks; without `wait` the
  second chunk does not wait for the first one's read, and goes to the
  second buffer (`_SecondBufferPlgpu`) with `second_buffer`, else races it
  (timing only)."""
  def store(acc, scale_ref, out_tile, out_smem, wg):
    y = (acc * scale_ref[0]).astype(out_tile.dtype)
    for j in range(chunks):
      buf = _SECOND_BUFFER[0] if j and second_buffer else out_smem
      if j == 0 or wait:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      buf[wg] = y[:, j * 64:(j + 1) * 64]
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(buf.at[wg], out_tile.at[:, pl.ds(j * 64, 64)])
  return store


_SECOND_BUFFER = []  # the extra buffer of the kernel being traced


class _PlgpuProxy:
  """`plgpu`, or another proxy of it, with the methods a subclass defines
  standing in for its own."""

  def __init__(self, inner=plgpu):
    self._inner = inner

  def __getattr__(self, name):
    return getattr(self._inner, name)


class _SecondBufferPlgpu(_PlgpuProxy):
  """`plgpu` whose kernels get a second epilogue buffer shaped like the
  first as one more scratch ref, hidden from the body and held in
  `_SECOND_BUFFER` while it is traced."""

  def kernel(self, body, *, scratch_types, **kwargs):
    first = scratch_types[0]

    def wrapped(*refs):
      _SECOND_BUFFER[:] = [refs[-1]]
      return body(*refs[:-1])
    extra = plgpu.SMEM(first.shape, first.dtype, transforms=first.transforms)
    return plgpu.kernel(wrapped, scratch_types=[*scratch_types, extra],
                        **kwargs)


def _writer_direct(cfg, s_gmem, refs):
  """Stores each warpgroup's rows from registers to GMEM. Needs M % 64 ==
  N % block_n == 0; warpgroups whose rows start past M store nothing."""
  out = refs[0]

  def write(acc, mi, ni, wg):
    row0 = mi * cfg.block_m + wg * cfg.wg_m
    y = (acc * s_gmem[0]).astype(out.dtype)

    @pl.when(row0 < out.shape[0])
    def _():
      out[pl.ds(row0, cfg.wg_m), pl.ds(ni * cfg.block_n, cfg.block_n)] = y
  return write


def _plan_cols(cols):
  """`_plan_smem` with `cols` epilogue columns per chunk."""
  def plan(cfg, in_itemsize, out_itemsize, *, out_cols=None, extra_bytes=0):
    return _PLAN_SMEM(cfg, in_itemsize, out_itemsize,
                      out_cols=out_cols or cols, extra_bytes=extra_bytes)
  return plan


@contextlib.contextmanager
def _patched(attrs, module=mosaic_gpu):
  """`module`'s attributes set to `attrs` ({name: value}) while inside."""
  with contextlib.ExitStack() as stack:
    for name, value in attrs.items():
      stack.enter_context(mock.patch.object(module, name, value))
    yield


THREE = mosaic_gpu.THREE_WG_CONFIG
FIVE = dataclasses.replace(THREE, max_stages=5)
# letter: (config, patches, whether the output is checked)
VARIANTS = {
    'A': (THREE, {}, True),
    'B': (THREE, {'_store_tile': _store_never}, False),
    'M': (THREE, {'_store_tile': _store_chunks(1)}, False),
    'C': (THREE, {'_plan_smem': _plan_cols(32)}, True),
    'D': (THREE, {'_plan_smem': _plan_cols(128)}, True),
    'N': (THREE, {'_store_tile': _store_chunks(wait=False)}, False),
    'S': (THREE, {'plgpu': _SecondBufferPlgpu(), '_store_tile': _store_chunks(
        wait=False, second_buffer=True)}, True),
    'R': (THREE, {'plgpu': _SecondBufferPlgpu()}, True),
    'E': (FIVE, {}, True),
    'F': (FIVE, {'_store_tile': _store_never}, False),
    'H': (THREE, {'_tile_writer': _writer_direct}, True),
}
GROUPS = 'ABM,ACD,ANS,AR,AEF,AH'  # each timed together, A first


def _compiled(letter, args, variants=None):
  """(jitted variant `letter` of `variants` (default VARIANTS), compiled
  for args, and its max relative error, or None where unchecked)."""
  cfg, patches, checked = (variants or VARIANTS)[letter]
  f = jax.jit(functools.partial(matmul.pallas, config=cfg))
  with _patched(patches):
    out = jax.block_until_ready(f(*args))
  return f, (matmul.check_close(out, *args) if checked else None)


def profile(group, shape):
  """Each variant of `group` once on `shape`, warmed, for ncu."""
  _, m, n, k, a_dtype = matmul.parse_shape(shape)
  operands = (*matmul.operands(m, n, k, a_dtype), jnp.float32(0.75))
  ncu_matmul.profile_calls([_compiled(v, operands)[0] for v in group],
                           operands, calls=1)


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--groups', default=GROUPS,
                 help='comma-separated strings of VARIANTS letters, A first')
  p.add_argument('--shapes', default='0,4,1',
                 help='matmul.SHAPES indices or MxNxK')
  p.add_argument('--rounds', type=int, default=15)
  p.add_argument('--profile', action='store_true',
                 help='run the first group once each for ncu, no timing')
  args = p.parse_args()
  print('device:', jax.devices()[0].device_kind, 'jax', jax.__version__,
        flush=True)
  if args.profile:
    profile(args.groups.split(',')[0], args.shapes.split(',')[0])
    return
  matmul.global_warmup(2.0)
  rows = []
  for spec in args.shapes.split(','):
    name, m, n, k, a_dtype = matmul.parse_shape(spec)
    a, b = matmul.operands(m, n, k, a_dtype)
    operands = (a, b, jnp.float32(0.75))
    flops = 2.0 * m * n * k
    for group in args.groups.split(','):
      fns, errs = zip(*(_compiled(v, operands) for v in group))
      times = matmul.time_mirrored(
          [*fns, jax.jit(matmul.xla_precise)], operands, args.rounds)
      for j, v in enumerate(group):
        vs_a = [ta / tv for ta, tv in zip(times[0], times[j])]
        vs_cublas = [tc / tv for tc, tv in zip(times[-1], times[j])]
        rows.append(dict(
            shape=name, group=group, variant=v, err=errs[j],
            tflops=flops / statistics.median(times[j]) / 1e12,
            vs_a=statistics.median(vs_a), vs_a_lo=min(vs_a),
            vs_a_hi=max(vs_a), vs_precise=statistics.median(vs_cublas)))
        print(json.dumps(rows[-1]), flush=True)
  print('\n| GEMM | group | variant | TFLOP/s | speed vs A (median, min..max)'
        ' | vs cuBLASLt precise | max rel err |')
  print('|---|---|---|---|---|---|---|')
  for r in rows:
    err = '-' if r['err'] is None else f'{r["err"]:.1e}'
    print(f'| {r["shape"]} | {r["group"]} | {r["variant"]} |'
          f' {r["tflops"]:.0f} | {r["vs_a"]:.3f} ({r["vs_a_lo"]:.3f}..'
          f'{r["vs_a_hi"]:.3f}) | {r["vs_precise"]:.3f} | {err} |')


if __name__ == '__main__':
  main()
