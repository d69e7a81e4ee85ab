"""FSDP on N GPUs: memory, speed, sharding and collectives, scaling, and a
checkpoint restored on fewer devices, in one command (RESULTS.md "fsdp-4").

  PYTHONPATH=. python benchmarks/fsdp.py --out runs/fsdp.jsonl --budget-s 540

Every point runs in its own process (this script re-invoked with --point),
on the first n devices (CUDA_VISIBLE_DEVICES on GPUs, a host device count on
CPU), with mesh data=1, fsdp=n, tensor=1 and NCCL_NVLS_ENABLE=0. Parts
(--parts, in this order; N = the devices this machine has):

  equal    bf16 and coat (e2e.MODE_OVERRIDES) at --batch-per-device x N,
           on N devices
  gather   coat with model.fp8_weight_gather=true at that batch
  restore  train --restore-preset on min(4, N) devices, checkpoint at
           --restore-at, restore it on each fewer power-of-two device count
           down to 1, continue, and compare the losses with the
           uninterrupted run
  max      bf16's and coat's largest batch on N devices
           (e2e.search_max_batch, from 2 x the equal batch)
  scaling  bf16 and coat at --batch-per-device on 1, 2, 4, 8 devices (< N;
           N is the equal part's point)
  big      --big-preset (Llama-2-13B dimensions) bf16 and coat on N >= 4

A train point records tokens/s per device (`step_profile.step_times`),
peak memory per device (max over devices of memory_stats()'s
peak_bytes_in_use, the process's: it includes the initialization; each
device's is in the record), the compiled step's own bytes per device
(`coat_jax.training.memory.breakdown`: state, temporaries, batch), device
bytes in use after placing the state, the state's sharding (bytes per
device against total / n, and the replicated leaves) and the compiled
step's collectives by kind and dtype (`collectives`, which
tests/training/fsdp_test.py uses too). With --profile it also traces
three steps and records the first GPU's NCCL kernel time per step by
collective, and how much of it no compute kernel covers
(`step_profile.collectives_by_kind`). Tokens are random.

With --out, points already there are reused: rerun the same command to go
on; --report-only FILE prints the tables. On CPU (a smoke test):

  XLA_FLAGS=--xla_force_host_platform_device_count=8 PYTHONPATH=. python \\
      benchmarks/fsdp.py --preset tiny --seq 32 --steps 2 --big-preset tiny
"""

import argparse
import glob
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from benchmarks import e2e

# The parent process never imports jax (see benchmarks/e2e.py).

RESULT = 'FSDP_RESULT '
PARTS = ('equal', 'gather', 'restore', 'max', 'scaling', 'big')
GATHER_RUN = ('coat_fp8_gather', 'coat', ['model.fp8_weight_gather=true'])
PROFILE_STEPS = 3  # traced after the timed steps (--profile)

# ---------------------------------------------------------------- HLO

_COLLECTIVE = re.compile(
    r'^\s*(?:ROOT )?%?(?P<name>\S+) = (?P<type>.+?) '
    r'(?P<kind>all-gather|all-reduce|reduce-scatter|all-to-all|'
    r'collective-permute)(?:-start)?\(')
_ARRAY = re.compile(r'\b([a-z][a-z0-9]*)\[([0-9,]*)\]')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_COMPUTATION = re.compile(r'^(ENTRY )?%?(\S+) .*\{\s*$')
_BITS = re.compile(r'(\d+)')
_CALLED = re.compile(
    r'\b(body|condition|calls|to_apply|true_computation|false_computation|'
    r'branch_computations)=\{?(%?[\w.\-]+(?:, ?%?[\w.\-]+)*)')


def _itemsize(dtype: str) -> float:
  if dtype == 'pred':
    return 1
  if dtype.startswith('f8'):
    return 1
  bits = _BITS.search(dtype)
  return int(bits.group(1)) / 8 if bits else 0


def collectives(hlo: str) -> list[dict]:
  """The collectives of an HLO module's text, in order.

  Each: kind ('all-gather', 'all-reduce', 'reduce-scatter', 'all-to-all',
  'collective-permute'), arrays [(dtype, shape)] of its result (a tuple for
  combined collectives; async '-start' ops count once), dtype (the first
  array's), bytes (the result's, per device), op_name (jax's), computation,
  entry (False inside a loop body or other called computation, an async
  collective's wrapper included) and in_loop (inside a while loop's body
  or condition, or a computation they call).
  """
  loop_computations = _loop_computations(hlo)
  out, computation, entry = [], None, False
  for line in hlo.splitlines():
    if header := _computation_header(line):
      entry, computation = header
      continue
    m = _COLLECTIVE.match(line)
    if not m:
      continue
    arrays = [(dtype, tuple(int(s) for s in dims.split(',') if s))
              for dtype, dims in _ARRAY.findall(m.group('type'))]
    if (m.group('kind') != 'all-reduce' and '-start(' in line
        and len(arrays) % 2 == 0):
      arrays = arrays[len(arrays) // 2:]  # ((operands), (results))
    op = _OP_NAME.search(line)
    out.append(dict(
        kind=m.group('kind'), arrays=arrays,
        dtype=arrays[0][0] if arrays else '?',
        bytes=sum(math.prod(s) * _itemsize(d) for d, s in arrays),
        op_name=op.group(1) if op else '', computation=computation,
        entry=entry, in_loop=computation in loop_computations))
  return out


def _computation_header(line: str) -> tuple[bool, str] | None:
  """(whether it is the entry, its name) if the line opens a computation."""
  m = _COMPUTATION.match(line)
  if m and ' = ' not in line:
    return bool(m.group(1)), m.group(2)
  return None


def _loop_computations(hlo: str) -> set[str]:
  """Names of the computations that run inside a while loop: its bodies and
  conditions, and everything they call."""
  calls, loops, computation = {}, set(), None
  for line in hlo.splitlines():
    if header := _computation_header(line):
      computation = header[1]
      calls[computation] = set()
      continue
    if computation is None:
      continue
    for key, names in _CALLED.findall(line):
      names = {n.strip().lstrip('%') for n in names.split(',')}
      calls[computation] |= names
      if key in ('body', 'condition'):
        loops |= names
  todo = list(loops)
  while todo:
    for name in calls.get(todo.pop(), ()):
      if name not in loops:
        loops.add(name)
        todo.append(name)
  return loops


def summarize(colls: list[dict]) -> dict:
  """{'<kind> <dtype>': {'count', 'bytes', 'in_loops'}}, sorted by key."""
  out = {}
  for c in colls:
    row = out.setdefault(f'{c["kind"]} {c["dtype"]}',
                         dict(count=0, bytes=0, in_loops=0))
    row['count'] += 1
    row['bytes'] += c['bytes']
    row['in_loops'] += c['in_loop']
  return dict(sorted(out.items()))


def partitioned_hlo(lowered) -> tuple:
  """(compiled, HLO text right after SPMD partitioning) of a `Lowered`.

  The collectives there are what the partitioner asked for; later backend
  passes may change them (XLA:CPU moves the FP8 casts of gathered weights
  behind the all-gather and keeps all-reduces where GPUs make
  reduce-scatters).
  """
  import jax  # noqa: PLC0415

  # A persistent-cache hit would compile nothing, and so dump nothing: the
  # dump-only option xla_dump_large_constants (unlike the other xla_dump_*
  # ones) is part of the cache key, so no plain compile matches, and these
  # compiles are never written to the cache.
  least = jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 1e9)
  try:
    with tempfile.TemporaryDirectory(prefix='fsdp_hlo_') as d:
      compiled = lowered.compile(compiler_options={
          'xla_dump_to': d, 'xla_dump_hlo_as_text': True,
          'xla_dump_hlo_pass_re': 'spmd-partitioning',
          'xla_dump_large_constants': True})
      return compiled, _read_partitioned(d)
  finally:
    jax.config.update('jax_persistent_cache_min_compile_time_secs', least)


def _read_partitioned(d: str) -> str:
  paths = glob.glob(os.path.join(d, '*after_spmd-partitioning*.txt'))
  if not paths:
    raise RuntimeError(f'no SPMD-partitioned HLO dumped in {d}:'
                       f' {os.listdir(d)[:10]}')
  with open(sorted(paths)[-1]) as f:
    return f.read()


def sharded_bytes(tree) -> dict:
  """Bytes of a tree of placed arrays: total, on each device (the largest
  device), and the fully replicated leaves [(path, shape, bytes)] of a
  mesh with more than one device."""
  import jax  # noqa: PLC0415

  total, per_device, replicated = 0, {}, []
  for path, x in jax.tree_util.tree_leaves_with_path(tree):
    total += x.nbytes
    for shard in x.addressable_shards:
      key = str(shard.device)
      per_device[key] = per_device.get(key, 0) + shard.data.nbytes
    if len(x.sharding.device_set) > 1 and x.sharding.is_fully_replicated:
      replicated.append((jax.tree_util.keystr(path), tuple(x.shape),
                         x.nbytes))
  return dict(total=total, per_device=max(per_device.values(), default=0),
              devices=len(per_device), replicated=replicated)


# ---------------------------------------------------------------- points


def _train_overrides(p: dict) -> list[str]:
  from coat_jax import models  # noqa: PLC0415

  overrides = [f'model.preset={p["preset"]}', f'data.seq_len={p["seq"]}',
               f'train.batch_size={p["batch"]}', 'mesh.data=1',
               f'mesh.fsdp={p["devices"]}', 'mesh.tensor=1']
  if p['seq'] > models.preset(p['preset']).max_seq_len:
    overrides.append(f'model.max_seq_len={p["seq"]}')
  return [*overrides, *e2e.MODE_OVERRIDES[p['mode']], *p['overrides']]


def _devices(p: dict):
  import jax  # noqa: PLC0415

  devices = jax.devices()
  if len(devices) != p['devices']:
    raise RuntimeError(f'the point asks for {p["devices"]} devices; this'
                       f' process sees {len(devices)}.')
  return devices


def run_train_point(p: dict) -> dict:
  """One train step config on p['devices'] devices: speed, memory,
  sharding and collectives."""
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  from benchmarks import step_profile  # noqa: PLC0415
  from coat_jax import training  # noqa: PLC0415
  from coat_jax.training import memory  # noqa: PLC0415
  from coat_jax.training import sharding  # noqa: PLC0415
  from coat_jax.training import trainer  # noqa: PLC0415

  devices = _devices(p)
  config = training.apply_overrides(
      training.Config(), _train_overrides(p) + ['train.checkpoint_every=0'])
  cfg = training.architecture(config.model)
  tokens = np.random.default_rng(0).integers(
      0, cfg.vocab_size, (p['batch'], p['seq'] + 1), dtype=np.int32)
  setup = training.build(config, devices)
  batch_sharding = sharding.batch_sharding(setup.mesh)
  batch = [trainer.device_batch(x, batch_sharding)
           for x in (tokens[:, :-1], tokens[:, 1:])]
  with jax.set_mesh(setup.mesh):
    start = time.perf_counter()
    state = jax.block_until_ready(setup.init_state())
    init_s = time.perf_counter() - start
    in_use = [(d.memory_stats() or {}).get('bytes_in_use')
              for d in devices]
    placed = {k: sharded_bytes(state[k]) for k in ('params', 'opt_state')}
    start = time.perf_counter()
    compiled = setup.train_step.lower(state, *batch).compile()
    compile_s = time.perf_counter() - start
    step_bytes = memory.breakdown(setup, compiled, limit=0).total
    hlo = summarize(collectives(compiled.as_text()))
    seconds, _, state = step_profile.step_times(compiled, state, batch,
                                                p['steps'])
    state, metrics = compiled(state, *batch)
    loss = float(metrics['loss'])
    nccl = kernels = idle_ms = None
    if p.get('profile'):
      trace_dir = tempfile.mkdtemp(prefix='fsdp_trace_')
      with jax.profiler.trace(trace_dir):
        for _ in range(PROFILE_STEPS):
          state, metrics = compiled(state, *batch)
        jax.block_until_ready(metrics)
      nccl = step_profile.collectives_by_kind(trace_dir, PROFILE_STEPS)
      kernels = step_profile.class_totals(trace_dir, PROFILE_STEPS)
      idle_ms = step_profile.kernel_gaps(trace_dir, PROFILE_STEPS)[0]
      shutil.rmtree(trace_dir, ignore_errors=True)
  peaks = [(d.memory_stats() or {}).get('peak_bytes_in_use')
           for d in devices]
  n = len(devices)
  tokens_per_s = p['batch'] * p['seq'] / seconds
  flops = e2e.model_flops(cfg, p['batch'], p['seq'])
  return dict(
      device=devices[0].device_kind, jax=jax.__version__, step_ms=seconds
      * 1e3, tokens_per_s=tokens_per_s / n, tokens_per_s_total=tokens_per_s,
      model_tflops=flops / seconds / 1e12 / n,
      peak_bytes=max(peaks) if all(peaks) else None,
      peak_bytes_per_device=peaks, step_bytes=step_bytes,
      bytes_in_use_after_init=max(in_use) if all(in_use) else None,
      compile_s=compile_s, init_s=init_s, loss=loss, sharding=placed,
      collectives=hlo, **({} if nccl is None else dict(
          nccl=nccl, kernel_classes=kernels, idle_ms=idle_ms)))


def run_restore_point(p: dict) -> dict:
  """train.py's loop on p['devices'] devices in p['run_dir'] until
  p['steps'] (resuming from its checkpoint if there is one); the losses."""
  import jax  # noqa: PLC0415

  from coat_jax import training  # noqa: PLC0415
  from coat_jax.training import metrics as metrics_lib  # noqa: PLC0415

  devices = _devices(p)
  config = training.apply_overrides(training.Config(), _train_overrides(p) + [
      'data.source=stdlib', f'train.steps={p["steps"]}',
      f'train.run_dir={p["run_dir"]}', f'train.checkpoint_every={p["at"]}',
      'train.log_every=1', f'train.eval_every={10**6}',
      'train.sample_tokens=0', 'train.progress_bar=false',
      'optim.warmup_steps=1'])
  summary = training.train(config, devices)
  steps, values = metrics_lib.series(
      metrics_lib.read_metrics(p['run_dir']), 'loss')
  losses = dict(zip(steps, values, strict=True))
  return dict(device=devices[0].device_kind, jax=jax.__version__,
              resumed_from=summary['resumed_from'], step=summary['step'],
              losses={str(k): v for k, v in sorted(losses.items())})


def copy_checkpoint(src_run: str, step: int, dst_run: str) -> None:
  """A fresh run dir holding only `step` of src_run's checkpoints."""
  src = os.path.join(src_run, 'checkpoints', str(step))
  if not os.path.isdir(src):
    raise FileNotFoundError(f'no checkpoint {src}.')
  shutil.rmtree(dst_run, ignore_errors=True)
  shutil.copytree(src, os.path.join(dst_run, 'checkpoints', str(step)))


# ---------------------------------------------------------------- processes


POINT_FIELDS = ('kind', 'part', 'name', 'mode', 'preset', 'seq', 'batch',
                'devices', 'overrides', 'steps', 'at', 'mem_fraction',
                'profile')


def point_key(p: dict) -> str:
  """What makes a point (a record with the same key is reused); not the
  run dir, not the results."""
  return json.dumps([p.get(k) for k in POINT_FIELDS])


def child_env(n: int, backend: str, mem_fraction: float) -> dict:
  """The environment of a point on the first n devices."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, NCCL_NVLS_ENABLE='0',
             XLA_PYTHON_CLIENT_MEM_FRACTION=str(mem_fraction),
             PYTHONPATH=os.pathsep.join(
                 filter(None, [root, os.environ.get('PYTHONPATH')])))
  if backend == 'cpu':
    flags = re.sub(r'--xla_force_host_platform_device_count=\d+', '',
                   env.get('XLA_FLAGS', ''))
    env['XLA_FLAGS'] = (
        f'{flags} --xla_force_host_platform_device_count={n}').strip()
  else:
    visible = [v for v in env.get('CUDA_VISIBLE_DEVICES', '').split(',')
               if v.strip()] or [str(i) for i in range(n)]
    env['CUDA_VISIBLE_DEVICES'] = ','.join(visible[:n])
  return env


def detect_devices() -> tuple[int, str]:
  """(device count, backend) as a child process sees them."""
  out = subprocess.run(
      [sys.executable, '-c', 'import jax; print(jax.device_count(),'
       ' jax.default_backend())'], capture_output=True, text=True,
      timeout=300, env=dict(os.environ, NCCL_NVLS_ENABLE='0'))
  if out.returncode:
    raise RuntimeError(f'jax found no devices: {out.stderr[-2000:]}')
  count, backend = out.stdout.split()[-2:]
  return int(count), backend


def run_in_process(p: dict, timeout: float, backend: str) -> dict:
  """One point in a child process; never raises for the point's failure."""
  env = child_env(p['devices'], backend, p['mem_fraction'])
  return e2e.run_child(os.path.abspath(__file__), p, env, timeout,
                       env['PYTHONPATH'].split(os.pathsep)[0], RESULT)


def describe(r: dict) -> str:
  if r['status'] != 'ok':
    return f'{r["status"]}: {r.get("error", "")[:200]}'
  if r['kind'] == 'restore':
    return f'resumed from {r["resumed_from"]}, losses {r["losses"]}'
  return (f'{r["tokens_per_s"]:,.0f} tok/s/device, peak'
          f' {_gib(r["peak_bytes"])} GiB/device, loss {r["loss"]:.3f}')


# ---------------------------------------------------------------- the plan


def plan(sweep: e2e.Sweep, args, n: int) -> None:
  """Runs the parts of --parts in order."""
  runs = e2e.runs_from_args(args.modes, args.variants)
  base = dict(kind='train', seq=args.seq, steps=args.steps,
              **({'profile': True} if args.profile else {}))

  def train(part, name, preset, devices, batch):
    mode, overrides = ([GATHER_RUN[1], GATHER_RUN[2]] if name == GATHER_RUN[0]
                       else runs[name])
    return run(sweep, args, part=part, name=name, mode=mode, preset=preset,
               devices=devices, batch=batch, overrides=args.set + overrides,
               **base)

  equal = args.batch_per_device * n
  for part in args.parts:
    print(f'{part}:', flush=True)
    if part == 'equal':
      for name in runs:
        train(part, name, args.preset, n, equal)
    elif part == 'gather':
      train(part, GATHER_RUN[0], args.preset, n, equal)
    elif part == 'max':
      for name in runs:
        best = e2e.search_max_batch(
            lambda b, name=name: train('max', name, args.preset, n, b)[
                'status'] == 'ok', 2 * equal, multiple=n,
            max_tries=args.max_tries)
        print(f'  {name}: largest batch {best}', flush=True)
    elif part == 'scaling':
      for devices in [d for d in (1, 2, 4, 8) if d <= n]:
        if devices == n and 'equal' in args.parts:
          continue  # the equal part's points
        for name in runs:
          train(part, name, args.preset, devices,
                args.batch_per_device * devices)
    elif part == 'big':
      if n < 4 and args.big_preset.startswith('llama2_13b'):
        print('  skipped: Llama-2-13B needs >= 4 devices', flush=True)
        continue
      for name in runs:
        train(part, name, args.big_preset, n, equal)
    elif part == 'restore':
      restore(sweep, args, n)


def run(sweep: e2e.Sweep, args, **p) -> dict:
  """The record of point `p` (with --mem-fraction)."""
  p = dict(p, mem_fraction=args.mem_fraction)
  return sweep.run(p, f'{p["part"]}: {p["name"]} on {p["devices"]}'
                   f' device(s), batch {p["batch"]}')


def restore(sweep: e2e.Sweep, args, n: int) -> None:
  """Checkpoint on min(4, n) devices, restored on each fewer power of two."""
  first = min(4, n)
  counts = [d for d in (4, 2, 1) if d < first]
  work = args.work_dir or (f'{args.out}.runs' if args.out
                           else tempfile.mkdtemp(prefix='fsdp_restore_'))
  mode, overrides = 'coat', args.set
  point = dict(part='restore', kind='restore', mode=mode,
               preset=args.restore_preset, seq=args.restore_seq,
               batch=args.restore_batch, overrides=overrides,
               at=args.restore_at, steps=2 * args.restore_at)
  ref_dir = os.path.join(work, f'fsdp{first}')
  ref = run(sweep, args, name=f'fsdp{first}', devices=first,
            run_dir=ref_dir, **point)
  if ref['status'] != 'ok':
    return
  for d in counts:
    run_dir = os.path.join(work, f'fsdp{first}_to_{d}')
    key = point_key(dict(point, name=f'fsdp{first}_to_{d}', devices=d,
                         mem_fraction=args.mem_fraction))
    if key not in sweep.records:
      if not os.path.isdir(os.path.join(ref_dir, 'checkpoints')):
        print(f'  {ref_dir} is gone: rerun with --fresh', flush=True)
        return
      copy_checkpoint(ref_dir, args.restore_at, run_dir)
    run(sweep, args, name=f'fsdp{first}_to_{d}', devices=d, run_dir=run_dir,
        **point)


# ---------------------------------------------------------------- tables


def _gib(x):
  return f'{x / 2**30:.2f}' if x else 'n/a'


def _ratio(a, b):
  return f'{a / b:.2f}x' if a and b else ''


def _seconds(x):
  return f'{x:.1f}' if x is not None else ''


def _train_rows(rs: list[dict], base_name: str = 'bf16') -> list[str]:
  rows = ['| part | run | preset | devices | batch | tokens/s/device |'
          ' vs bf16 | peak GiB/device | vs bf16 | compiled step GiB/device |'
          ' vs bf16 | step ms | compile s | init s |',
          '|---' * 14 + '|']
  base = {(r['part'], r['preset'], r['devices'], r['batch']): r for r in rs
          if r['name'] == base_name and r['status'] == 'ok'}
  for r in rs:
    if r['status'] != 'ok':
      rows.append(f'| {r["part"]} | {r["name"]} | {r["preset"]} |'
                  f' {r["devices"]} | {r["batch"]} | {r["status"]} |'
                  + ' |' * 8)
      continue
    b = base.get((r['part'], r['preset'], r['devices'], r['batch']), {})
    rows.append(
        f'| {r["part"]} | {r["name"]} | {r["preset"]} | {r["devices"]} |'
        f' {r["batch"]} | {r["tokens_per_s"]:,.0f} |'
        f' {_ratio(r["tokens_per_s"], b.get("tokens_per_s"))} |'
        f' {_gib(r["peak_bytes"])} |'
        f' {_ratio(b.get("peak_bytes"), r["peak_bytes"])} |'
        f' {_gib(r.get("step_bytes"))} |'
        f' {_ratio(b.get("step_bytes"), r.get("step_bytes"))} |'
        f' {r["step_ms"]:.1f} | {r["compile_s"]:.0f} |'
        f' {_seconds(r.get("init_s"))} |')
  return rows


def _scaling_rows(trains: list[dict]) -> list[str]:
  """tokens/s/device of each run by device count (part 'scaling'), and
  the efficiency against its 1-device point."""
  rs = [r for r in trains if r['part'] == 'scaling' and r['status'] == 'ok']
  per_device = {r['batch'] // r['devices'] for r in rs}
  rs += [r for r in trains if r['part'] == 'equal' and r['status'] == 'ok'
         and r['batch'] // r['devices'] in per_device
         and r['name'] in {s['name'] for s in rs}]
  if not rs:
    return []
  counts = sorted({r['devices'] for r in rs})
  rows = ['\nScaling (tokens/s/device, and against 1 device):\n',
          '| run | ' + ' | '.join(f'{n} device(s)' for n in counts) + ' |',
          '|---' * (len(counts) + 1) + '|']
  for name in dict.fromkeys(r['name'] for r in rs):
    by_n = {r['devices']: r['tokens_per_s'] for r in rs if r['name'] == name}
    one = by_n.get(1)
    rows.append(f'| {name} | ' + ' | '.join(
        f'{by_n[n]:,.0f} ({_ratio(by_n[n], one)})' if n in by_n else ''
        for n in counts) + ' |')
  return rows


def _gather_rows(trains: list[dict]) -> list[str]:
  """coat with FP8 weight all-gathers against coat, same devices and
  batch: speed, and all-gathered MiB per device by dtype."""
  ok = {(r['name'], r['preset'], r['devices'], r['batch']): r
        for r in trains if r['status'] == 'ok'}
  rows = []
  for (name, preset, n, batch), r in ok.items():
    base = ok.get(('coat', preset, n, batch))
    if name != GATHER_RUN[0] or base is None:
      continue
    if not rows:
      rows = ['\nFP8 weight all-gather (model.fp8_weight_gather) against'
              ' float32 gathers:\n',
              '| preset | devices | batch | tokens/s/device: coat | FP8'
              ' gather | ratio | all-gathered MiB/device: coat | FP8 gather'
              ' |', '|---' * 8 + '|']

    def gathered(rec):
      return ', '.join(f'{k.split()[1]} {v["bytes"] / 2**20:.1f}'
                       for k, v in rec['collectives'].items()
                       if k.startswith('all-gather'))

    rows.append(f'| {preset} | {n} | {batch} | {base["tokens_per_s"]:,.0f}'
                f' | {r["tokens_per_s"]:,.0f} |'
                f' {_ratio(r["tokens_per_s"], base["tokens_per_s"])} |'
                f' {gathered(base)} | {gathered(r)} |')
  return rows


def tables(records: list[dict]) -> str:
  """Markdown of all parts."""
  ok = [r for r in records if r['status'] == 'ok']
  trains = [r for r in records if r['kind'] == 'train']
  out = []
  if ok:
    out.append(f'\n{ok[0]["device"]}, jax {ok[0]["jax"]}, mesh data=1 x'
               ' fsdp=devices, random tokens; "vs bf16" is the speed ratio'
               ' and the memory saving (bf16 / run).\n')
  if trains:
    out += _train_rows([r for r in trains if r['part'] != 'max'])
  best = {}
  for r in trains:
    if r['status'] == 'ok' and r['part'] in ('equal', 'gather', 'max'):
      key = (r['name'], r['devices'])
      if key not in best or r['batch'] > best[key]['batch']:
        best[key] = r
  if best:
    out.append('\nLargest batch that fits (of those tried):\n')
    out += _train_rows(list(best.values()))
  out += _scaling_rows(trains) + _gather_rows(trains)
  proofs = [r for r in ok if r['kind'] == 'train' and r.get('sharding')
            and r['part'] != 'scaling']
  if proofs:
    out.append('\nSharding: bytes per device against total / devices'
               ' (1.00 = evenly sharded), replicated leaves, device bytes'
               ' in use after placing the state:\n')
    out.append('| run | devices | params GiB | per device x devices / total'
               ' | opt state GiB | per device x devices / total |'
               ' replicated leaves (MiB) | in use after init GiB/device |'
               ' (params + opt state) / devices GiB |')
    out.append('|---' * 9 + '|')
    for r in proofs:
      s, n = r['sharding'], r['devices']
      rep = s['params']['replicated'] + s['opt_state']['replicated']
      out.append(
          f'| {r["name"]} b{r["batch"]} {r["preset"]} | {n} |'
          f' {_gib(s["params"]["total"])} |'
          f' {s["params"]["per_device"] * n / s["params"]["total"]:.2f} |'
          f' {_gib(s["opt_state"]["total"])} |'
          f' {s["opt_state"]["per_device"] * n / s["opt_state"]["total"]:.2f}'
          f' | {len(rep)} ({sum(x[2] for x in rep) / 2**20:.1f}) |'
          f' {_gib(r.get("bytes_in_use_after_init"))} |'
          f' {_gib((s["params"]["total"] + s["opt_state"]["total"]) / n)} |')
    out.append('\nCollectives of the compiled step (count, MiB per device,'
               ' of which inside loops):\n')
    kinds = sorted({k for r in proofs for k in r['collectives']})
    out.append('| collective | ' + ' | '.join(
        f'{r["name"]} {r["preset"]} n{r["devices"]} b{r["batch"]}'
        for r in proofs) + ' |')
    out.append('|---' * (len(proofs) + 1) + '|')
    for k in kinds:
      cells = []
      for r in proofs:
        c = r['collectives'].get(k)
        cells.append(f'{c["count"]}, {c["bytes"] / 2**20:.1f},'
                     f' {c["in_loops"]}' if c else '')
      out.append(f'| {k} | ' + ' | '.join(cells) + ' |')
  profiled = [r for r in ok if r.get('nccl') is not None]
  if profiled:
    out.append('\nNCCL kernels on the first GPU (--profile, 3 traced steps):'
               ' ms a step, of which no compute kernel runs beside them'
               ' ("not hidden"), by collective:\n')
    kinds = sorted({k for r in profiled for k in r['nccl']})
    out.append('| run | devices | batch | step ms | NCCL ms | not hidden ms'
               ' (sum) | ' + ' | '.join(f'{k} ms (not hidden)' for k in kinds)
               + ' |')
    out.append('|---' * (6 + len(kinds)) + '|')
    for r in profiled:
      per = r['nccl']
      cells = [f'{per[k][1]:.1f} ({per[k][2]:.1f})' if k in per else ''
               for k in kinds]
      out.append(
          f'| {r["name"]} {r["preset"]} | {r["devices"]} | {r["batch"]} |'
          f' {r["step_ms"]:.1f} | {sum(v[1] for v in per.values()):.1f} |'
          f' {sum(v[2] for v in per.values()):.1f} | ' + ' | '.join(cells)
          + ' |')
    out.append('\nGPU kernel ms a step by op class (`step_profile.classify`;'
               ' the mean over the devices), and the busiest stream\'s idle'
               ' time between kernels (--profile):\n')
    classes = sorted({k for r in profiled
                      for k in r.get('kernel_classes') or {}})
    out.append('| run | devices | batch | step ms | ' + ' | '.join(classes)
               + ' | all kernels | idle ms |')
    out.append('|---' * (6 + len(classes)) + '|')
    for r in profiled:
      per = r.get('kernel_classes') or {}
      idle = r.get('idle_ms')
      out.append(
          f'| {r["name"]} {r["preset"]} | {r["devices"]} | {r["batch"]} |'
          f' {r["step_ms"]:.1f} | '
          + ' | '.join(f'{per[k]:.1f}' if k in per else '' for k in classes)
          + f' | {sum(per.values()):.1f} |'
          f' {"" if idle is None else f"{idle:.1f}"} |')
  restores = [r for r in records if r['kind'] == 'restore']
  if restores:
    out.append('\nCheckpoint restored on fewer devices (coat): loss per'
               ' step after the restore, against the uninterrupted run:\n')
    ref = next((r for r in restores if r['status'] == 'ok'
                and r['resumed_from'] is None), None)
    out.append('| run | resumed from | losses | max relative difference |')
    out.append('|---|---|---|---|')
    for r in restores:
      if r['status'] != 'ok':
        out.append(f'| {r["name"]} | {r["status"]} | | |')
        continue
      diff = ''
      if ref is not None and r is not ref:
        d = [abs(v - ref['losses'][k]) / abs(ref['losses'][k])
             for k, v in r['losses'].items() if k in ref['losses']]
        diff = f'{max(d):.2e}' if d else ''
      out.append(f'| {r["name"]} | {r["resumed_from"]} |'
                 f' {", ".join(f"{v:.4f}" for v in r["losses"].values())}'
                 f' | {diff} |')
  return '\n'.join(out)


# ---------------------------------------------------------------- main


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      description=__doc__.split('\n\n')[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--preset', default='llama2_7b')
  parser.add_argument('--seq', type=int, default=2048)
  parser.add_argument('--batch-per-device', type=int, default=1)
  parser.add_argument('--modes', default='bf16,coat')
  parser.add_argument('--variants', nargs='*', default=[],
                      metavar='NAME=MODE:OVERRIDES')
  parser.add_argument('--set', nargs='*', default=[],
                      metavar='SECTION.FIELD=VALUE')
  parser.add_argument('--parts', default=','.join(PARTS))
  parser.add_argument('--steps', type=int, default=10,
                      help='timed steps after the 2 s warm-up')
  parser.add_argument('--max-tries', type=int, default=4)
  parser.add_argument('--big-preset', default='llama2_13b')
  parser.add_argument('--restore-preset', default='1b')
  parser.add_argument('--restore-seq', type=int, default=512)
  parser.add_argument('--restore-batch', type=int, default=4)
  parser.add_argument('--restore-at', type=int, default=3)
  parser.add_argument('--work-dir', help='run dirs of the restore part'
                      ' (default: --out + ".runs")')
  parser.add_argument('--mem-fraction', type=float, default=0.97)
  parser.add_argument('--point-timeout', type=float, default=480)
  parser.add_argument('--budget-s', type=float, default=0)
  parser.add_argument('--out')
  parser.add_argument('--fresh', action='store_true')
  parser.add_argument('--report-only', metavar='FILE')
  parser.add_argument('--profile', action='store_true',
                      help='trace 3 steps of each train point: NCCL time'
                      ' per collective on the first GPU, and how much of it'
                      ' compute does not hide')
  parser.add_argument('--point', help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.point:
    p = json.loads(args.point)
    run = run_restore_point if p['kind'] == 'restore' else run_train_point
    print(RESULT + json.dumps(run(p)), flush=True)
    return 0
  if args.report_only:
    latest = {point_key(r): r for r in e2e.load_records(args.report_only)}
    print(tables(list(latest.values())))
    return 0
  args.parts = [p for p in args.parts.split(',') if p]
  for part in args.parts:
    if part not in PARTS:
      parser.error(f'--parts: {part!r} is not one of {PARTS}.')
  try:
    e2e.runs_from_args(args.modes, args.variants)
  except ValueError as e:
    parser.error(str(e))
  n, backend = detect_devices()
  print(f'fsdp: {n} {backend} device(s), {args.preset} seq {args.seq},'
        f' {args.batch_per_device} sequence(s) per device, parts'
        f' {args.parts}', flush=True)
  sweep = e2e.Sweep(
      out=args.out, fresh=args.fresh, budget_s=args.budget_s,
      point_timeout=args.point_timeout, key=point_key, describe=describe,
      run=lambda p, timeout: run_in_process(p, timeout, backend))
  try:
    plan(sweep, args, n)
  except e2e.OutOfBudget as e:
    e2e.print_stopped(e, args.out)
  print(tables(list(sweep.records.values())))
  return 0


if __name__ == '__main__':
  sys.exit(main())
