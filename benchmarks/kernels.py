"""Bandwidth of the quantization kernels and time of the fused COAT step.

  PYTHONPATH=. python benchmarks/kernels.py [--out results.jsonl] [--quick]
  PYTHONPATH=. python benchmarks/kernels.py --blockwise  # block quantizers
  PYTHONPATH=. python benchmarks/kernels.py --fused  # norm and SwiGLU

Every number in one run: a plain copy (x * 2 on 2^28 float32, bytes read +
written) as the ceiling; each op's effective GB/s (the logical bytes it must
read and write, each once) for the Pallas kernel and the XLA reference on
>= 1 GiB working sets; the optimizer step in ms per 2^28 params for the fused
Pallas step, the XLA COAT step (coat_adamw + apply_updates under one jit) and
optax.adamw (float32 moments), all with donated state. Timing: wall clock
around N calls closed by block_until_ready, after warm-up; the median of 5
repeats (the copy warms the GPU for 3 s first, each later op for 1 s).
"""

import argparse
import contextlib
import functools
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.coat_adam_step import pallas_triton as adam_pallas
from pallas_kernels.coat_adam_step import reference as adam_reference
from pallas_kernels.quantize_blockwise import mosaic_gpu as blockwise_mosaic
from pallas_kernels.quantize_blockwise import pallas_triton as blockwise_pallas
from pallas_kernels.quantize_blockwise import reference as blockwise_reference
from pallas_kernels.quantize_per_group import pallas_triton as group_pallas
from pallas_kernels.quantize_per_group import reference as group_reference
from pallas_kernels.quantize_per_tensor import pallas_triton as tensor_pallas
from pallas_kernels.quantize_per_tensor import reference as tensor_reference
from pallas_kernels.rms_norm_fp8 import pallas_triton as norm_pallas
from pallas_kernels.rms_norm_fp8 import reference as norm_reference
from pallas_kernels.swiglu_fp8 import pallas_triton as swiglu_pallas
from pallas_kernels.swiglu_fp8 import reference as swiglu_reference

# (impl label suffix, context the op is traced and timed in). The rows of the
# group math from before issue 5 ('old') were retired with old_group_math.py.
MATH = (('', contextlib.nullcontext),)

LOG2_N = int(os.environ.get('BENCH_LOG2_N', 28))  # smaller: dry runs only
N_PARAMS = 1 << LOG2_N
COLS = 1 << 13
ROWS = N_PARAMS // COLS  # 2^28 elements: a 32768 x 8192 matrix


def _block(tree):
  jax.tree.map(lambda a: a.block_until_ready(), tree)


def time_call(fn, args, *, iters=20, warm_s=1.0, repeats=5, carry=None):
  """Median seconds per call of fn(*args).

  With carry=(state, *extra): fn(state, *extra) -> state, state donated.
  """
  if carry is not None:
    state, *extra = carry
    call = lambda: fn(state, *extra)
  else:
    call = lambda: fn(*args)
  out = call()
  _block(out)
  if carry is not None:
    state = out
  t0 = time.perf_counter()
  while time.perf_counter() - t0 < warm_s:
    out = call()
    if carry is not None:
      state = out
  _block(out)
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    for _ in range(iters):
      out = call()
      if carry is not None:
        state = out
    _block(out)
    times.append((time.perf_counter() - t) / iters)
  return statistics.median(times)


def device_time_call(fn, args, *, calls=30, warm_s=1.0):
  """GPU kernel seconds per call of fn(*args), from a profile of `calls`
  calls (every kernel of the call, host dispatch left out): for ops of a
  few tens of us, which wall-clock timing measures as the host's dispatch.
  Off the GPU (dry runs): `time_call`."""
  if jax.default_backend() != 'gpu':
    return time_call(fn, args, warm_s=0.0, repeats=1, iters=1)
  from benchmarks import step_profile  # noqa: PLC0415
  time_call(fn, args, warm_s=warm_s, repeats=1)
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir):
      for _ in range(calls):
        out = fn(*args)
      _block(out)
    stats = step_profile.kernel_stats(trace_dir, calls)
  return sum(ms for ms, _ in stats.values()) / 1e3


def rows_of(results, name):
  return [r for r in results if r['name'] == name]


def bench_copy(results):
  x = jax.random.normal(jax.random.key(0), (ROWS, COLS), jnp.float32)
  s = time_call(jax.jit(lambda x: x * 2), (x,), warm_s=3.0)  # clocks up
  results.append(dict(name='copy x*2 f32', impl='xla', bytes=8 * N_PARAMS,
                      s=s))


def probe_xla_math():
  """How XLA rounds f32 division, sqrt, log, exp here, vs numpy (IEEE)."""
  rng = np.random.default_rng(0)
  a = rng.standard_normal(1 << 22).astype(np.float32)
  b = np.abs(rng.standard_normal(1 << 22).astype(np.float32)) + 1e-3
  out = {}
  out['div'] = int((np.asarray(jax.jit(jnp.divide)(a, b)) != a / b).sum())
  out['sqrt'] = int((np.asarray(jax.jit(jnp.sqrt)(b)) != np.sqrt(b)).sum())
  for name, f, g in (('log', jnp.log, np.log), ('exp', jnp.exp, np.exp)):
    ref = g(b.astype(np.float64)).astype(np.float32)
    out[name] = int((np.asarray(jax.jit(f)(b)) != ref).sum())
  print(f'# XLA f32 results differing from correctly rounded, of {b.size}:'
        f' {out}', flush=True)


def probe_kernel_ops():
  """Elements where the Pallas kernels differ from XLA on this device, with
  correctly rounded div/sqrt and with Triton's own (the default)."""
  import optax  # pylint: disable=g-import-not-at-top

  import coat_jax  # pylint: disable=g-import-not-at-top
  from pallas_kernels import _common  # pylint: disable=g-import-not-at-top
  from pallas_kernels.coat_adam_step import api  # pylint: disable=g-import-not-at-top  # noqa: E501
  shape = (2048, 4096)
  keys = jax.random.split(jax.random.key(9), 4)
  p = {'w': jax.random.normal(keys[0], shape)}
  tx = coat_jax.coat_adamw(1e-2, weight_decay=0.1)
  state = tx.init(p)

  @jax.jit
  def spec(g, state, p):
    u, state = tx.update(g, state, p)
    return optax.apply_updates(p, u), state

  grads = [{'w': jax.random.normal(k, shape) * 1e-2} for k in keys[1:]]
  for g in grads[:2]:
    p, state = spec(g, state, p)
  p_ref, s_ref = spec(grads[2], state, p)
  codes = lambda a: np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))
  for ieee in (True, False):
    _common.USE_IEEE_OPS = ieee
    jax.clear_caches()
    new_p, mu, _ = jax.jit(functools.partial(
        api.coat_adam_step, learning_rate=1e-2, weight_decay=0.1,
        implementation='pallas'))(p['w'], grads[2]['w'], state[0].mu['w'],
                                  state[0].nu['w'], state[0].count + 1)
    ref_mu = s_ref[0].mu['w']
    v, s, e = ref_mu.values, ref_mu.scale, ref_mu.exponent
    deq = group_pallas.dequantize_per_group(v, s, e, 128)
    deq_ref = jax.jit(lambda *a: group_reference.dequantize_per_group(
        *a, 128))(v, s, e)
    print(f'# kernel vs XLA, {"ieee" if ieee else "triton"} div/sqrt: adam p'
          f' {int((new_p != p_ref["w"]).sum())}, mu codes'
          f' {int((codes(mu.values) != codes(v)).sum())}, dequantize'
          f' {int((deq != deq_ref).sum())} of {new_p.size}', flush=True)
  _common.USE_IEEE_OPS = False
  jax.clear_caches()


def bench_group(results, quick):
  key = jax.random.key(1)
  cases = [  # (label, input dtype, group, fp8, expansion)
      ('quantize 1x128 e4m3 expand f32', jnp.float32, 128, 'e4m3', True),
      ('quantize 1x128 e4m3 f32', jnp.float32, 128, 'e4m3', False),
      ('quantize 1x16 e4m3 bf16', jnp.bfloat16, 16, 'e4m3', False),
  ]
  configs = [group_pallas.BlockSizes()]
  if not quick:
    configs += [group_pallas.BlockSizes(target=1024),
                group_pallas.BlockSizes(num_warps=8, target=8192)]
  for label, dtype, g, fmt, exp in cases:
    n = N_PARAMS if dtype == jnp.float32 else 2 * N_PARAMS  # >= 1 GiB in
    x = (jax.random.normal(key, (n // COLS, COLS), jnp.float32)
         * 1e-3).astype(dtype)
    meta = (4 if not exp else 8) * n // g
    nbytes = n * (x.dtype.itemsize + 1) + meta
    ref = jax.jit(lambda x: group_reference.quantize_per_group(x, g, fmt, exp))
    results.append(dict(name=label, impl='xla', bytes=nbytes,
                        s=time_call(ref, (x,))))
    runs = [(bs, '', contextlib.nullcontext) for bs in configs]
    for bs, suffix, codec in runs:
      f = jax.jit(functools.partial(
          group_pallas.quantize_per_group, group_size=g, dtype=fmt,
          expansion=exp, block_sizes=bs))
      with codec():
        results.append(dict(name=label, impl='pallas' + suffix,
                            config=str(bs), bytes=nbytes,
                            s=time_call(f, (x,))))
    del x
  # Dequantize 1x128 with expansion to f32 (reading the moments).
  x = jax.random.normal(key, (ROWS, COLS), jnp.float32) * 1e-3
  v, s, e = jax.jit(lambda x: group_reference.quantize_per_group(
      x, 128, 'e4m3', True))(x)
  del x
  label = 'dequantize 1x128 e4m3 expand ->f32'
  nbytes = N_PARAMS * 5 + 8 * N_PARAMS // 128
  ref = jax.jit(lambda v, s, e: group_reference.dequantize_per_group(
      v, s, e, 128))
  results.append(dict(name=label, impl='xla', bytes=nbytes,
                      s=time_call(ref, (v, s, e))))
  dconfigs = [group_pallas.BlockSizes(target=t, num_warps=w)
              for t, w in ((1024, 4), (2048, 8))]
  runs = [(bs, '', contextlib.nullcontext)
          for bs in (dconfigs[:1] if quick else dconfigs)]
  for bs, suffix, codec in runs:
    f = jax.jit(functools.partial(
        group_pallas.dequantize_per_group, group_size=128, block_sizes=bs))
    with codec():
      results.append(dict(name=label, impl='pallas' + suffix, config=str(bs),
                          bytes=nbytes, s=time_call(f, (v, s, e))))


def bench_tensor(results, quick):
  x = (jax.random.normal(jax.random.key(2), (2 * ROWS, COLS), jnp.float32)
       * 3).astype(jnp.bfloat16)  # 2^29 bf16 = 1 GiB
  n = x.size
  amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
  configs = [tensor_pallas.BlockSizes()]
  if not quick:
    configs += [tensor_pallas.BlockSizes(num_warps=8, target=8192)]
  for label, given, tr in (
      ('quantize tensor bf16->e4m3 (amax here)', False, False),
      ('quantize tensor bf16->e4m3 (amax given)', True, False),
      ('quantize+transpose bf16->e4m3 (amax given)', True, True)):
    nbytes = n * (2 + 1 + (1 if tr else 0))
    ref = jax.jit(lambda x, a, given=given, tr=tr:
                  tensor_reference.quantize_per_tensor(
                      x, 'e4m3', amax=a if given else None, transpose=tr))
    results.append(dict(name=label, impl='xla', bytes=nbytes,
                        s=time_call(ref, (x, amax))))
    tconfigs = configs if not tr else [
        tensor_pallas.BlockSizes(),
        tensor_pallas.BlockSizes(block_rows=128, block_cols=64, num_warps=8)]
    for bs in tconfigs:
      f = jax.jit(lambda x, a, given=given, tr=tr, bs=bs:
                  tensor_pallas.quantize_per_tensor(
                      x, 'e4m3', amax=a if given else None, transpose=tr,
                      block_sizes=bs))
      results.append(dict(name=label, impl='pallas', config=str(bs),
                          bytes=nbytes, s=time_call(f, (x, amax))))


# Tokens x (hidden, intermediate) of the 1b model at batch 8 x 2048.
_TOKENS = int(os.environ.get('BENCH_BLOCKWISE_TOKENS', 16384))  # dry runs
BLOCKWISE_SHAPES = ((_TOKENS, 2048), (_TOKENS, 4096), (_TOKENS, 5632))
_INTERPRET = jax.default_backend() != 'gpu'  # CPU dry runs only


def bench_blockwise(results, quick):
  """The block quantizers on bf16 activations, against a bf16 copy of the
  same tensor in the same run (x * 2: 2 bytes read, 2 written).

  1x128 tiles with the transposed copy in one pass (the linear layers'
  input and output-gradient quantizer): reads 2 B, writes 2 x (1 B +
  4 B / 128) per element; without the copy 1 B + 4 B / 128. 128x128 blocks
  for a float32 weight (hidden, intermediate). GPU kernel time
  (`device_time_call`): at these sizes (40-250 us) wall clock adds the
  host's dispatch, more to the copy than to the quantizers.
  """
  configs = [blockwise_pallas.BlockSizes()]
  if not quick:
    configs += [blockwise_pallas.BlockSizes(128, 128, 8),
                blockwise_pallas.BlockSizes(128, 256, 16),
                blockwise_pallas.BlockSizes(256, 256, 16),
                blockwise_pallas.BlockSizes(128, 512, 16)]
  for shape in BLOCKWISE_SHAPES:
    x = (jax.random.normal(jax.random.key(5), shape, jnp.float32)
         * 3).astype(jnp.bfloat16)
    n = x.size
    copy_name = f'copy x*2 bf16 {shape}'
    results.append(dict(
        name=copy_name, impl='xla', bytes=4 * n, copy=copy_name,
        s=device_time_call(jax.jit(lambda x: x * 2), (x,), warm_s=2.0)))
    # (transpose, pow2, transpose_block): the last is the layers' g^T in
    # 128x128 blocks (wgrad's B operand), one program per block.
    for transpose, pow2, tb in ((True, False, (1, 128)),
                                (True, True, (1, 128)),
                                (True, False, (128, 128)),
                                (False, False, (1, 128))):
      label = (f'tiles{"+T" if transpose else ""}'
               f'{" blocks" if tb == (128, 128) else ""}'
               f'{" pow2" if pow2 else ""} bf16->e4m3 {shape}')
      nbytes = n * (2 + (2 if transpose else 1) * (1 + 4 / 128))
      ref = jax.jit(lambda x, tr=transpose, p2=pow2, tb=tb:
                    blockwise_reference.quantize_blockwise(
                        x, (1, 128), 'e4m3', transpose=tr, pow2=p2,
                        transpose_block=tb))
      results.append(dict(name=label, impl='xla', bytes=nbytes,
                          copy=copy_name, s=device_time_call(ref, (x,))))
      sweep = transpose and not pow2
      for bs in configs if sweep else configs[:1]:
        f = jax.jit(lambda x, tr=transpose, p2=pow2, bs=bs, tb=tb:
                    blockwise_pallas.quantize_blockwise(
                        x, (1, 128), 'e4m3', transpose=tr, pow2=p2,
                        transpose_block=tb, block_sizes=bs,
                        interpret=_INTERPRET))
        results.append(dict(name=label, impl='triton', config=str(bs),
                            bytes=nbytes, copy=copy_name,
                            s=device_time_call(f, (x,))))
      # The Mosaic GPU kernel (what the Pallas path runs for these cases on
      # a GPU), its outputs in the API's layout: scales transposed after it.
      if transpose and not _INTERPRET:
        f = jax.jit(lambda x, p2=pow2, tb=tb: blockwise_mosaic.
                    quantize_blockwise(x, 'e4m3', pow2=p2, transpose_block=tb))
        results.append(dict(name=label, impl='mosaic', bytes=nbytes,
                            copy=copy_name, s=device_time_call(f, (x,))))
  # As the unrolled layers run it: one layer's slice of stacked float32
  # weights -> W's codes, W^T's (the forward GEMM's B) and the scales; GPU
  # kernel time (wall clock measured the host's dispatch here: XLA's three
  # kernels 80.6 us against 43.5 of kernel time, H200).
  stacked = jax.random.normal(
      jax.random.key(6), (4,) + BLOCKWISE_SHAPES[0][1:]
      + BLOCKWISE_SHAPES[-1][1:], jnp.float32) * 0.02
  label = f'blocks 128x128 f32->e4m3 {stacked.shape[1:]}, W and W^T'
  nbytes = stacked[0].size * (4 + 2)
  pallas_blocks = functools.partial(blockwise_pallas.quantize_blockwise,
                                    interpret=_INTERPRET)
  for impl, fn in (('xla', blockwise_reference.quantize_blockwise),
                   ('triton', pallas_blocks)):
    def layer_weight(stacked, fn=fn):
      values, scales = fn(stacked[1], (128, 128), 'e4m3')[:2]
      return values, values.T, scales
    results.append(dict(name=label, impl=impl, bytes=nbytes,
                        s=device_time_call(jax.jit(layer_weight),
                                           (stacked,))))


# Tokens (batch 8 x 2048) x (hidden, intermediate) of the 1b and 7B models.
_FUSED_TOKENS = int(os.environ.get('BENCH_FUSED_TOKENS', 16384))  # dry runs
FUSED_SHAPES = ((2048, 5632), (4096, 11008))


def bench_fused(results, quick):
  """COAT's FP8 RMSNorm and SwiGLU, forward and backward: the one-pass
  Pallas kernels against the XLA reference, and a bf16 copy of the same
  width in the same run (2 bytes read, 2 written).

  Logical bytes per element (each read or written once): norm forward
  reads x (2) and writes y (2), codes (1) and bf16 scales (2 / 16); norm
  backward reads codes, scales, g and the residual stream's gradient (as
  in the decoder layer) and writes dx: 7.125 each. SwiGLU
  forward reads gate and up (4), writes h (2) and two codes + scales
  (2.25); backward reads those groups and dh, writes dgate and dup: 8.25.
  """
  timing = dict(warm_s=2.0, iters=50, repeats=9)
  m = _FUSED_TOKENS
  norm_configs = [norm_pallas.BlockSizes()]
  swiglu_configs = [swiglu_pallas.BlockSizes()]
  if not quick:
    norm_configs += [norm_pallas.BlockSizes(target=t, steps=s, num_warps=w)
                     for t, s, w in ((2048, 8, None), (8192, 8, None),
                                     (4096, 4, None), (4096, 16, None),
                                     (4096, 32, None),
                                     (4096, 8, 4), (8192, 4, 16))]
    swiglu_configs += [swiglu_pallas.BlockSizes(target=t, num_warps=w)
                       for t, w in ((2048, 4), (8192, 8), (4096, 8))]
  # None: the backward's own default (`bwd_block_sizes`).
  norm_bwd_configs = [None]
  if not quick:
    norm_bwd_configs += [
        norm_pallas.BlockSizes(block_rows=r, steps=s, num_warps=w)
        for r, s, w in ((2, 8, 8), (1, 8, 8), (1, 16, 8), (1, 64, 8),
                        (1, 32, 4), (4, 2, 4))]
  key = jax.random.split(jax.random.key(8), 4)
  for hidden, inter in FUSED_SHAPES:
    for width in (hidden, inter):
      copy_name = f'copy x*2 bf16 ({m}, {width})'
      x = jax.random.normal(key[0], (m, width), jnp.bfloat16)
      results.append(dict(
          name=copy_name, impl='xla', bytes=4 * x.size, copy=copy_name,
          s=time_call(jax.jit(lambda x: x * 2), (x,), **timing)))
    copy_h = f'copy x*2 bf16 ({m}, {hidden})'
    copy_i = f'copy x*2 bf16 ({m}, {inter})'
    # RMSNorm (m, hidden).
    x = jax.random.normal(key[0], (m, hidden), jnp.bfloat16) * 3
    scale = jax.random.uniform(key[1], (hidden,), jnp.float32, 0.5, 1.5)
    g = jax.random.normal(key[2], (m, hidden), jnp.bfloat16)
    r = jax.random.normal(key[3], (m, hidden), jnp.bfloat16)
    _, codes, scales, rstd, _ = jax.jit(
        lambda x, s: norm_reference.rms_norm_fp8_fwd(x, s, 1e-5))(x, scale)
    nbytes = x.size * 5.125
    bwd_bytes = x.size * 7.125
    fwd = f'rms_norm_fp8 fwd ({m}, {hidden})'
    bwd = f'rms_norm_fp8 bwd ({m}, {hidden})'
    results.append(dict(name=fwd, impl='xla', bytes=nbytes, copy=copy_h,
                        s=time_call(jax.jit(
                            lambda x, s: norm_reference.rms_norm_fp8_fwd(
                                x, s, 1e-5)), (x, scale), **timing)))
    bwd_args = (codes, scales, rstd, scale, g, r)
    f = jax.jit(lambda *a: norm_reference.rms_norm_fp8_bwd(
        *a[:5], residual_grad=a[5]))
    results.append(dict(name=bwd, impl='xla', bytes=bwd_bytes, copy=copy_h,
                        s=time_call(f, bwd_args, **timing)))
    for bs in norm_configs:
      f = jax.jit(lambda x, s, bs=bs: norm_pallas.rms_norm_fp8_fwd(
          x, s, 1e-5, block_sizes=bs, interpret=_INTERPRET))
      results.append(dict(name=fwd, impl='pallas', config=str(bs),
                          bytes=nbytes, copy=copy_h,
                          s=time_call(f, (x, scale), **timing)))
    for bs in norm_bwd_configs:
      f = jax.jit(lambda *a, bs=bs: norm_pallas.rms_norm_fp8_bwd(
          *a[:5], residual_grad=a[5], block_sizes=bs,
          interpret=_INTERPRET))
      results.append(dict(name=bwd, impl='pallas',
                          config=str(bs or norm_pallas.bwd_block_sizes(
                              m, hidden)),
                          bytes=bwd_bytes, copy=copy_h,
                          s=time_call(f, bwd_args, **timing)))
    del x, g, r, codes, scales, rstd
    # SwiGLU (m, inter).
    gate = jax.random.normal(key[0], (m, inter), jnp.bfloat16) * 3
    up = jax.random.normal(key[1], (m, inter), jnp.bfloat16)
    dh = jax.random.normal(key[2], (m, inter), jnp.bfloat16)
    _, gate_q, up_q, _ = jax.jit(swiglu_reference.swiglu_fp8_fwd)(gate, up)
    nbytes = gate.size * 8.25
    fwd = f'swiglu_fp8 fwd ({m}, {inter})'
    bwd = f'swiglu_fp8 bwd ({m}, {inter})'
    results.append(dict(name=fwd, impl='xla', bytes=nbytes, copy=copy_i,
                        s=time_call(jax.jit(swiglu_reference.swiglu_fp8_fwd),
                                    (gate, up), **timing)))
    results.append(dict(name=bwd, impl='xla', bytes=nbytes, copy=copy_i,
                        s=time_call(jax.jit(swiglu_reference.swiglu_fp8_bwd),
                                    (gate_q, up_q, dh), **timing)))
    for bs in swiglu_configs:
      f = jax.jit(lambda g, u, bs=bs: swiglu_pallas.swiglu_fp8_fwd(
          g, u, block_sizes=bs, interpret=_INTERPRET))
      results.append(dict(name=fwd, impl='pallas', config=str(bs),
                          bytes=nbytes, copy=copy_i,
                          s=time_call(f, (gate, up), **timing)))
      f = jax.jit(lambda g, u, d, bs=bs: swiglu_pallas.swiglu_fp8_bwd(
          g, u, d, block_sizes=bs, interpret=_INTERPRET))
      results.append(dict(name=bwd, impl='pallas', config=str(bs),
                          bytes=nbytes, copy=copy_i,
                          s=time_call(f, (gate_q, up_q, dh), **timing)))
    del gate, up, dh, gate_q, up_q


def blockwise_table(results, prefixes=('tiles', 'blocks', 'copy x*2 bf16'),
                    ms=False):
  """GB/s of the ops named with `prefixes` (the block quantizers by
  default) and their share of the same-shape copy; times in us (or ms)."""
  unit, per_s, digits = ('ms', 1e3, 3) if ms else ('us', 1e6, 1)
  lines = [f'{"op":44s} {"impl":7s} {unit:>8s} {"GB/s":>7s} {"%copy":>6s}'
           f' {"vs xla":>7s}  config']
  xla = {r['name']: r['s'] for r in results if r['impl'] == 'xla'}
  for r in results:
    if not r['name'].startswith(prefixes):
      continue
    bw = r['bytes'] / r['s'] / 1e9
    copy = rows_of(results, r.get('copy', ''))
    pct = (100 * bw / (copy[0]['bytes'] / copy[0]['s'] / 1e9) if copy
           else float('nan'))
    ratio = xla.get(r['name'], float('nan')) / r['s']
    lines.append(f'{r["name"]:44s} {r["impl"]:7s} {r["s"] * per_s:8.{digits}f}'
                 f' {bw:7.0f} {pct:5.0f}% {ratio:6.2f}x  {r.get("config", "")}')
  return '\n'.join(lines)


LR, WD = 1e-3, 0.1
# ~16.3 B/param: p, g in; p out (f32), m, v (1 B + 8/128 meta) in and out.
STEP_BYTES = N_PARAMS * (4 + 4 + 4 + 4 * (1 + 8 / 128))


def time_optax_adamw(p, g):
  """Seconds per optax.adamw step (float32 moments) on params p, donated."""
  import optax  # pylint: disable=g-import-not-at-top
  tx = optax.adamw(LR, weight_decay=WD)

  def optax_step(state, g):
    p, s = state
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  step = jax.jit(optax_step, donate_argnums=0)
  return time_call(step, None, carry=((p, tx.init(p)), g))


def fused_state(p, expansion=True):
  """(p, m, v, count) for the fused step: zero E4M3 1x128 moments. Built
  eagerly under XLA, so outside any `MATH` or `fast_math` context."""
  zeros = jnp.zeros(p.shape, jnp.float32)
  m, v = (adam_reference.Moment(*group_reference.quantize_per_group(
      zeros, 128, 'e4m3', expansion)) for _ in range(2))
  return p, m, v, jnp.int32(0)


def time_fused_step(state, g, *, expansion=True, block_sizes=None):
  """Seconds per fused Pallas COAT step from `fused_state`, donated."""
  bs = block_sizes or adam_pallas.BlockSizes()

  def fused_step(state, g):
    p, m, v, count = state
    count = count + 1
    hp = adam_reference.hyperparams(count, LR, 0.9, 0.999, 1e-8, WD)
    p, m, v = adam_pallas.coat_adam_step(
        p, g, m, v, hp, group_size=128, expansion=expansion,
        apply_weight_decay=True, block_sizes=bs)
    return p, m, v, count

  step = jax.jit(fused_step, donate_argnums=0)
  return time_call(step, None, carry=(state, g))


def bench_adam(results, quick):
  import optax  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, '.')
  import coat_jax  # pylint: disable=g-import-not-at-top
  shape = (ROWS, COLS)
  key = jax.random.key(3)
  fresh = lambda: jax.random.normal(key, shape, jnp.float32)
  g = jax.random.normal(jax.random.key(4), shape, jnp.float32) * 1e-2
  name = 'adamw step (per 2^28 params)'
  results.append(dict(name=name, impl='optax f32', bytes=N_PARAMS * 32,
                      s=time_optax_adamw(fresh(), g)))

  # XLA COAT step: coat_adamw + apply_updates under one jit.
  ctx = coat_jax.coat_adamw(LR, weight_decay=WD)

  def coat_step(state, g):
    p, s = state
    u, s = ctx.update(g, s, p)
    return optax.apply_updates(p, u), s

  for suffix, codec in MATH:
    p = fresh()
    step = jax.jit(coat_step, donate_argnums=0)
    with codec():
      results.append(dict(
          name=name, impl='xla coat' + suffix, bytes=STEP_BYTES,
          s=time_call(step, None, carry=((p, ctx.init(p)), g))))
    del p

  # Fused Pallas step. The default (2 warps on 1024 elements: 16 per thread,
  # the per-group work amortized, 96 registers) and the former default, 4
  # warps.
  configs = [adam_pallas.BlockSizes(), adam_pallas.BlockSizes(num_warps=4)]
  if not quick:
    configs += [adam_pallas.BlockSizes(num_warps=w, target=t)
                for t, w in ((256, 2), (512, 2), (512, 4), (1024, 8),
                             (2048, 4), (2048, 8))]
  runs = [(bs, *MATH[0]) for bs in configs]
  for bs, suffix, codec in runs:
    state = fused_state(fresh())
    with codec():
      results.append(dict(
          name=name, impl='pallas fused' + suffix, config=str(bs),
          bytes=STEP_BYTES, s=time_fused_step(state, g, block_sizes=bs)))
    del state


def table(results):
  copy = rows_of(results, 'copy x*2 f32')[0]
  copy_bw = copy['bytes'] / copy['s'] / 1e9
  lines = [f'{"op":46s} {"impl":16s} {"ms":>8s} {"GB/s":>7s} {"%copy":>6s}'
           f' {"vs xla":>7s}  config']
  best = {}
  for r in results:
    best.setdefault((r['name'], r['impl']), r)
    if r['s'] < best[(r['name'], r['impl'])]['s']:
      best[(r['name'], r['impl'])] = r
  for r in results:
    bw = r['bytes'] / r['s'] / 1e9
    xla = best.get((r['name'], 'xla')) or best.get((r['name'], 'xla coat'))
    ratio = xla['s'] / r['s'] if xla else float('nan')
    lines.append(
        f'{r["name"]:46s} {r["impl"]:16s} {r["s"] * 1e3:8.3f} {bw:7.0f}'
        f' {100 * bw / copy_bw:5.0f}% {ratio:6.2f}x  {r.get("config", "")}')
  return '\n'.join(lines)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--out', default=None)
  parser.add_argument('--quick', action='store_true')
  parser.add_argument(
      '--only', default='probe,probe_ops,copy,group,tensor,adam')
  parser.add_argument(
      '--blockwise', action='store_true',
      help='only the block quantizers (1x128 tiles with the transposed copy,'
      ' 128x128 blocks) against a same-shape copy')
  parser.add_argument(
      '--fused', action='store_true',
      help='only the FP8 RMSNorm and SwiGLU kernels, forward and backward,'
      ' at the 1b and 7B shapes, against XLA and a same-shape copy')
  args = parser.parse_args()
  if args.blockwise:
    args.only = 'blockwise'
  if args.fused:
    args.only = 'fused'

  dev = jax.devices()[0]
  print(f'# {dev.device_kind}, jax {jax.__version__},'
        f' {time.strftime("%Y-%m-%d %H:%M:%S")}', flush=True)
  results = []
  benches = dict(copy=lambda r, q: bench_copy(r), group=bench_group,
                 probe=lambda r, q: probe_xla_math(),
                 probe_ops=lambda r, q: probe_kernel_ops(),
                 tensor=bench_tensor, adam=bench_adam,
                 blockwise=bench_blockwise, fused=bench_fused)
  for name in args.only.split(','):
    try:
      benches[name](results, args.quick)
    except Exception as e:  # keep the other numbers
      print(f'# {name} failed: {type(e).__name__}: {e}'[:2000], flush=True)
    for r in results:
      r.setdefault('device', dev.device_kind)
    if args.out:
      with open(args.out, 'w') as f:
        for r in results:
          f.write(json.dumps(r) + '\n')
    print(f'# {name} done', flush=True)
  if rows_of(results, 'copy x*2 f32'):
    print(table(results))
  if any(r['name'].startswith('tiles') for r in results):
    print(blockwise_table(results))
  if any(r['name'].startswith(('rms_norm', 'swiglu')) for r in results):
    print(blockwise_table(results, ('rms_norm', 'swiglu', 'copy x*2 bf16'),
                          ms=True))


if __name__ == '__main__':
  main()
