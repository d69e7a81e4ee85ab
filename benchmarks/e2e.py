"""End-to-end train step speed and memory: coat_jax's modes against plain
BF16 (RESULTS.md "e2e-1b", "e2e-7b" and "vlm").

  PYTHONPATH=. python benchmarks/e2e.py --preset 1b --modes plain,coat \\
      --variants coat_block=coat:model.scaling=block [--scanned] [--profile]
  PYTHONPATH=. python benchmarks/e2e.py --preset llama2_7b \\
      --modes plain,coat --max-batch --budget-s 540 --out runs/e2e_7b.jsonl

Each point (mode, batch) runs in its own process (this script re-invoked
with --point), so peak memory is per point and an out-of-memory point is
recorded as 'does not fit' while the sweep goes on. Modes:

  plain       benchmarks/plain_llama.py: Flax NNX + optax BF16, unrolled,
              cuDNN attention (the baseline; same architecture and FLOPs)
  converted   the same plain model as a user converts it: its SwiGLU line
              switched to coat_jax.nn.swiglu, coat_jax.convert(model,
              COAT), coat_adamw (plain_llama.build(recipe=...))
  converted_fused
              converted, with coat_jax.FusedCoatAdamW as its optimizer
              (plain_llama.build(recipe=..., fused=True))
  bf16, fp8_linear, coat
              train.py's jitted step (`coat_jax.training.build`) with the
              overrides of MODE_OVERRIDES (bf16 and fp8_linear with
              optax.adamw, coat with coat_adamw)

and variants `name=mode:section.field=value,...` (the overrides go through
`coat_jax.training.apply_overrides`, e.g. model.remat=full).

Every point runs on one device. Per point: tokens/s from the step time of
a train loop (`step_profile.step_times`: steps dispatched back to back as
train.py's loop does; the median step blocked on alone, which adds the
host's dispatch, is kept as step_ms_blocked), model TFLOP/s, peak device
memory (`memory_stats()['peak_bytes_in_use']`), compile time, and with
--profile the GPU kernel time per op class (`step_profile.classify`). Each
process runs with XLA_PYTHON_CLIENT_MEM_FRACTION=--mem-fraction, so that XLA
may use almost all of the GPU rather than jax's default share. Tokens are
random (speed does not depend on them); no corpus is read. The loss printed
is the last step's on that one repeated batch, a check that the step trains
and stays finite, not a comparison: plain steps at a constant learning
rate, the other modes under train.py's warm-up schedule.

Model FLOPs per step = 6 * N * B * S + 6 * L * B * S^2 * H, with N the
matmul params (the layers' projections and the LM head, not the embedding
lookup), B batch, S sequence, L layers, H = heads * head_dim: the first term
is forward + backward of the matmuls, the second causal attention (QK^T and
PV, 4 * B * S^2 * H per layer forward, halved by the mask, x3 for
forward + backward).

With --out, points already in the file are reused (rerun the same command
to continue a sweep; --budget-s ends a call in time); --report-only FILE
prints the tables.
"""

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time

# The parent process never imports jax: on a GPU it would take the memory
# that the point processes need.

PRESETS = {
    'tiny': dict(model='tiny', seq=64, batches=(2,)),  # CPU smoke tests
    '1b': dict(model='1b', seq=2048, batches=(8, 16)),
    'llama2_7b': dict(model='llama2_7b', seq=2048, batches=(4,)),
    'llama2_7b_16k': dict(model='llama2_7b', seq=16384, batches=(1,)),
    'qwen3_1.7b': dict(model='qwen3_1.7b', seq=2048, batches=(8,)),
    # VLMs (bf16 and coat modes; the text length is the shapes data's).
    'vlm_tiny': dict(model='vlm_tiny', seq=None, batches=(2,)),
    'vlm_1b': dict(model='vlm_1b', seq=None, batches=(32,)),
}
# train.py's overrides of each coat_jax mode (stability.py and fsdp.py run
# the same modes); 'plain' is benchmarks/plain_llama.py.
MODE_OVERRIDES = {
    'bf16': ('model.recipe=bf16', 'optim.name=adamw'),
    'fp8_linear': ('model.recipe=fp8_linear', 'optim.name=adamw'),
    'coat': ('model.recipe=coat', 'optim.name=coat_adamw'),
}
# Modes of benchmarks/plain_llama.py's model (not train.py's step).
PLAIN_MODES = ('plain', 'converted', 'converted_fused')
MODES = (*PLAIN_MODES, *MODE_OVERRIDES)
RESULT = 'E2E_RESULT '
OOM = re.compile(r'RESOURCE_EXHAUSTED|out of memory|OutOfMemory|'
                 r'Allocator .* ran out', re.IGNORECASE)


def parse_variant(spec: str) -> tuple[str, str, list[str]]:
  """'name=mode:a.b=1,c.d=x,y' -> ('name', 'mode', ['a.b=1', 'c.d=x,y']).

  Commas split overrides only before `section.field=`, so tuple values
  (optim.moment_dtypes=e4m3,e4m3) survive.
  """
  name, sep, rest = spec.partition('=')
  mode, _, overrides = rest.partition(':')
  if not sep or not name or mode not in MODES:
    raise ValueError(f'--variants {spec!r}: expected name=mode:overrides'
                     f' with mode one of {MODES} (e.g.'
                     ' coat_scanned=coat:model.scan_layers=true).')
  items = re.split(r',(?=[A-Za-z_]\w*\.\w+=)', overrides) if overrides else []
  return name, mode, items


def runs_from_args(modes: str, variants: list[str],
                   scanned: bool = False) -> dict:
  """{run name: (mode, overrides)} for --modes, --scanned (<mode>_scanned:
  model.scan_layers=true for each coat_jax mode) and --variants."""
  runs = {}
  for mode in filter(None, modes.split(',')):
    if mode not in MODES:
      raise ValueError(f'--modes: {mode!r} is not one of {MODES}; use'
                       ' --variants name=mode:overrides for others.')
    runs[mode] = (mode, [])
  if scanned:
    for mode in list(runs):
      if mode != 'plain':
        runs[f'{mode}_scanned'] = (mode, ['model.scan_layers=true'])
  for spec in variants:
    name, mode, overrides = parse_variant(spec)
    if name in runs:
      raise ValueError(f'--variants: the name {name!r} is taken; pick'
                       ' another.')
    runs[name] = (mode, overrides)
  return runs


def point_key(p: dict) -> str:
  """What makes a point: a record with the same key is reused."""
  return json.dumps([p['name'], p['mode'], p['preset'], p['seq'],
                     p['batch'], p['overrides'], p['profile'], p['steps'],
                     p['mem_fraction']])


def model_flops(cfg, batch: int, seq: int) -> float:
  """Model FLOPs of one train step (see the module docstring)."""
  h, d = cfg.hidden_size, cfg.head_features
  per_layer = (h * cfg.num_heads * d * 2 + h * cfg.num_kv_heads * d * 2
               + 3 * h * cfg.intermediate_size)
  n = cfg.num_layers * per_layer + h * cfg.vocab_size
  attention = 6 * cfg.num_layers * batch * seq**2 * cfg.num_heads * d
  return 6 * n * batch * seq + attention


def vlm_flops(config, batch: int, task) -> float:
  """Model FLOPs of one VLM train step: the decoder's (`model_flops` over
  the image tokens and the text) plus the ViT's (its matmuls, the patch
  embedding, and non-causal attention: 12 * L * B * P^2 * D) and the
  projector's."""
  v, p = config.vision, config.num_image_tokens
  vit_params = (v.num_layers * (4 * v.hidden_size**2
                                + 2 * v.hidden_size * v.intermediate_size)
                + v.patch_features * v.hidden_size)
  projector = config.projector_size * (v.hidden_size
                                       + config.decoder.hidden_size)
  vit = (6 * (vit_params + projector) * batch * p
         + 12 * v.num_layers * batch * p**2 * v.hidden_size)
  return model_flops(config.decoder, batch, task.tokens_per_example) + vit


# ---------------------------------------------------------------- the point


def is_vlm(preset: str) -> bool:
  return preset.startswith('vlm_')


def train_config(preset: str, seq: int | None, batch: int, mode: str,
                 overrides: list[str]):
  """train.py's Config of a point: the preset at (batch, seq), the mode's
  recipe and optimizer (PLAIN_MODES take the model dimensions only), then
  `overrides`. A VLM preset (seq None) trains on the shapes data."""
  from coat_jax import models  # noqa: PLC0415
  from coat_jax import training  # noqa: PLC0415

  base = [f'model.preset={preset}', f'train.batch_size={batch}',
          'train.checkpoint_every=0']
  if is_vlm(preset):
    base.append('data.source=shapes')
  else:
    base.append(f'data.seq_len={seq}')
    if seq > models.preset(preset).max_seq_len:
      base.append(f'model.max_seq_len={seq}')
  if mode not in PLAIN_MODES:
    base += MODE_OVERRIDES[mode]
  return training.apply_overrides(training.Config(), base + overrides)


def run_point(p: dict) -> dict:
  """Builds, compiles and times one point in this process; returns metrics."""
  import jax  # noqa: PLC0415 (see the note at the imports)
  import numpy as np  # noqa: PLC0415

  from benchmarks import plain_llama  # noqa: PLC0415
  from benchmarks import step_profile  # noqa: PLC0415
  from coat_jax import training  # noqa: PLC0415
  from coat_jax.training import config as config_lib  # noqa: PLC0415
  from coat_jax.training import sharding  # noqa: PLC0415
  from coat_jax.training import tasks  # noqa: PLC0415
  from coat_jax.training import trainer  # noqa: PLC0415

  config = train_config(p['preset'], p['seq'], p['batch'], p['mode'],
                        p['overrides'])
  cfg = training.architecture(config.model)
  vlm_config = config_lib.vlm_architecture(config.model)
  if vlm_config is None:
    tokens = np.random.default_rng(0).integers(
        0, cfg.vocab_size, (p['batch'], p['seq'] + 1), dtype=np.int32)
    tokens_per_step = p['batch'] * p['seq']
    flops = model_flops(cfg, p['batch'], p['seq'])
  if p['mode'] in PLAIN_MODES:
    init_state, step = plain_llama.build(
        cfg, recipe=None if p['mode'] == 'plain' else 'coat',
        fused=p['mode'] == 'converted_fused')
    batch = [jax.device_put(x) for x in (tokens[:, :-1], tokens[:, 1:])]
    context = contextlib.nullcontext()
  else:
    setup = training.build(config, jax.devices()[:1])  # as plain
    init_state, step = setup.init_state, setup.train_step
    batch_sharding = sharding.batch_sharding(setup.mesh)
    if vlm_config is None:
      host = (tokens[:, :-1], tokens[:, 1:])
    else:  # the shapes data's first batch (uint8 images, text, mask)
      host = tasks.load_data(config, setup.task).batch('train', 0,
                                                       p['batch'])
      tokens_per_step = p['batch'] * setup.task.tokens_per_example
      flops = vlm_flops(vlm_config, p['batch'], setup.task)
    batch = [trainer.device_batch(x, batch_sharding) for x in host]
    context = jax.set_mesh(setup.mesh)
  with context:
    state = jax.block_until_ready(init_state())
    start = time.perf_counter()
    compiled = step.lower(state, *batch).compile()
    compile_s = time.perf_counter() - start
    seconds, blocked_s, state = step_profile.step_times(
        compiled, state, batch, p['steps'])
    state, metrics = compiled(state, *batch)
    loss = float(metrics['loss'])
    kernel_ms = kernel_top = None
    if p['profile']:
      trace_dir = tempfile.mkdtemp(prefix='e2e_profile_')
      with jax.profiler.trace(trace_dir):
        for _ in range(3):
          state, metrics = compiled(state, *batch)
        jax.block_until_ready(metrics)
      kernel_ms = {}
      stats = step_profile.kernel_stats(trace_dir, 3)
      for name, (ms, _) in stats.items():
        label = step_profile.classify(name)
        kernel_ms[label] = kernel_ms.get(label, 0.0) + ms
      # The longest kernels by name: [name, ms, launches] per step.
      kernel_top = [[name, ms, n] for name, (ms, n) in sorted(
          stats.items(), key=lambda kv: -kv[1][0])[:40]]
  device = jax.local_devices()[0]
  stats = device.memory_stats() or {}
  return dict(
      device=device.device_kind, jax=jax.__version__,
      step_ms=seconds * 1e3, step_ms_blocked=blocked_s * 1e3,
      tokens_per_s=tokens_per_step / seconds,
      examples_per_s=p['batch'] / seconds,
      model_tflops=flops / seconds / 1e12, model_flops=flops,
      peak_bytes=stats.get('peak_bytes_in_use'),
      device_bytes=stats.get('bytes_limit'), compile_s=compile_s,
      loss=loss, kernel_ms=kernel_ms, kernel_top=kernel_top,
      temp_bytes=compiled.memory_analysis().temp_size_in_bytes)


# ---------------------------------------------------------------- the sweep


def run_in_process(p: dict, timeout: float) -> dict:
  """Runs one point in a child process; never raises for the point's
  failure (status 'does not fit', 'failed' or 'timeout')."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=str(p['mem_fraction']),
             PYTHONPATH=os.pathsep.join(
                 filter(None, [root, os.environ.get('PYTHONPATH')])))
  return run_child(os.path.abspath(__file__), p, env, timeout, root)


def run_child(script: str, p: dict, env: dict, timeout: float, cwd: str,
              result: str = RESULT) -> dict:
  """`python script --point <p as JSON>` in a child process: p plus the
  metrics of its last line starting with `result` (status 'ok'), or status
  'does not fit', 'failed' or 'timeout' with the last error line; never
  raises for the point."""
  cmd = [sys.executable, script, '--point', json.dumps(p)]
  record = dict(p)
  start = time.perf_counter()
  try:
    out = subprocess.run(cmd, env=env, capture_output=True, text=True,
                         timeout=timeout, cwd=cwd)
  except subprocess.TimeoutExpired:
    return dict(record, status='timeout', wall_s=timeout,
                error=f'no result within {timeout:.0f} s')
  record['wall_s'] = time.perf_counter() - start
  lines = [line for line in out.stdout.splitlines()
           if line.startswith(result)]
  if out.returncode == 0 and lines:
    return dict(record, status='ok', **json.loads(lines[-1][len(result):]))
  text = out.stdout + out.stderr
  errors = [line for line in out.stderr.splitlines() if line.strip()]
  status = 'does not fit' if OOM.search(text) else 'failed'
  return dict(record, status=status, returncode=out.returncode,
              error=(errors[-1] if errors else '')[:500])


def search_max_batch(fits, start: int, *, multiple: int = 1,
                     max_tries: int = 6, cap: int = 1024) -> int | None:
  """The largest batch b (a multiple of `multiple`) with fits(b), searched by
  doubling from `start` until one fails, then bisecting; at most max_tries
  calls of fits. None if no tried batch fits."""
  lo, hi, b = 0, None, start
  for _ in range(max_tries):
    if fits(b):
      lo = b
    else:
      hi = b
    if hi is None:
      b = min(2 * lo, cap)
      if b <= lo:
        break
    else:
      b = (lo + hi) // 2 // multiple * multiple
      if b <= lo:
        break
  return lo or None


def describe(r: dict) -> str:
  if r['status'] != 'ok':
    return f'{r["status"]}: {r.get("error", "")[:200]}'
  peak = (f'{r["peak_bytes"] / 2**30:.1f} GiB' if r['peak_bytes']
          else 'peak n/a')
  return (f'{r["tokens_per_s"]:,.0f} tok/s, {r["model_tflops"]:.1f} TFLOP/s,'
          f' {peak}, compile {r["compile_s"]:.0f} s, last loss'
          f' {r["loss"]:.3f}')


class OutOfBudget(Exception):
  """--budget-s would be exceeded by the next point."""


class Sweep:
  """Runs points once each, each in a child process, reusing the records
  of `out` and starting none that might end after `budget_s`.

  Args:
    out: JSONL file of the records (appended), or None.
    fresh: rerun points already in `out`.
    budget_s: seconds for the whole sweep (0: no limit).
    point_timeout: seconds for one point.
    key: point -> what makes it (a record with the same key is reused).
    run: (point, timeout) -> record, never raising for the point.
    describe: record -> one line.
  """

  def __init__(self, *, out, fresh, budget_s, point_timeout, key, run,
               describe):
    self.out, self.budget_s, self.point_timeout = out, budget_s, point_timeout
    self.key, self._run, self.describe = key, run, describe
    self.records, self.walls = {}, []
    self.start = time.perf_counter()
    if out and os.path.exists(out) and not fresh:
      for record in load_records(out):
        if record['status'] in ('ok', 'does not fit'):
          self.records[key(record)] = record

  def run(self, p: dict, label: str) -> dict:
    """The record of point `p`: from `out`, or run now."""
    key = self.key(p)
    if key in self.records:
      r = self.records[key]
      print(f'  {label}: (from {self.out}) {self.describe(r)}', flush=True)
      return r
    timeout = self.point_timeout
    if self.budget_s:
      left = self.budget_s - (time.perf_counter() - self.start)
      expected = max(self.walls, default=0.0)
      if left < max(expected, 30.0):
        raise OutOfBudget(f'{left:.0f} s of --budget-s left, a point took'
                          f' up to {expected:.0f} s')
      timeout = min(timeout, left)
    print(f'  {label} ...', flush=True)
    r = self._run(p, timeout)
    self.walls.append(r['wall_s'])
    print(f'  {label}: {self.describe(r)} ({r["wall_s"]:.0f} s)', flush=True)
    self.records[key] = r
    if self.out:
      append_record(self.out, r)
    return r


def print_stopped(e: OutOfBudget, out: str | None) -> None:
  print(f'stopped before the next point: {e}. Rerun the same command'
        + (f' (with --out {out})' if out else ' with --out')
        + ' to go on from here.', flush=True)


def append_record(path: str, record: dict) -> None:
  """Appends `record` as one JSON line to `path` (made if missing)."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, 'a') as f:
    f.write(json.dumps(record) + '\n')


def load_records(path: str) -> list[dict]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


# ---------------------------------------------------------------- the tables


def _gib(x):
  return f'{x / 2**30:.1f}' if x else 'n/a'


def _ratio(a, b):
  return f'{a / b:.2f}x' if a and b else ''


def tables(records: list[dict], batches=None, largest_table=True) -> str:
  """Markdown: each point (of `batches`, default all) with ratios to
  `plain` (a VLM's: `bf16`) at the same batch, then (largest_table) each
  run's largest batch that fits with ratios to that baseline's largest."""
  out = []
  groups = {}
  for r in records:
    groups.setdefault((r['preset'], r['seq']), []).append(r)
  for (preset, seq), rs in groups.items():
    ok = [r for r in rs if r['status'] == 'ok']
    device = ok[0]['device'] if ok else '?'
    baseline = 'bf16' if is_vlm(preset) else 'plain'
    data = ('shapes data, tokens/s of image tokens and text' if is_vlm(preset)
            else f'seq {seq}, random tokens')
    out.append(f'\n### {preset}: {device}, jax'
               f' {ok[0]["jax"] if ok else "?"},'
               f' XLA_PYTHON_CLIENT_MEM_FRACTION={rs[0]["mem_fraction"]}'
               f', {data}\n')
    names = list(dict.fromkeys(r['name'] for r in rs))
    plain = {r['batch']: r for r in ok if r['name'] == baseline}
    profiled = any(r.get('kernel_ms') for r in ok)
    out.append(f'| run | batch | tokens/s | vs {baseline} | model TFLOP/s |'
               f' peak GiB | vs {baseline} | compile s | step ms |'
               + (' kernels outside GEMM+attention, ms |' if profiled else ''))
    out.append('|---' * (9 + profiled) + '|')
    shown = sorted({r['batch'] for r in rs if batches is None
                    or r['batch'] in batches})
    for b in shown:
      for name in names:
        for r in rs:
          if r['name'] != name or r['batch'] != b:
            continue
          if r['status'] != 'ok':
            out.append(f'| {name} | {b} | {r["status"]} |' + ' |' * (
                6 + profiled))
            continue
          base = plain.get(b, {})
          row = (f'| {name} | {b} | {r["tokens_per_s"]:,.0f} |'
                 f' {_ratio(r["tokens_per_s"], base.get("tokens_per_s"))} |'
                 f' {r["model_tflops"]:.1f} | {_gib(r["peak_bytes"])} |'
                 f' {_ratio(r["peak_bytes"], base.get("peak_bytes"))} |'
                 f' {r["compile_s"]:.0f} | {r["step_ms"]:.1f} |')
          if profiled:
            row += f' {outside_gemm_attention(r)} |'
          out.append(row)
    if profiled:
      out.append(kernel_table([r for r in ok if r.get('kernel_ms')]))
    largest = {}
    for name in names:
      fit = [r for r in ok if r['name'] == name]
      if fit:
        best = max(fit, key=lambda r: r['batch'])
        fails = sorted(r['batch'] for r in rs if r['name'] == name
                       and r['status'] == 'does not fit'
                       and r['batch'] > best['batch'])
        largest[name] = (best, fails[0] if fails else None)
    if largest_table and largest:
      out.append('\nLargest batch that fits (of those tried):\n')
      out.append('| run | largest batch | does not fit | tokens/s |'
                 f' vs {baseline} at its largest | peak GiB |')
      out.append('|---|---|---|---|---|---|')
      base = largest.get(baseline, ({}, None))[0]
      for name, (r, fail) in largest.items():
        out.append(f'| {name} | {r["batch"]} | {fail or "not found"} |'
                   f' {r["tokens_per_s"]:,.0f} |'
                   f' {_ratio(r["tokens_per_s"], base.get("tokens_per_s"))} |'
                   f' {_gib(r["peak_bytes"])} |')
  return '\n'.join(out)


def kernel_table(records: list[dict]) -> str:
  """GPU kernel ms per step by op class (step_profile.py's), per point."""
  labels = list(dict.fromkeys(k for r in records for k in r['kernel_ms']))
  lines = ['\nGPU kernel ms per step by op class (benchmarks/step_profile.py'
           ' classes):\n',
           '| op class | ' + ' | '.join(f'{r["name"]} b{r["batch"]}'
                                      for r in records) + ' |',
           '|---' * (len(records) + 1) + '|']
  for label in labels:
    lines.append(f'| {label} | ' + ' | '.join(
        f'{r["kernel_ms"].get(label, 0.0):.1f}' for r in records) + ' |')
  lines.append('| outside GEMM+attention | ' + ' | '.join(
      outside_gemm_attention(r) for r in records) + ' |')
  lines.append('| step (wall) | ' + ' | '.join(
      f'{r["step_ms"]:.1f}' for r in records) + ' |')
  return '\n'.join(lines)


def outside_gemm_attention(r: dict) -> str:
  """GPU kernel ms per step outside GEMMs and attention (step_profile's
  classes): the work COAT adds around the matmuls."""
  ms = r.get('kernel_ms')
  if not ms:
    return ''
  inside = ('fp8 gemm', 'gemm', 'attention')
  return f'{sum(v for k, v in ms.items() if k not in inside):.1f}'


# ---------------------------------------------------------------- main


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      description=__doc__.split('\n\n')[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--preset', default='1b', choices=sorted(PRESETS))
  parser.add_argument('--batches', help='comma-separated (default: the'
                      ' preset\'s)')
  parser.add_argument('--modes', default='plain,bf16,fp8_linear,coat')
  parser.add_argument('--variants', nargs='*', default=[],
                      metavar='NAME=MODE:OVERRIDES')
  parser.add_argument('--set', nargs='*', default=[],
                      metavar='SECTION.FIELD=VALUE',
                      help='overrides for every run (model.* fields also'
                      ' shape plain), before each variant\'s own')
  parser.add_argument('--seq', type=int, help='default: the preset\'s')
  parser.add_argument('--steps', type=int, default=10,
                      help='timed steps after the 2 s warm-up')
  parser.add_argument('--max-batch', action='store_true',
                      help='also search each run\'s largest batch')
  parser.add_argument('--max-tries', type=int, default=6,
                      help='processes per run in the --max-batch search')
  parser.add_argument('--batch-multiple', type=int, default=1)
  parser.add_argument('--mem-fraction', type=float, default=0.97,
                      help='XLA_PYTHON_CLIENT_MEM_FRACTION of each point')
  parser.add_argument('--point-timeout', type=float, default=480)
  parser.add_argument('--budget-s', type=float, default=0,
                      help='start no point that might end after this many'
                      ' seconds (0: no limit); --out keeps what was done')
  parser.add_argument('--scanned', action='store_true',
                      help='also run each coat_jax mode with'
                      ' model.scan_layers=true (<mode>_scanned)')
  parser.add_argument('--profile', action='store_true',
                      help='GPU kernel ms by op class (step_profile.py)')
  parser.add_argument('--out', help='JSONL of the points (appended; points'
                      ' already there are reused)')
  parser.add_argument('--fresh', action='store_true',
                      help='rerun points already in --out')
  parser.add_argument('--report-only', metavar='FILE',
                      help='print the tables of a --out file and exit')
  parser.add_argument('--point', help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.point:
    print(RESULT + json.dumps(run_point(json.loads(args.point))), flush=True)
    return 0
  if args.report_only:
    latest = {point_key(r): r for r in load_records(args.report_only)}
    print(tables(list(latest.values())))
    return 0
  try:
    runs = runs_from_args(args.modes, args.variants, args.scanned)
  except ValueError as e:
    parser.error(str(e))
  preset = PRESETS[args.preset]
  args.model = preset['model']
  plain = [m for m, _ in runs.values() if m in PLAIN_MODES]
  if is_vlm(args.model) and plain:
    parser.error(f'--preset {args.preset} is a VLM: its modes are'
                 f' {tuple(MODE_OVERRIDES)} (not {plain[0]}).')
  args.seq = args.seq or preset['seq']
  batches = ([int(b) for b in args.batches.split(',')] if args.batches
             else list(preset['batches']))
  if not 0 < args.mem_fraction <= 1:
    parser.error(f'--mem-fraction={args.mem_fraction} must be in (0, 1].')
  print(f'e2e: {args.preset} ({args.model}), seq {args.seq}, batches'
        f' {batches}, runs {list(runs)}, {args.steps} timed steps per point,'
        f' XLA_PYTHON_CLIENT_MEM_FRACTION={args.mem_fraction}', flush=True)
  sweep = Sweep(out=args.out, fresh=args.fresh, budget_s=args.budget_s,
                point_timeout=args.point_timeout, key=point_key,
                run=run_in_process, describe=describe)

  def run(name, batch):
    mode, overrides = runs[name]
    p = dict(name=name, mode=mode, preset=args.model, seq=args.seq,
             batch=batch, overrides=args.set + overrides, steps=args.steps,
             profile=args.profile, mem_fraction=args.mem_fraction)
    return sweep.run(p, f'{name} batch {batch}')

  try:
    for batch in batches:
      for name in runs:
        run(name, batch)
    if args.max_batch:
      for name in runs:
        print(f'largest batch of {name}:', flush=True)
        best = search_max_batch(
            lambda b, n=name: run(n, b)['status'] == 'ok', max(batches),
            multiple=args.batch_multiple, max_tries=args.max_tries)
        print(f'  {name}: largest batch {best}', flush=True)
  except OutOfBudget as e:
    print_stopped(e, args.out)
  mine = [r for r in sweep.records.values()
          if (r['preset'], r['seq']) == (args.model, args.seq)]
  print(tables(mine, None if args.max_batch else set(batches),
               largest_table=args.max_batch))
  return 0


if __name__ == '__main__':
  sys.exit(main())
