"""Where a train.py step spends its time on the GPU, per precision mode
(RESULTS.md "e2e-1b": the step's kernel time by op class).

  PYTHONPATH=. python benchmarks/step_profile.py --modes bf16,coat [--gemms]

Builds the same jitted step as train.py (`coat_jax.training.build`), times
it as a train loop runs it (`step_times`), then traces three steps with
`jax.profiler` and sums the GPU kernels' time by kind of op, so that the
modes can be compared op class by op class. e2e.py and fsdp.py use its
timing and its trace readers.

With --gemms it also lists each GEMM kernel's time per shape (M x N x K and
operand dtypes from the compiled HLO), to set beside `matmul.py --in-step`;
the step is then compiled without CUDA graphs (their kernels carry the
graph's name, not their HLO instruction's), and the times it prints are
that step's.

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
import math
import os
import re
import statistics
import tempfile
import time
import warnings

import jax
import numpy as np

from benchmarks.e2e import MODE_OVERRIDES
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
  return by_kernel(op_stats(trace_dir, steps))


def by_kernel(ops: dict) -> dict:
  """`op_stats`'s {(kernel, HLO op): (ms, launches)} summed by kernel."""
  totals = collections.defaultdict(lambda: [0.0, 0.0])
  for (name, _), (ms, launches) in ops.items():
    totals[name][0] += ms
    totals[name][1] += launches
  return {name: tuple(v) for name, v in totals.items()}


def op_stats(trace_dir, steps):
  """{(kernel name, HLO op): (ms per step, launches per step)} over the GPU
  streams of a trace, per device: `kernel_stats` split by the HLO
  instruction that launched each kernel (its 'hlo_op' stat; '' without)."""
  devices = _gpu_streams(trace_dir)
  n = max(1, len(devices))
  totals, launches = collections.Counter(), collections.Counter()
  with warnings.catch_warnings():
    # jax's profiler data: "builtin type event_stats has no __module__
    # attribute".
    warnings.simplefilter('ignore', DeprecationWarning)
    for line in _stream_lines(trace_dir):
      for event in line.events:
        key = (event.name, dict(event.stats).get('hlo_op', ''))
        totals[key] += event.duration_ns / 1e6 / steps / n
        launches[key] += 1 / steps / n
  return {key: (ms, launches[key]) for key, ms in totals.items()}


# An instruction of optimized HLO text: name, result shape(s), opcode and
# the text after its opening parenthesis (operands, then attributes).
_HLO_INSTRUCTION = re.compile(
    r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$')
_HLO_ARRAY = re.compile(r'\b([a-z]+[a-z0-9]*)\[([\d,]*)\]')
_HLO_OPERAND = re.compile(r'%([\w.\-]+)')


def _first_array(text):
  """(dtype, dims) of the first array shape spelled in `text`, or None."""
  match = _HLO_ARRAY.search(text)
  if not match:
    return None
  dtype, dims = match.groups()
  return dtype, tuple(int(d) for d in dims.split(',') if d)


def _operand_list(text):
  """The operand list at the start of `text` (what follows an opcode's
  opening parenthesis), up to its closing one."""
  depth = 0
  for i, ch in enumerate(text):
    depth += {'(': 1, ')': -1}.get(ch, 0)
    if depth < 0:
      return text[:i]
  return text


def gemm_shapes(hlo_text: str) -> dict:
  """{instruction name: (M, N, K, 'a_dtype x b_dtype')} for each
  instruction of `hlo_text` whose result (its first array) is 2-D and
  whose first two 2-D operands hold M * K and N * K elements: a GEMM's
  (cuBLAS(Lt) custom calls, Mosaic GPU kernels, dots, GEMM fusions).
  Layout-blind: K = sqrt(|a| |b| / |out|)."""
  results, instructions = {}, []
  for line in hlo_text.splitlines():
    match = _HLO_INSTRUCTION.match(line)
    if match:
      name, result, _, rest = match.groups()
      results[name] = _first_array(result)
      instructions.append((name, _HLO_OPERAND.findall(_operand_list(rest))))
  shapes = {}
  for name, operands in instructions:
    out = results[name]
    ins = [results.get(x) for x in operands]
    ins = [x for x in ins if x and len(x[1]) == 2]
    if not out or len(out[1]) != 2 or len(ins) < 2:
      continue
    (m, n), a, b = out[1], math.prod(ins[0][1]), math.prod(ins[1][1])
    k = round((a * b / (m * n)) ** 0.5) if m * n else 0
    if k and a == m * k and b == n * k:
      shapes[name] = (m, n, k, f'{ins[0][0]} x {ins[1][0]}')
  return shapes


def gemm_table(ops: dict, hlo_text: str) -> list:
  """[(op class, kernel name, M, N, K, dtypes, launches, ms, TFLOP/s)] per
  step, one row per GEMM kernel and shape, slowest first: `op_stats`'s
  GEMM kernels (classes 'fp8 gemm' and 'gemm') matched to their
  instructions' shapes in `hlo_text` (the compiled step's); kernels whose
  instruction is not a plain GEMM come as M = N = K = 0."""
  shapes = gemm_shapes(hlo_text)
  rows = collections.defaultdict(lambda: [0.0, 0.0])
  for (kernel, op), (ms, launches) in ops.items():
    label = classify(kernel)
    if label not in ('fp8 gemm', 'gemm'):
      continue
    m, n, k, dtypes = shapes.get(op, (0, 0, 0, ''))
    row = rows[(label, kernel, m, n, k, dtypes)]
    row[0] += launches
    row[1] += ms
  table = [(*key, launches, ms,
            2 * key[2] * key[3] * key[4] * launches / (ms * 1e9) if ms else 0.)
           for key, (launches, ms) in rows.items()]
  return sorted(table, key=lambda row: -row[7])


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


def profile(config, steps, gemms=False):
  """Compiles, times and traces train.py's step for `config`. With
  `gemms` the step is compiled without CUDA graphs (XLA's command buffers,
  whose kernels all carry the graph's name), so that each kernel in the
  trace names its HLO instruction: what `gemm_table` needs."""
  setup = training.build(config)
  t = config.train
  tokens = np.random.default_rng(0).integers(
      0, training.architecture(config.model).vocab_size,
      (t.batch_size, config.data.seq_len + 1), dtype=np.int32)
  sharding = sharding_lib.batch_sharding(setup.mesh)
  batch = [trainer.device_batch(x, sharding)
           for x in (tokens[:, :-1], tokens[:, 1:])]
  with jax.set_mesh(setup.mesh):
    t0 = time.perf_counter()
    state = setup.init_state()
    options = {'xla_gpu_enable_command_buffer': ''} if gemms else None
    compiled = setup.train_step.lower(state, *batch).compile(
        compiler_options=options)
    compile_s = time.perf_counter() - t0
    seconds, _, state = step_times(compiled, state, batch, steps)
    trace_dir = tempfile.mkdtemp(prefix='step_profile_')
    with jax.profiler.trace(trace_dir):
      for _ in range(3):
        state, metrics = compiled(state, *batch)
      jax.block_until_ready(metrics)
  # Peak memory is per process: e2e.py measures it, one point a process.
  temp = compiled.memory_analysis().temp_size_in_bytes
  ops = op_stats(trace_dir, 3)
  stats = by_kernel(ops)
  return dict(seconds=seconds, compile_s=compile_s, temp=temp,
              gaps=kernel_gaps(trace_dir, 3), kernels=_totals(stats), ops=ops,
              collectives=exposed_collectives(trace_dir, 3), stats=stats,
              hlo=compiled.as_text())


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--config', default='configs/llama_1b.py')
  parser.add_argument('--modes', default='bf16,coat')
  parser.add_argument('--steps', type=int, default=10)
  parser.add_argument('--top', type=int, default=12)
  parser.add_argument('--set', nargs='*', default=[])
  parser.add_argument('--gemms', action='store_true',
                      help='each GEMM kernel\'s time per shape (M x N x K'
                      ' from the compiled HLO); the step then runs without'
                      ' CUDA graphs')
  parser.add_argument('--dump', default=None,
                      help='folder for each mode\'s optimized HLO and its'
                      ' kernel times (JSON), to look up what a kernel runs')
  args = parser.parse_args()
  base = training.load_config(args.config)
  results = {}
  for mode in args.modes.split(','):
    config = training.apply_overrides(
        base, [*MODE_OVERRIDES[mode], 'train.checkpoint_every=0',
               *args.set])
    results[mode] = r = profile(config, args.steps, args.gemms)
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
    if args.gemms:
      print('  GEMMs per step: launches, ms, us each, TFLOP/s, kernel,'
            ' M x N x K, operands')
      for _, kernel, m, n, k, dtypes, launches, ms, tflops in gemm_table(
          r['ops'], r['hlo']):
        print(f'  {launches:6.1f} {ms:8.2f} {1e3 * ms / launches:8.1f}'
              f' {tflops:7.0f}  {kernel[:40]:40s} {m}x{n}x{k} {dtypes}')
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
