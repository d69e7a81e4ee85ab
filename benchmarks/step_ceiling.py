"""How fast could the fused COAT step and the expansion quantizer be?

  PYTHONPATH=. python benchmarks/step_ceiling.py

Times, in one run, the Pallas kernels of issue 5 as they are and with their
transcendental functions swapped for the GPU's approximate instructions
(`lg2.approx`, `ex2.approx`: one special-function op each, no libdevice
polynomial), and the fused step without dynamic range expansion (linear FP8
moments, no log or exp at all). The swapped rows are NOT the reference's
numbers (they are not checked, only timed): they bound what any exact
formulation of the same math could gain by cheaper log and exp. Timing and
bytes as `kernels.py` (copy and optax.adamw measured in the same run).
"""

import contextlib
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _common
from pallas_kernels.quantize_per_group import pallas_triton as group_pallas
from pallas_kernels.quantize_per_group import reference as group_reference

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernels  # noqa: E402  pylint: disable=g-import-not-at-top

_LN2 = np.float32(np.log(2.0))
_LOG2E = np.float32(1 / np.log(2.0))


def _fast_log(x):
  return _common._asm('lg2.approx.ftz.f32 $0, $1;', x) * _LN2  # pylint: disable=protected-access


def _fast_exp(x):
  return _common._asm('ex2.approx.ftz.f32 $0, $1;', x * _LOG2E)  # pylint: disable=protected-access


class _JnpWith:
  """jax.numpy with some functions replaced."""

  def __init__(self, **overrides):
    self.__dict__.update(overrides)

  def __getattr__(self, name):
    return getattr(jnp, name)


@contextlib.contextmanager
def fast_math(log: bool, exp: bool):
  """Kernels traced inside use approximate ln (and exp) in the group math."""
  saved = group_reference.jnp
  overrides = {}
  if log:
    overrides['log'] = _fast_log
  if exp:
    overrides['exp'] = _fast_exp
  jax.clear_caches()
  group_reference.jnp = _JnpWith(**overrides)
  try:
    yield
  finally:
    group_reference.jnp = saved
    jax.clear_caches()


VARIANTS = (('exact', contextlib.nullcontext),
            ('fast log', functools.partial(fast_math, True, False)),
            ('fast log+exp', functools.partial(fast_math, True, True)))


def code_differences(x):
  """How the fast-log quantizer's output differs from the exact kernel's on
  x: (codes differing, largest difference in code steps, scales and
  exponents differing)."""
  f = jax.jit(functools.partial(group_pallas.quantize_per_group,
                                group_size=128, dtype='e4m3', expansion=True))
  exact = f(x)
  with fast_math(True, False):
    fast = f(x)
  codes = [np.asarray(jax.lax.bitcast_convert_type(q[0], jnp.uint8))
           .astype(np.int32) for q in (exact, fast)]
  # Positive codes order like their bits; compare magnitudes (bit 7: sign).
  mag = [c & 0x7F for c in codes]
  return dict(
      codes=int((codes[0] != codes[1]).sum()), of=int(codes[0].size),
      max_steps=int(np.abs(mag[0] - mag[1]).max()),
      scales=int((np.asarray(exact[1]) != np.asarray(fast[1])).sum()),
      exponents=int((np.asarray(exact[2]) != np.asarray(fast[2])).sum()))


def main():
  dev = jax.devices()[0]
  print(f'# {dev.device_kind}, jax {jax.__version__},'
        f' {time.strftime("%Y-%m-%d %H:%M:%S")}', flush=True)
  results = []
  kernels.bench_copy(results)
  rows, cols, n = kernels.ROWS, kernels.COLS, kernels.N_PARAMS

  x = jax.random.normal(jax.random.key(1), (rows, cols), jnp.float32) * 1e-3
  q_bytes = n * 5 + 8 * n // 128
  for label, codec in VARIANTS:
    f = jax.jit(functools.partial(group_pallas.quantize_per_group,
                                  group_size=128, dtype='e4m3',
                                  expansion=True))
    with codec():
      results.append(dict(name='quantize 1x128 e4m3 expand f32',
                          impl=label, bytes=q_bytes,
                          s=kernels.time_call(f, (x,))))
  print('# fast log vs exact, N(0, 1e-3) f32:', code_differences(x),
        flush=True)
  g2 = (jax.random.normal(jax.random.key(5), x.shape, jnp.float32) * 1e-3)**2
  print('# fast log vs exact, squares of N(0, 1e-3) (like v):',
        code_differences(g2), flush=True)
  del g2
  v, s, e = jax.jit(lambda x: group_reference.quantize_per_group(
      x, 128, 'e4m3', True))(x)
  del x
  for label, codec in VARIANTS[::2]:
    f = jax.jit(functools.partial(group_pallas.dequantize_per_group,
                                  group_size=128))
    with codec():
      results.append(dict(name='dequantize 1x128 e4m3 expand', impl=label,
                          bytes=q_bytes, s=kernels.time_call(f, (v, s, e))))
  del v, s, e

  shape = (rows, cols)
  fresh = lambda: jax.random.normal(jax.random.key(3), shape, jnp.float32)
  g = jax.random.normal(jax.random.key(4), shape, jnp.float32) * 1e-2
  results.append(dict(name='adamw step', impl='optax f32', bytes=32 * n,
                      s=kernels.time_optax_adamw(fresh(), g)))
  runs = [(label, codec, True) for label, codec in VARIANTS]
  runs.append(('linear moments (no expansion)', contextlib.nullcontext,
               False))
  for label, codec, expansion in runs:
    state = kernels.fused_state(fresh(), expansion)
    with codec():
      results.append(dict(
          name='fused coat step', impl=label, bytes=kernels.STEP_BYTES,
          s=kernels.time_fused_step(state, g, expansion=expansion)))
    del state

  copy = kernels.rows_of(results, 'copy x*2 f32')[0]
  copy_bw = copy['bytes'] / copy['s']
  adamw = kernels.rows_of(results, 'adamw step')[0]['s']
  print('\n| op | variant | ms | % of copy | vs optax.adamw |')
  print('|---|---|---|---|---|')
  for r in results:
    bw = r['bytes'] / r['s']
    vs = (f'{adamw / r["s"]:.2f}x' if 'step' in r['name'] else '')
    print(f'| {r["name"]} | {r["impl"]} | {r["s"] * 1e3:.3f} |'
          f' {100 * bw / copy_bw:.0f}% | {vs} |')


if __name__ == '__main__':
  main()
