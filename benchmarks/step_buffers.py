"""What the compiled gradient step keeps at its memory peak, by buffer.

Compiles value_and_grad of `lm_loss` (nothing is executed) with XLA's dumps
on, then reads XLA's buffer assignment and live ranges: the temp bytes,
the instruction where the live bytes peak, and the buffers live there
grouped by shape and by the coat_jax source line (and forward 'F' or
backward 'B') that made them. Compares scanned and unrolled layers (or any
`--set` variants) in one run. Works on CPU and GPU; on CPU, XLA converts
bfloat16 and FP8 loop buffers and dot operands to float32/float16 copies
that a GPU does not make.

  PYTHONPATH=. python benchmarks/step_buffers.py --preset 1b --batch 8 \
      --precision bf16 --remat minimal
"""

import argparse
import collections
import glob
import os
import re
import tempfile

import jax

from benchmarks import step_memory
from coat_jax import models

_VALUE = re.compile(
    r' value: <\d+ (\S+) @\d+> \(size=(\d+),offset=\d+\): (\S+)')
_RANGE = re.compile(r'\s+(\S+?)\{([^}]*)\}:(\d+)-(\d+)')
_INSTR = re.compile(r'\s*(?:ROOT )?%(\S+) = .*?op_name="([^"]*)"'
                    r'(?:.*?stack_frame_id=(\d+))?')


_F32_3D = re.compile(r'\s*(?:ROOT )?%\S+ = f32\[(\d+),(\d+),(\d+)\]')
_ENTRY = re.compile(r'^ENTRY .*?^\}', re.M | re.S)


def transposed_weight_stacks(hlo_text: str, num_layers: int) -> list[str]:
  """Instructions of an optimized HLO module that make a float32 array of a
  stacked weight's dims (L, a, b) (an entry parameter, L = num_layers) with
  the layer axis inside: XLA laid a layer scan's weights out so for its
  FP8 weight quantizer, a transposed copy of every stacked weight, until
  the scan asked for them row-major
  (`coat_jax.models.llama._row_major_weights`)."""
  entry = _ENTRY.search(hlo_text)
  stacks = set()
  for line in (entry[0] if entry else '').splitlines():
    m = _F32_3D.match(line)
    if m and ' parameter(' in line and int(m[1]) == num_layers:
      stacks.add(tuple(sorted((int(m[2]), int(m[3])))))
  copies = []
  for line in hlo_text.splitlines():
    m = _F32_3D.match(line)
    if not m or int(m[1]) == num_layers:
      continue
    dims = [int(d) for d in m.groups()]
    if num_layers in dims:
      dims.remove(num_layers)
      if tuple(sorted(dims)) in stacks:
        copies.append(line.strip()[:200])
  return copies


def _one(pattern):
  files = glob.glob(pattern)
  return files[0] if files else None


def _frames(hlo_text):
  """stack_frame_id -> innermost coat_jax 'file:line' (HLO's tables)."""
  tables = collections.defaultdict(dict)
  section = None
  for line in hlo_text.splitlines():
    if line.strip() in ('FileNames', 'FunctionNames', 'FileLocations',
                        'StackFrames'):
      section = line.strip()
      continue
    if not line.strip():
      section = None
      continue
    if section:
      key, _, rest = line.partition(' ')
      tables[section][key] = rest
  files, locs, frames = (tables['FileNames'], tables['FileLocations'],
                         tables['StackFrames'])

  def where(fid):
    seen = set()
    while fid in frames and fid not in seen:
      seen.add(fid)
      m = re.match(r'\{file_location_id=(\d+) parent_frame_id=(\d+)',
                   frames[fid])
      loc = re.match(r'\{file_name_id=(\d+) function_name_id=\d+ line=(\d+)',
                     locs.get(m.group(1), ''))
      if loc:
        name = files.get(loc.group(1), '').strip('"')
        if 'coat_jax' in name:
          return f'{name.split("coat_jax/")[-1]}:{loc.group(2)}'
      fid = m.group(2)
    return '?'

  return where


def peak_buffers(dump_dir):
  """(temp-like peak bytes, instruction at the peak, [(bytes, shape,
  source)]) of the largest module in an XLA dump directory."""
  reports = glob.glob(os.path.join(dump_dir, '*after_optimizations'
                                   '-buffer-assignment.txt'))
  ba = max(reports, key=os.path.getsize)
  prefix = ba[:-len('-buffer-assignment.txt')]
  lr = _one(prefix + '-live-range.txt')
  hlo_path = _one(prefix + '.txt')
  values = {}
  kind = ''
  with open(ba) as f:
    for line in f:
      if line.startswith('allocation '):
        kind = line
      elif line.startswith('Total bytes') or line.startswith(
          'Used values'):
        break
      m = _VALUE.match(line)
      if m and not any(k in kind for k in ('parameter', 'constant',
                                           'thread-local')):
        # Keyed as the live-range file names values: 'name{}' for an array,
        # 'name{i}' for a tuple's element.
        name = m.group(1) if '{' in m.group(1) else m.group(1) + '{}'
        values[name] = (int(m.group(2)), m.group(3))
  if lr is None:
    return None, None, sorted(((s, sh, '?') for s, sh in values.values()),
                              reverse=True)
  ranges = {}
  order = []
  with open(lr) as f:
    for line in f:
      m = re.match(r'\s+(\d+):(\S+)$', line)
      if m:
        order.append(m.group(2))
        continue
      m = _RANGE.match(line)
      if m:
        ranges[f'{m.group(1)}{{{m.group(2)}}}'] = (int(m.group(3)),
                                                   int(m.group(4)))
  n = max(e for _, e in ranges.values()) + 2
  delta = [0] * n
  for name, (size, _) in values.items():
    if name in ranges:
      s, e = ranges[name]
      delta[s] += size
      delta[e + 1] -= size
  live, peak, at = 0, 0, 0
  for t in range(n):
    live += delta[t]
    if live > peak:
      peak, at = live, t
  hlo = open(hlo_path).read() if hlo_path else ''
  where = _frames(hlo)
  meta = {}
  for line in hlo.splitlines():
    m = _INSTR.match(line)
    if m:
      phase = 'B' if 'transpose(' in m.group(2) else 'F'
      source = where(m.group(3))
      if source == '?':  # no coat_jax frame: the jax op, e.g. while/...
        source = '/'.join(m.group(2).split('/')[-2:])
      meta[m.group(1)] = f'{source} {phase}'
  out = [(size, shape, meta.get(name.partition('{')[0], '?'))
         for name, (size, shape) in values.items()
         if name in ranges and ranges[name][0] <= at <= ranges[name][1]]
  return peak, order[at] if at < len(order) else '?', sorted(out,
                                                             reverse=True)


def largest(buffers, top: int) -> str:
  """The `top` largest (shape, source) groups of `peak_buffers`'s buffers,
  one line each."""
  sizes = collections.Counter()
  for size, shape, source in buffers:
    sizes[(shape, source)] += size
  return '\n'.join(f'  {size / 2**20:10.1f} MiB  {shape:36s} {source}'
                   for (shape, source), size in sizes.most_common(top))


def compile_step(cfg, precision, batch, seq, dump_dir):
  return step_memory.compile_loss_step(
      cfg, precision, batch, seq,
      {'xla_dump_to': dump_dir, 'xla_dump_hlo_as_text': True}
  ).memory_analysis()


def _value(text):
  for cast in (int, float):
    try:
      return cast(text)
    except ValueError:
      pass
  return {'true': True, 'false': False}.get(text.lower(), text)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--preset', default='1b')
  parser.add_argument('--batch', type=int, default=8)
  parser.add_argument('--seq', type=int, default=2048)
  parser.add_argument('--precision', default='bf16')
  parser.add_argument('--remat', default='minimal')
  parser.add_argument('--variants', nargs='*', default=[
      'scanned=scan_layers=true', 'unrolled=scan_layers=false'],
                      help='name=field=value[,field=value] LlamaConfig'
                      ' overrides')
  parser.add_argument('--top', type=int, default=25)
  args = parser.parse_args()
  print(f'{jax.devices()[0].device_kind}, jax {jax.__version__},'
        f' {args.preset} {args.precision} remat={args.remat},'
        f' batch {args.batch} x {args.seq}')
  for variant in args.variants:
    name, _, sets = variant.partition('=')
    overrides = dict(kv.split('=') for kv in sets.split(',') if kv)
    cfg = models.LlamaConfig.preset(
        args.preset, remat=args.remat,
        **{k: _value(v) for k, v in overrides.items()})
    with tempfile.TemporaryDirectory() as dump_dir:
      mem = compile_step(cfg, args.precision, args.batch, args.seq,
                         dump_dir)
      peak, at, buffers = peak_buffers(dump_dir)
    print(f'\n## {name}: temp {mem.temp_size_in_bytes / 2**30:.2f} GiB,'
          f' args {mem.argument_size_in_bytes / 2**30:.2f} GiB'
          + (f', live peak {peak / 2**30:.2f} GiB at {at}' if peak else
             ' (no live ranges dumped: largest buffers)'))
    print(largest(buffers, args.top))


if __name__ == '__main__':
  main()
