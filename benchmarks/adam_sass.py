"""SASS instructions per element of the COAT Adam kernels, without a GPU.

  PYTHONPATH=. python benchmarks/adam_sass.py [--tiles 1024/2 2048/4 ...]

Lowers `coat_adam_step` and `coat_adam_update` (4096 x 4096 float32, E4M3
moments with expansion) to Triton IR for CUDA on any machine, compiles
it for sm_90 with the `triton` package (pip install triton; its ptxas and
cuobjdump) and prints, per variant of the group math (`APPROX_MATH` 'log2'
and 'ln' with `approx`, and the exact ops without it) and per tile, the SASS
instructions and special-function (MUFU) instructions per element, and the
registers per thread. With `approx` the kernels have no loops or calls: a
thread runs each of its instructions once for its (tile elements / threads)
elements (the exact ops call libdevice's log and exp, whose branches make
their count a lower bound). A static count, not a time:
benchmarks/optimizer.py measures.
"""

import argparse
import collections
import functools
import os
import re
import subprocess
import tempfile
from unittest import mock

import jax
from jax._src.pallas.triton import lowering as triton_lowering
import jax.numpy as jnp

from pallas_kernels.coat_adam_step import pallas_triton as adam_pallas
from pallas_kernels.coat_adam_step import reference
from pallas_kernels.quantize_per_group import reference as group_reference

SHAPE = (4096, 4096)


def triton_ir(op, math, approx, tiles):
  """The Triton module (text) of `op` ('step' or 'update') for CUDA."""
  x = jax.ShapeDtypeStruct(SHAPE, jnp.float32)
  groups = jax.ShapeDtypeStruct(
      group_reference.scale_shape(SHAPE, 128), jnp.float32)
  moment = reference.Moment(
      jax.ShapeDtypeStruct(SHAPE, jnp.float8_e4m3fn), groups, groups)
  hp = reference.hyperparams(jnp.int32(1), 1e-3, 0.9, 0.999, 1e-8, 0.1)
  kw = dict(group_size=128, expansion=True, block_sizes=tiles, approx=approx)
  if op == 'step':
    f = functools.partial(adam_pallas.coat_adam_step,
                          apply_weight_decay=True, **kw)
    args = (x, x, moment, moment, hp)
  else:
    f = functools.partial(adam_pallas.coat_adam_update, **kw)
    args = (x, moment, moment, hp)
  modules = []
  lower = triton_lowering.lower_jaxpr_to_triton_module

  def grab(*a, **k):
    result = lower(*a, **k)
    modules.append(result.module.operation.get_asm(enable_debug_info=False))
    return result

  with mock.patch.object(triton_lowering, 'lower_jaxpr_to_triton_module',
                         grab), mock.patch.object(
                             adam_pallas, 'APPROX_MATH', math):
    jax.clear_caches()  # the kernels read APPROX_MATH when traced
    jax.jit(f).trace(*args).lower(lowering_platforms=('cuda',))
  return modules[0]


def sass_counts(ir, num_warps):
  """(opcode counts, registers) of the module compiled for sm_90."""
  # Only here: the rest of the module runs without the triton package.
  import triton  # pylint: disable=g-import-not-at-top
  from triton.backends import compiler  # pylint: disable=g-import-not-at-top

  os.environ.setdefault('TRITON_DEFAULT_FP_FUSION', '1')
  with tempfile.TemporaryDirectory() as d:
    src = os.path.join(d, 'kernel.ttir')
    with open(src, 'w') as f:
      f.write(ir)
    kernel = triton.compile(src, target=compiler.GPUTarget('cuda', 90, 32),
                            options=dict(num_warps=num_warps, num_stages=1))
    cubin = os.path.join(d, 'kernel.cubin')
    with open(cubin, 'wb') as f:
      f.write(kernel.asm['cubin'])
    tool = os.path.join(os.path.dirname(triton.__file__),
                        'backends', 'nvidia', 'bin', 'cuobjdump')
    sass = subprocess.run([tool, '-sass', cubin], capture_output=True,
                          text=True, check=True).stdout
    usage = subprocess.run([tool, '-res-usage', cubin], capture_output=True,
                           text=True, check=True).stdout
  ops = collections.Counter()
  for line in sass.splitlines():
    m = re.match(r'\s*/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)',
                 line)
    if m:
      ops[m.group(1)] += 1
  regs = re.search(r'REG:(\d+)', usage)
  return ops, int(regs.group(1)) if regs else None


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--tiles', nargs='*', default=['1024/2'],
                      help='target/num_warps of the tiles (default 1024/2)')
  args = parser.parse_args()
  print(f'{"op":7s} {"math":10s} {"tile":>8s} {"SASS/el":>8s} {"MUFU/el":>8s}'
        f' {"regs":>5s}')
  for op in ('step', 'update'):
    for tile in args.tiles:
      target, warps = (int(v) for v in tile.split('/'))
      tiles = adam_pallas.BlockSizes(target=target, num_warps=warps)
      br, bc = tiles.resolve(*SHAPE, 128)
      per_thread = br * bc / (32 * warps)
      for math, approx in (('log2', True), ('log2_table', True), ('ln', True),
                           ('exact', False)):
        ir = triton_ir(op, 'ln' if math == 'exact' else math, approx, tiles)
        ops, regs = sass_counts(ir, warps)
        print(f'{op:7s} {math:10s} {tile:>8s}'
              f' {sum(ops.values()) / per_thread:8.1f}'
              f' {ops["MUFU"] / per_thread:8.2f} {regs:5d}', flush=True)


if __name__ == '__main__':
  main()
