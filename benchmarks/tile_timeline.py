"""Per-warpgroup timelines of THREE_WG_CONFIG's tiles, from inside the kernel.

Diagnostic for issue 6 (NOTES.md, "The tile boundary, timed inside the
kernel"). Nsight Compute sums a kernel's cycles; it cannot say what a
warpgroup does between the last wgmma of one tile and the first of the
next. Mosaic GPU's on-device profiler can: with `CompilerParams(
profile_space=..., profile_dir=...)` every `jax.named_scope` the kernel
enters records the SM's %clock on entry and exit, per warpgroup, into SMEM,
and a host callback writes a Perfetto trace. The profiled kernels always
scope the epilogue (`_store_tile`) and, with --scopes, any of SCOPES: a
step's wgmma issue, jax's pipeline barrier waits and TMA loads, the tile
index and `setmaxnreg` (per-step scopes slow the mainloop; per-tile ones
do not measurably).

Variants: the letters of `epilogue_cost.VARIANTS` (A is THREE_WG_CONFIG,
whose memory warpgroup loads the next tile's stages while the last tile
finishes and whose compute warpgroups line up at each tile start; B is A
without stores), O (A draining its pipeline between tiles, as before
`overlap_tiles`), P (A without the line-up) and X (A with the profiler's
SMEM allocated and unused, for timing only).

Event buffers hold PROFILE_RANGES ranges per warpgroup (the SMEM the four
stages leave); later events are dropped. Each variant's profiled call runs
once, after a 2 s warm-up of the unprofiled kernel, and the script prints
medians in SM cycles over CTAs, compute warpgroups and recorded tiles (see
`summarize`). The raw event buffers go to --out (.npz; with --perfetto
also jax's Perfetto traces). --rounds and --sustained time the variants
unprofiled: in mirrored rounds, and in runs of some seconds with the SM
clock and the board power sampled (`matmul_power.py`). --steady traces
each variant right after seconds of itself (see `steady`).

  python3 benchmarks/tile_timeline.py --variants ABOP --shapes 0,4 \
      --scopes '' --rounds 9 --sustained 3 --out DIR
  python3 benchmarks/tile_timeline.py --variants AO --shapes 0 \
      --scopes issue,wait,load,setmaxnreg,snake
  python3 benchmarks/tile_timeline.py --variants AOP --shapes 0 --no-trace \
      --steady 3
"""

import argparse
import collections
import dataclasses
import functools
import glob
import gzip
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=g-import-not-at-top
from jax._src.pallas.mosaic_gpu import primitives as gpu_primitives
from jax.experimental.mosaic.gpu import profiler as mgpu_profiler
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np

from benchmarks import epilogue_cost
from benchmarks import matmul
from benchmarks import matmul_power
from pallas_kernels.fp8_matmul import mosaic_gpu

PROFILE_RANGES = 600  # per warpgroup: 4 x 600 x 16 B = 38 KiB of SMEM
MEMORY_WG = 3  # THREE_WG_CONFIG: warpgroups 0-2 compute, 3 loads


def _scoped(name, fn):
  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with jax.named_scope(name):
      return fn(*args, **kwargs)
  return wrapped


class _ProfiledPlgpu(epilogue_cost._PlgpuProxy):  # pylint: disable=protected-access
  """`plgpu` (or a variant's stand-in for it) whose kernels record their
  named scopes into `profile_dir`."""

  def __init__(self, inner, profile_dir):
    super().__init__(inner)
    self._dir = profile_dir

  def kernel(self, body, *, compiler_params, **kwargs):
    extra = dict(profile_space=PROFILE_RANGES, profile_dir=self._dir)
    fields = {f.name for f in dataclasses.fields(compiler_params)}
    if 'profile_bounds_check' in fields:  # jax >= 0.11: drop, not corrupt
      extra['profile_bounds_check'] = True
    return self._inner.kernel(
        body, compiler_params=dataclasses.replace(compiler_params, **extra),
        **kwargs)


# Scopes the profiled kernels can record, besides 'epilogue' (always): name
# -> (module, attribute) whose function gets wrapped. jax's pipeline calls
# the primitives through their module, the kernel its helpers through
# `mosaic_gpu`, and `plgpu.planar_snake` through the `plgpu` stand-in.
SCOPES = {
    'issue': (mosaic_gpu, '_issue_wgmmas'),  # a step's wgmmas (compute)
    'wait': (gpu_primitives, 'barrier_wait'),  # full / consumed barriers
    'load': (gpu_primitives, 'copy_gmem_to_smem'),  # a TMA load (memory)
    'setmaxnreg': (gpu_primitives, 'set_max_registers'),  # per pipeline
    'snake': (None, 'planar_snake'),  # the tile index of a loop step
}


def _jax_scopes(names):
  """Named scopes around the jax primitives in `names` (see SCOPES), while
  inside."""
  attrs = {SCOPES[n][1]: _scoped(n, getattr(gpu_primitives, SCOPES[n][1]))
           for n in names if SCOPES[n][0] is gpu_primitives}
  return epilogue_cost._patched(attrs, gpu_primitives)  # pylint: disable=protected-access


class _SnakeScopedPlgpu(epilogue_cost._PlgpuProxy):  # pylint: disable=protected-access
  """`plgpu` (or a stand-in) whose `planar_snake` records a 'snake' scope."""

  def planar_snake(self, *args, **kwargs):
    return _scoped('snake', self._inner.planar_snake)(*args, **kwargs)


class _ExtraSmemPlgpu(epilogue_cost._PlgpuProxy):  # pylint: disable=protected-access
  """`plgpu` (or a stand-in) whose kernels allocate as much more SMEM as
  the profiler's event buffers take, unused: the profiled kernel's SMEM
  footprint without the profiler."""

  def kernel(self, body, *, scratch_types, num_threads, **kwargs):
    nbytes = num_threads * PROFILE_RANGES * 16
    return self._inner.kernel(
        lambda *refs: body(*refs[:-1]), num_threads=num_threads,
        scratch_types=[*scratch_types, plgpu.SMEM((nbytes,), jnp.uint8)],
        **kwargs)


THREE = mosaic_gpu.THREE_WG_CONFIG
VARIANTS = {
    **epilogue_cost.VARIANTS,
    # A's tiles drained between (THREE_WG_CONFIG before overlap_tiles).
    'O': (dataclasses.replace(THREE, overlap_tiles=False), {}, True),
    # A without lining its compute warpgroups up at each tile start.
    'P': (THREE, {'_line_up': lambda barrier: None}, True),
    # A with the profiler's SMEM allocated and unused.
    'X': (THREE, {'plgpu': _ExtraSmemPlgpu()}, True),
}


def _no_dump():
  """Kernels compiled inside record their events but never copy them to
  the host: jax's lowering calls `jax.debug.callback` for the dump, and a
  host callback after every call would stop back-to-back timing."""
  return mock.patch.object(jax.debug, 'callback', lambda *a, **k: None)


def _profiled(letter, args, profile_dir, scopes, dump=True):
  """Variant `letter` of VARIANTS compiled with the profiler on and the
  named scopes 'epilogue' and `scopes`, called once (a cold trace); with
  dump=False the events stay on the device (`_no_dump`)."""
  cfg, patches, _ = VARIANTS[letter]
  patches = dict(patches)
  inner = patches.get('plgpu', plgpu)
  if 'snake' in scopes:
    inner = _SnakeScopedPlgpu(inner)
  patches['plgpu'] = _ProfiledPlgpu(inner, profile_dir)
  for name, attr in [('epilogue', '_store_tile')] + [
      (n, SCOPES[n][1]) for n in scopes if SCOPES[n][0] is mosaic_gpu]:
    patches[attr] = _scoped(name, patches.get(attr,
                                              getattr(mosaic_gpu, attr)))
  f = jax.jit(functools.partial(matmul.pallas, config=cfg))
  with epilogue_cost._patched(patches), _jax_scopes(scopes):  # pylint: disable=protected-access
    if dump:
      _run_and_read(f, args, profile_dir)
    else:
      with _no_dump():
        jax.block_until_ready(f(*args))
  return f


_RAW = []  # (buffer, names) of the last dump, from `_keep_raw`


def _keep_raw(dump):
  """ProfilerSpec.dump that also keeps the raw event buffer."""
  @functools.wraps(dump)
  def wrapped(spec, buffer, f, grid, block):
    _RAW[:] = [(np.asarray(buffer).reshape(int(np.prod(grid)), -1, spec
                                           .entries_per_warpgroup),
                dict(spec.interned_names))]
    return dump(spec, buffer, f, grid, block)
  return wrapped


def _compiled(letter, args):
  """Variant `letter` of VARIANTS compiled without the profiler."""
  return epilogue_cost._compiled(letter, args, VARIANTS)[0]  # pylint: disable=protected-access


def _run_and_read(f, args, profile_dir):
  """Calls f once; returns its Perfetto trace's path, its raw events
  ((CTAs, warpgroups, entries) uint32, {name: id}) and its output."""
  for path in glob.glob(os.path.join(profile_dir, '*.json')):
    os.remove(path)
  _RAW.clear()
  out = jax.block_until_ready(f(*args))
  jax.effects_barrier()
  (path,) = glob.glob(os.path.join(profile_dir, '*.json'))
  return path, _RAW[0], out


def ranges(raw):
  """{(cta, wg): [(name, start, end)]} from a raw event buffer, in SM
  cycles since the CTA's first event.

  Each warpgroup's row is [start ns, SM id, entries used, (tag, %clock)
  pairs...]; a tag is a name id, with bit 31 set on exit.
  """
  buffer, names = raw
  unintern = {v: k for k, v in names.items()}
  exit_bit = 1 << 31
  out = {}
  for cta in range(buffer.shape[0]):
    rows = buffer[cta].astype(np.int64)
    used = rows[:, 2]
    firsts = [rows[wg, 4] for wg in range(rows.shape[0]) if used[wg]]
    if not firsts:
      continue
    origin = min(firsts)
    for wg in range(rows.shape[0]):
      pairs = rows[wg, 3:3 + used[wg]].reshape(-1, 2)
      stack, spans = [], []
      for tag, clock in pairs:
        t = (clock - origin) % (1 << 32)  # %clock is 32 bits and wraps
        if tag & exit_bit:
          if stack:  # a dropped entry leaves an exit unmatched
            name, start = stack.pop()
            spans.append((name, start, t))
        else:
          stack.append((unintern[tag], t))
      out[(cta, wg)] = sorted(spans, key=lambda x: x[1])
  return out


def _tiles(spans):
  """A compute warpgroup's spans split at its epilogues: per tile, a dict
  of 'issue' starts, 'wait' durations and the 'epilogue' (start, end) or
  None for a tile whose epilogue was not recorded."""
  tiles, cur = [], {'issue': [], 'wait': []}
  for name, start, end in spans:
    if name == 'issue':
      cur['issue'].append(start)
    elif name == 'wait':
      cur['wait'].append(end - start)
    elif name == 'epilogue':
      tiles.append(dict(cur, epilogue=(start, end)))
      cur = {'issue': [], 'wait': []}
  if cur['issue']:
    tiles.append(dict(cur, epilogue=None))
  return tiles


def summarize(raw, k_steps):
  """Medians in SM cycles over CTAs, compute warpgroups and the recorded
  tile boundaries (a tile's epilogue start to the next one's, and so on)."""
  spans = ranges(raw)
  vals = collections.defaultdict(list)
  for cta in sorted({c for c, _ in spans}):
    per_wg = [_tiles(spans[(cta, wg)]) for wg in range(MEMORY_WG)
              if (cta, wg) in spans]
    for tiles in per_wg:
      epis = [t['epilogue'] for t in tiles if t['epilogue']]
      vals['tile_period'] += np.diff([e[0] for e in epis]).tolist()
      vals['epilogue'] += [e[1] - e[0] for e in epis]
      for tile, nxt in zip(tiles, tiles[1:]):
        issues, ep = tile['issue'], tile['epilogue']
        if len(issues) != k_steps or not ep or not nxt['issue']:
          continue
        vals['step_period'] += np.diff(issues[2:]).tolist()
        vals['steady_wait'] += tile['wait'][2:]
        vals['last_step'].append(ep[0] - issues[-1])
        vals['boundary'].append(nxt['issue'][0] - issues[-1])
        vals['epilogue_to_next_issue'].append(nxt['issue'][0] - ep[1])
        if nxt['wait']:
          vals['first_wait'].append(nxt['wait'][0])
    # Across the warpgroups of the CTA, per tile boundary.
    epi_starts = [[t['epilogue'][0] for t in tiles if t['epilogue']]
                  for tiles in per_wg]
    for row in zip(*epi_starts):
      vals['epilogue_skew'].append(max(row) - min(row))
    lasts = [[t['issue'][-1] for t in tiles if t['issue'] and t['epilogue']]
             for tiles in per_wg]
    firsts = [[t['issue'][0] for t in tiles[1:] if t['issue']]
              for tiles in per_wg]
    for last, first in zip(zip(*lasts), zip(*firsts)):
      vals['tensor_gap'].append(min(first) - max(last))
    # Memory warpgroup: the first load of tile t + 1 against the first
    # epilogue start of tile t (negative: before it).
    mem = spans.get((cta, MEMORY_WG), [])
    loads = [start for name, start, _ in mem if name == 'load']
    for t, row in enumerate(zip(*epi_starts)):
      i = 2 * k_steps * (t + 1)
      if i < len(loads):
        vals['next_load_vs_epilogue'].append(loads[i] - min(row))
    for (c, wg), wg_spans in spans.items():
      if c != cta:
        continue
      role = 'memory' if wg == MEMORY_WG else 'compute'
      for name, start, end in wg_spans:
        if name not in ('issue', 'wait', 'load', 'epilogue'):
          vals[f'{name}_{role}'].append(end - start)
  out = {'ctas': len({c for c, _ in spans}),
         # The slowest CTA, first event to last: the kernel less its launch.
         'kernel_cycles': float(max(
             max((end for _, _, end in wg_spans), default=0)
             for wg_spans in spans.values()))}
  out.update({k: float(statistics.median(v)) for k, v in vals.items() if v})
  if 'boundary' in out:
    out['boundary_over_step'] = out['boundary'] - out['step_period']
    if 'tile_period' in out:
      out['boundary_pct'] = (100 * out['boundary_over_step']
                             / out['tile_period'])
  return out


def steady(letters, spec, seconds, repeats, profile_dir, scopes):
  """Each variant's tile timeline at its own steady state, and what the
  profiler costs it there.

  Per variant, in `repeats` alternating rounds: the unprofiled kernel back
  to back for `seconds`, the profiled one (events kept on the device) for
  as long, then one profiled call whose events are read. Returns
  (matmul_power runs, rows); a row is `summarize` of that call plus
  'mhz_in_kernel', its kernel cycles over the profiled runs' time per call
  (launch gaps included, so a lower bound on the SM clock the kernel saw),
  and 'stray_dumps', traces the undumped kernels wrote (0 expected).
  """
  name, m, n, k, a_dtype = matmul.parse_shape(spec)
  operands = (*matmul.operands(m, n, k, a_dtype), jnp.float32(0.75))
  flops = 2.0 * m * n * k
  k_steps = k // mosaic_gpu.THREE_WG_CONFIG.block_k
  fns = {v: (_compiled(v, operands),
             _profiled(v, operands, profile_dir, scopes, dump=False),
             _profiled(v, operands, profile_dir, scopes)) for v in letters}
  precise = jax.jit(matmul.xla_precise)
  runs, rows = [], []
  for _ in range(repeats):
    for v in letters:
      plain, quiet, loud = fns[v]
      for label, f in ((v, plain), (f'{v} profiled', quiet)):
        t0, t1, calls = matmul_power.run_for(f, operands, seconds)
        runs.append((name, label, t0, t1, flops * calls / (t1 - t0)))
      stray = len(glob.glob(os.path.join(profile_dir, '*.json')))
      path, raw, _ = _run_and_read(loud, operands, profile_dir)
      os.remove(path)
      row = dict(shape=name, variant=f'{v} steady', **summarize(raw, k_steps))
      row['mhz_in_kernel'] = row['kernel_cycles'] * calls / (t1 - t0) / 1e6
      row['stray_dumps'] = stray
      rows.append(row)
      print(json.dumps(row), flush=True)
    t0, t1, calls = matmul_power.run_for(precise, operands, seconds)
    runs.append((name, 'precise', t0, t1, flops * calls / (t1 - t0)))
  return runs, rows


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--variants', default='AB',
                 help='VARIANTS letters, each traced once')
  p.add_argument('--shapes', default='0', help='matmul.SHAPES indices or MxNxK')
  p.add_argument('--scopes', default='',
                 help='comma-separated SCOPES to record beside the epilogue'
                 ' (per-step ones slow the mainloop ~35%%: read only their'
                 ' tile boundaries)')
  p.add_argument('--out', default=None,
                 help='folder for the raw event buffers (.npz)')
  p.add_argument('--perfetto', action='store_true',
                 help='also write the Perfetto traces (.json.gz) to --out')
  p.add_argument('--rounds', type=int, default=0,
                 help='also time the variants unprofiled, in mirrored rounds'
                 ' with cuBLASLt precise (matmul.time_mirrored)')
  p.add_argument('--sustained', type=float, default=0.0,
                 help='also run each variant and cuBLASLt precise for this'
                 ' many seconds, twice, sampling clock and power'
                 ' (matmul_power.py)')
  p.add_argument('--steady', type=float, default=0.0,
                 help='also trace each variant after this many seconds of'
                 ' itself, profiled and not, twice, with clock and power'
                 ' (`steady`)')
  p.add_argument('--no-trace', action='store_true',
                 help='only time (--rounds, --sustained), trace nothing')
  args = p.parse_args()
  print('device:', jax.devices()[0].device_kind, 'jax', jax.__version__,
        flush=True)
  mgpu_profiler.ProfilerSpec.dump = _keep_raw(mgpu_profiler.ProfilerSpec.dump)
  scopes = [x for x in args.scopes.split(',') if x]
  unknown = set(scopes) - set(SCOPES)
  if unknown:
    p.error(f'--scopes: unknown {sorted(unknown)}; known: {sorted(SCOPES)}')
  rows = []
  profile_dir = tempfile.mkdtemp(prefix='tile_timeline_')
  for spec in args.shapes.split(','):
    name, m, n, k, a_dtype = matmul.parse_shape(spec)
    operands = (*matmul.operands(m, n, k, a_dtype), jnp.float32(0.75))
    k_steps = k // mosaic_gpu.THREE_WG_CONFIG.block_k
    plain = jax.jit(functools.partial(matmul.pallas,
                                      config=mosaic_gpu.THREE_WG_CONFIG))
    for letter in args.variants if not args.no_trace else ():
      f = _profiled(letter, operands, profile_dir, scopes)
      matmul_power.run_for(plain, operands, 2.0)
      path, raw, out = _run_and_read(f, operands, profile_dir)
      err = (matmul.check_close(out, *operands) if VARIANTS[letter][2]
             else None)
      if args.out:
        os.makedirs(args.out, exist_ok=True)
        tag = re.sub(r'[^A-Za-z0-9]+', '_', f'{name}_{letter}_{args.scopes}')
        stem = os.path.join(args.out, tag)
        if args.perfetto:
          with open(path, 'rb') as src, gzip.open(stem + '.json.gz',
                                                  'wb') as dst:
            shutil.copyfileobj(src, dst)
        np.savez_compressed(stem + '.npz', buffer=raw[0],
                            names=json.dumps(raw[1]))
      rows.append(dict(shape=name, variant=letter, max_rel_err=err,
                       **summarize(raw, k_steps)))
      print(json.dumps(rows[-1]), flush=True)
    if args.rounds:
      if args.no_trace:
        rows += [dict(shape=name, variant=v) for v in args.variants]
      fns = [_compiled(v, operands) for v in args.variants]
      times = matmul.time_mirrored([*fns, jax.jit(matmul.xla_precise)],
                                   operands, args.rounds)
      for row, t in zip(rows[-len(fns):], times):
        row['vs_first'] = statistics.median(
            [t0 / tv for t0, tv in zip(times[0], t)])
        row['vs_precise'] = statistics.median(
            [tc / tv for tc, tv in zip(times[-1], t)])
        print(json.dumps(row), flush=True)
    if args.steady:
      (runs, steady_rows), samples = matmul_power.sampled(lambda: steady(
          args.variants, spec, args.steady, 2, profile_dir, scopes))
      rows += steady_rows
      matmul_power.report(runs, samples)
    if args.sustained:
      impls = [(v, _compiled(v, operands)) for v in args.variants]
      matmul_power.report(*matmul_power.sampled(lambda: matmul_power.measure(
          [spec], 2, args.sustained, impls)))
  keys = [k for k in dict.fromkeys(k for r in rows for k in r)
          if k not in ('shape', 'variant')]
  print('\n| GEMM | variant | ' + ' | '.join(keys) + ' |')
  print('|---|---|' + '---|' * len(keys))
  for r in rows:
    print(f'| {r["shape"]} | {r["variant"]} | ' + ' | '.join(
        f'{r[k]:.4g}' if isinstance(r.get(k), float) else str(r.get(k, '-'))
        for k in keys) + ' |')


if __name__ == '__main__':
  main()
