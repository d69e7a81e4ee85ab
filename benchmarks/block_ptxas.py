"""ptxas's register, spill and serialization report per block-scaled kernel
variant, beside the per-tensor kernel's (GPU only).

  python benchmarks/block_ptxas.py [--out DIR]

Compiles each variant once at 2048 x 2048 x 2048 (BF16 out, K-block-first
scales) with MOSAIC_GPU_DUMP_PTXAS=1, capturing what ptxas prints (file
descriptors 1 and 2) per variant, and prints per variant the registers
used, spill stores and loads, stack frame and ptxas's performance warnings
(C75xx, e.g. "wgmma.mma_async instructions are serialized"). The full
ptxas text goes to DIR/block_ptxas.txt.
"""

import argparse
import contextlib
import os
import re
import sys
import tempfile

os.environ['MOSAIC_GPU_DUMP_PTXAS'] = '1'

import jax  # noqa: E402  (after the environment variable)
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.fp8_matmul import mosaic_gpu  # noqa: E402
from pallas_kernels.fp8_matmul import mosaic_gpu_block  # noqa: E402

E4M3 = jnp.float8_e4m3fn
M = N = K = 2048


@contextlib.contextmanager
def captured_fds():
  """Collects what is written to file descriptors 1 and 2 (C++ included)
  into the yielded list's one string."""
  sys.stdout.flush()
  sys.stderr.flush()
  saved = [os.dup(1), os.dup(2)]
  text = []
  with tempfile.TemporaryFile(mode='w+b') as f:
    os.dup2(f.fileno(), 1)
    os.dup2(f.fileno(), 2)
    try:
      yield text
    finally:
      sys.stdout.flush()
      sys.stderr.flush()
      os.dup2(saved[0], 1)
      os.dup2(saved[1], 2)
      for fd in saved:
        os.close(fd)
      f.seek(0)
      text.append(f.read().decode(errors='replace'))


def variants():
  """[(name, jitted fn of (a, b, sa_t, sb_t))]."""
  out = []
  for label, cfg in (('three_wg', mosaic_gpu.THREE_WG_CONFIG),
                     ('default', mosaic_gpu.DEFAULT_CONFIG)):
    out.append((f'per-tensor {label}', lambda a, b, sa, sb, cfg=cfg: (
        mosaic_gpu.fp8_matmul_mosaic(a, b, jnp.float32(1), config=cfg))))
  three, default = mosaic_gpu.THREE_WG_CONFIG, mosaic_gpu.DEFAULT_CONFIG
  block_cfgs = (('three_wg', three),
                ('default', default),
                ('row_two_wg', mosaic_gpu_block.ROW_TWO_WG_CONFIG),
                ('row_three_wg', mosaic_gpu_block.ROW_THREE_WG_CONFIG))
  for gran in ('block', 'row'):
    for label, cfg in block_cfgs:
      if gran == 'block' and cfg.block_n != 128:
        continue

      def fn(a, b, sa, sb, cfg=cfg, gran=gran):
        return mosaic_gpu_block.fp8_matmul_block_scaled_mosaic(
            a, b, sa[gran], sb[gran], b_granularity=gran, config=cfg,
            a_scale_transposed=True, b_scale_transposed=True)
      out.append((f'{gran} {label}', fn))
  return out


def summarize(text):
  """Registers, spills, stack and C75xx warnings from ptxas -v output."""
  regs = re.findall(r'Used (\d+) registers', text)
  spills = re.findall(r'(\d+) bytes spill stores, (\d+) bytes spill loads',
                      text)
  stack = re.findall(r'(\d+) bytes stack frame', text)
  warns = sorted(set(re.findall(r'(C75\d\d[^\n]*)', text)))
  return dict(registers=regs, spills=spills, stack=stack, warnings=warns)


def main():
  p = argparse.ArgumentParser()
  p.add_argument('--out', default=os.environ.get('OUT', '.'))
  args = p.parse_args()
  a = jnp.ones((M, K), E4M3)
  b = jnp.ones((N, K), E4M3)
  sa = {g: jnp.ones((K // 128, M), jnp.float32) for g in ('block', 'row')}
  sb = {'block': jnp.ones((K // 128, N // 128), jnp.float32),
        'row': jnp.ones((K // 128, N), jnp.float32)}
  full = []
  for name, fn in variants():
    try:
      with captured_fds() as text:
        jax.block_until_ready(jax.jit(fn)(a, b, sa, sb))
      text = text[0]
      print(f'{name}: {summarize(text)}', flush=True)
    except Exception as e:  # pylint: disable=broad-except
      text = f'{type(e).__name__}: {str(e)[:500]}'
      print(f'{name}: ERROR {text}', flush=True)
    full.append(f'==== {name}\n{text}\n')
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, 'block_ptxas.txt'), 'w') as f:
    f.write(''.join(full))


if __name__ == '__main__':
  main()
