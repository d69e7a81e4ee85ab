"""Where a train.py step spends its time on the GPU, per precision mode.

Builds the same jitted step as train.py (`coat_jax.training.build`), times
it as a train loop runs it (`step_times`), then traces three steps
with `jax.profiler` and sums the GPU kernels' time by kind of op, so that the
modes can be compared op class by op class.

  PYTHONPATH=. python benchmarks/step_profile.py --modes bf16,coat

On several GPUs (a mesh from --set, e.g. `--config configs/llama2_7b.py
--set mesh.data=1 mesh.fsdp=2 train.batch_size=4`) the kernel times are
per GPU, and it prints how much of the first GPU's NCCL kernel time runs
with no other kernel beside it (collectives that compute does not hide).
"""

import argparse
import collections
import functools
import glob
import json
import os
import re
import statistics
import tempfile
import time

import jax
import numpy as np

from benchmarks.train_modes import MODES
from coat_jax import training
from coat_jax.training import sharding as sharding_lib
from coat_jax.training import trainer

# Kernel-name patterns -> op class, first match wins.
CLASSES = (
    # NCCL's kernels (ncclDevKernel_AllGather_..., _ReduceScatter_...).
    (NCCL := 'collectives (nccl)', r'nccl'),
    # The Pallas SwiGLU and RMSNorm kernels are named *_fp8_*: not GEMMs.
    ('other', r'^(swiglu|rms_norm)_fp8'),
    # cuBLASLt's nvjet kernels spell FP8 operands q (E4M3) and r (E5M2);
    # the Pallas Mosaic GEMMs are fp8_matmul*_mosaic_gpu_kernel.
    ('fp8 gemm', r'f8|fp8|e4m3|e5m2|nvjet_sm90_[qr][qr]'),
    ('gemm', r'gemm|cublas|cutlass|sm90_xmma|nvjet|matmul|dot'),
    ('attention', r'cudnn|flash|fmha|attention|sdpa'),
    ('copy / transpose / update-slice', r'dynamic.update|dynamic_update|copy|'
     r'memcpy|memset|transpose'),
    ('reduce', r'reduce|reduction'),
    ('fusion (elementwise)', r'fusion|loop|input'),
)


def classify(name: str) -> str:
  lower = name.lower()
  for label, pattern in CLASSES:
    if re.search(pattern, lower):
      return label
  return 'other'


def step_times(step, state, batch, steps, group=4):
  """(seconds per step in a train loop, seconds per step blocked on, the
  last state), medians after >= 2 s of warm-up.

  A train loop (train.py's) dispatches each step while the GPU still runs
  the one before, so the host's dispatch of a step hides behind the GPU's
  work: the loop's figure is the median over max(2, steps // 2) runs of
  `group` steps dispatched back to back, blocked on once. The blocked-on
  figure (the median of `steps` steps, each dispatched and waited for
  alone) adds each step's dispatch and the wait.
  """
  start = time.perf_counter()
  while time.perf_counter() - start < 2.0:
    state, metrics = step(state, *batch)
    jax.block_until_ready(metrics)
  blocked = []
  for _ in range(steps):
    t0 = time.perf_counter()
    state, metrics = step(state, *batch)
    jax.block_until_ready(metrics)
    blocked.append(time.perf_counter() - t0)
  looped = []
  for _ in range(max(2, steps // 2)):
    t0 = time.perf_counter()
    for _ in range(group):
      state, metrics = step(state, *batch)
    jax.block_until_ready(metrics)
    looped.append((time.perf_counter() - t0) / group)
  return statistics.median(looped), statistics.median(blocked), state


def kernel_totals(trace_dir, steps):
  """{kernel name: ms per step} over the GPU planes of a trace."""
  return _totals(kernel_stats(trace_dir, steps))


def _totals(stats):
  return collections.Counter({name: ms for name, (ms, _) in stats.items()})


def class_totals(trace_dir, steps):
  """{op class (`classify`): GPU kernel ms per step, per device}."""
  return by_class(kernel_totals(trace_dir, steps))


def by_class(kernels) -> dict:
  """{kernel name: ms} summed by op class (`classify`)."""
  totals = collections.Counter()
  for name, ms in kernels.items():
    totals[classify(name)] += ms
  return dict(totals)


@functools.lru_cache(maxsize=2)  # a trace is read once for each table
def _gpu_streams(trace_dir):
  """[the GPU stream lines of one device] for each GPU in the trace in
  trace_dir (the kernels; 'XLA Ops' etc. repeat them), by device name."""
  path, = glob.glob(os.path.join(trace_dir, '**', '*.xplane.pb'),
                    recursive=True)
  data = jax.profiler.ProfileData.from_file(path)
  planes = sorted((p for p in data.planes
                   if p.name.startswith('/device:GPU')),
                  key=lambda p: p.name)
  devices = [[line for line in p.lines if line.name.startswith('Stream')]
             for p in planes]
  if not any(devices):
    print('no GPU stream lines in the trace; lines:',
          sorted({line.name for p in planes for line in p.lines}))
  return devices


def _stream_lines(trace_dir):
  """The GPU stream lines of every device in the trace."""
  return [line for lines in _gpu_streams(trace_dir) for line in lines]


def kernel_stats(trace_dir, steps):
  """{kernel name: (ms per step, launches per step)} over the GPU streams
  of a trace, per device (the mean over the devices)."""
  devices = _gpu_streams(trace_dir)
  n = max(1, len(devices))
  totals, launches = collections.Counter(), collections.Counter()
  for line in _stream_lines(trace_dir):
    for event in line.events:
      totals[event.name] += event.duration_ns / 1e6 / steps / n
      launches[event.name] += 1 / steps / n
  return {name: (ms, launches[name]) for name, ms in totals.items()}


def _union(intervals):
  """Sorted disjoint [start, end] intervals covering `intervals`."""
  out = []
  for start, end in sorted(intervals):
    if out and start <= out[-1][1]:
      out[-1][1] = max(out[-1][1], end)
    else:
      out.append([start, end])
  return out


def _first_gpu_kernels(trace_dir):
  """([(collective kind, (start_ns, end_ns))] of the NCCL kernels,
  [(start_ns, end_ns)] of the others) on the first GPU of a trace."""
  devices = _gpu_streams(trace_dir)
  collectives, compute = [], []
  for line in devices[0] if devices else []:
    for e in line.events:
      interval = (e.start_ns, e.start_ns + e.duration_ns)
      if classify(e.name) == NCCL:
        collectives.append((nccl_kind(e.name), interval))
      else:
        compute.append(interval)
  return collectives, compute


def exposed_collectives(trace_dir, steps):
  """(NCCL kernel ms per step, of which ms with no other kernel running)
  on the first GPU of a trace: collectives that compute does not hide."""
  collectives, compute = _first_gpu_kernels(trace_dir)
  nccl = [interval for _, interval in collectives]
  total = sum(end - start for start, end in nccl)
  return total / 1e6 / steps, uncovered(nccl, compute) / 1e6 / steps


def uncovered(intervals, others):
  """How much of the union of `intervals` no interval of `others` covers
  ((start, end) pairs, the same unit)."""
  return _uncovered_by(intervals, _union(others))


def _uncovered_by(intervals, busy):
  """`uncovered` against `busy`, already a `_union`."""
  return sum(end - start - sum(max(0, min(end, b) - max(start, a))
                               for a, b in busy)
             for start, end in _union(intervals))


# NCCL kernel names (ncclDevKernel_AllGather_RING_LL, ..._ReduceScatter_
# Sum_bf16_...), lower-cased, and the collective each runs.
_NCCL_KINDS = (('allgather', 'all-gather'), ('reducescatter', 'reduce-scatter'),
               ('allreduce', 'all-reduce'), ('alltoall', 'all-to-all'),
               ('sendrecv', 'send-recv'))


def nccl_kind(name: str) -> str:
  """The collective an NCCL kernel runs ('all-gather', ...; 'other')."""
  low = name.lower()
  return next((kind for key, kind in _NCCL_KINDS if key in low), 'other')


def split_by_kind(collectives, compute, steps):
  """{kind: (kernels, ms, ms that no compute interval covers), each per
  step} from (kind, (start_ns, end_ns)) collective kernels and the
  (start_ns, end_ns) compute kernels of one GPU over `steps` steps."""
  busy = _union(compute)
  by_kind = collections.defaultdict(list)
  for kind, interval in collectives:
    by_kind[kind].append(interval)
  return {kind: (len(ivs) / steps,
                 sum(end - start for start, end in ivs) / 1e6 / steps,
                 _uncovered_by(ivs, busy) / 1e6 / steps)
          for kind, ivs in sorted(by_kind.items())}


def collectives_by_kind(trace_dir, steps):
  """`split_by_kind` of the first GPU of a trace ({} without GPUs)."""
  return split_by_kind(*_first_gpu_kernels(trace_dir), steps)


def kernel_gaps(trace_dir, steps, top=8):
  """(idle ms per step, [(kernel after the gap, ms per step)] for the `top`
  kernels that most often wait on an idle GPU): time between one kernel's
  end and the next one's start on the busiest stream, gaps between the
  traced steps excluded."""
  streams = _stream_lines(trace_dir)
  if not streams:
    return 0.0, []
  busiest = max(streams, key=lambda line: sum(e.duration_ns
                                              for e in line.events))
  events = sorted(busiest.events, key=lambda e: e.start_ns)
  gaps = [(b.start_ns - (a.start_ns + a.duration_ns), b.name)
          for a, b in zip(events, events[1:])]
  # The largest `steps - 1` gaps separate the traced steps.
  step_breaks = sorted(g for g, _ in gaps)[-(steps - 1):] if steps > 1 else []
  by_next = collections.Counter()
  for gap, name in gaps:
    if gap > 0 and (not step_breaks or gap < step_breaks[0]):
      by_next[name] += gap / 1e6 / steps
  return sum(by_next.values()), by_next.most_common(top)


def profile(config, steps):
  setup = training.build(config)
  t = config.train
  tokens = np.random.default_rng(0).integers(
      0, trainer.llama_config(config.model).vocab_size,
      (t.batch_size, config.data.seq_len + 1), dtype=np.int32)
  sharding = sharding_lib.batch_sharding(setup.mesh)
  batch = [trainer.device_batch(x, sharding)
           for x in (tokens[:, :-1], tokens[:, 1:])]
  with jax.set_mesh(setup.mesh):
    t0 = time.perf_counter()
    state = setup.init_state()
    compiled = setup.train_step.lower(state, *batch).compile()
    compile_s = time.perf_counter() - t0
    seconds, _, state = step_times(compiled, state, batch, steps)
    trace_dir = tempfile.mkdtemp(prefix='step_profile_')
    with jax.profiler.trace(trace_dir):
      for _ in range(3):
        state, metrics = compiled(state, *batch)
      jax.block_until_ready(metrics)
  # Peak memory is per process: train_modes.py measures it, one mode each.
  temp = compiled.memory_analysis().temp_size_in_bytes
  stats = kernel_stats(trace_dir, 3)
  return dict(seconds=seconds, compile_s=compile_s, temp=temp,
              gaps=kernel_gaps(trace_dir, 3), kernels=_totals(stats),
              collectives=exposed_collectives(trace_dir, 3), stats=stats,
              hlo=compiled.as_text())


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--config', default='configs/llama_1b.py')
  parser.add_argument('--modes', default='bf16,coat')
  parser.add_argument('--steps', type=int, default=10)
  parser.add_argument('--top', type=int, default=12)
  parser.add_argument('--set', nargs='*', default=[])
  parser.add_argument('--dump', default=None,
                      help='folder for each mode\'s optimized HLO and its'
                      ' kernel times (JSON), to look up what a kernel runs')
  args = parser.parse_args()
  base = training.load_config(args.config)
  results = {}
  for mode in args.modes.split(','):
    config = training.apply_overrides(
        base, [*MODES[mode], 'train.checkpoint_every=0', *args.set])
    results[mode] = r = profile(config, args.steps)
    if args.dump:
      os.makedirs(args.dump, exist_ok=True)
      with open(os.path.join(args.dump, f'{mode}.hlo.txt'), 'w') as f:
        f.write(r['hlo'])
      with open(os.path.join(args.dump, f'{mode}.kernels.json'), 'w') as f:
        # {kernel name: [ms per step, launches per step]}, slowest first.
        json.dump(dict(sorted(r['stats'].items(), key=lambda kv: -kv[1][0])),
                  f, indent=0)
    tokens = config.train.batch_size * config.data.seq_len
    print(f'\n== {mode}: {r["seconds"] * 1e3:.1f} ms/step,'
          f' {tokens / r["seconds"]:,.0f} tokens/s, compile+init'
          f' {r["compile_s"]:.0f} s, compiled temp'
          f' {r["temp"] / 2**30:.2f} GiB', flush=True)
    for name, ms in r['kernels'].most_common(args.top):
      print(f'  {ms:8.2f} ms  {classify(name):28s} {name[:90]}')
    small = [(ms, n) for ms, n in r['stats'].values() if ms / n < 0.005]
    print(f'  kernels under 5 us each: {sum(n for _, n in small):.0f}'
          f' launches, {sum(ms for ms, _ in small):.2f} ms per step')
    nccl, exposed = r['collectives']
    if nccl:
      print(f'  NCCL kernels on the first GPU: {nccl:.2f} ms per step,'
            f' {exposed:.2f} ms of it with no other kernel running')
    idle, waits = r['gaps']
    print(f'  idle between kernels on the busiest stream: {idle:.2f} ms per'
          ' step; most before:')
    for name, ms in waits:
      print(f'    {ms:7.3f} ms  {name[:90]}')
  print(f'\n{jax.device_count()} x {jax.devices()[0].device_kind}, jax'
        f' {jax.__version__}, {args.config}, GPU kernel ms per step (per'
        ' GPU) by op class')
  labels = [label for label, _ in CLASSES if label != 'other'] + ['other']
  print('| op class | ' + ' | '.join(results) + ' |')
  print('|---|' + '---|' * len(results))
  columns = [{**by_class(r['kernels']),
              'all kernels': sum(r['kernels'].values()),
              'step (wall)': r['seconds'] * 1e3} for r in results.values()]
  for label in labels + ['all kernels', 'step (wall)']:
    cells = [f'{column.get(label, 0.0):.1f}' for column in columns]
    print(f'| {label} | ' + ' | '.join(cells) + ' |')


if __name__ == '__main__':
  main()
