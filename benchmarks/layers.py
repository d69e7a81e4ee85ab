"""One Llama-2-7B decoder layer (batch 8, seq 2048) in the three modes.

For each mode: forward+backward time (median of many runs after >= 2 s of
warm-up), saved activation bytes (jax.vjp residuals that grow with the
batch, attention's included), compiled temp memory, and the GEMM custom
calls of the compiled HLO (FP8 GEMMs must be `__cublas$lt$matmul$f8`).

  PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/layers.py
"""

import argparse
import datetime
import statistics
import time

from flax import nnx
import jax
import jax.numpy as jnp

import coat_jax.models as cm
from coat_jax.models.llama import DecoderLayer
from coat_jax.models.llama import rope_tables
import coat_jax.nn as cnn

F8_GEMM = 'custom_call_target="__cublas$lt$matmul$f8"'
GEMM = 'custom_call_target="__cublas$lt$matmul"'
OLD_GEMM = 'custom_call_target="__cublas$gemm"'
CUDNN = 'custom_call_target="__cudnn$fmha'


def _time(fn, args, warmup_s, runs):
  jax.block_until_ready(fn(*args))
  start = time.perf_counter()
  while time.perf_counter() - start < warmup_s:
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(runs):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times), min(times), max(times)


def bench(cfg, precision, implementation, batch, seq, warmup_s, runs):
  layer = DecoderLayer(cfg, precision=precision, dtype=jnp.bfloat16,
                       param_dtype=jnp.float32, implementation=implementation,
                       rngs=nnx.Rngs(0))
  graph, state = nnx.split(layer)
  cos, sin = rope_tables(seq, cfg.head_dim, cfg.rope_theta)
  fn = lambda s, x: nnx.merge(graph, s)(x, cos, sin)

  def step(s, x, dy):
    y, vjp = jax.vjp(fn, s, x)
    return y, vjp(dy)

  kx, ky = jax.random.split(jax.random.key(0))
  shape = (batch, seq, cfg.hidden_size)
  x = jax.random.normal(kx, shape, jnp.bfloat16)
  dy = jax.random.normal(ky, shape, jnp.bfloat16)
  compiled = jax.jit(step).lower(state, x, dy).compile()
  hlo = compiled.as_text()
  mem = compiled.memory_analysis()
  sd = lambda b: jax.ShapeDtypeStruct((b,) + shape[1:], jnp.bfloat16)
  res = cnn.activation_residuals(fn, (state, sd(batch)), (state, sd(2 * batch)))
  med, lo, hi = _time(compiled, (state, x, dy), warmup_s, runs)
  return dict(
      mode=precision if implementation is None else
      f'{precision}[{implementation}]',
      ms=med * 1e3, ms_min=lo * 1e3, ms_max=hi * 1e3,
      saved=cnn.nbytes(res),
      saved_attn=cnn.nbytes([r for r in res if r.ndim > 3]),
      temp=mem.temp_size_in_bytes if mem is not None else float('nan'),
      f8=hlo.count(F8_GEMM), gemm=hlo.count(GEMM) + hlo.count(OLD_GEMM),
      cudnn=hlo.count(CUDNN),
      residuals=[(r.shape, str(r.dtype)) for r in res])


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--preset', default='llama2_7b')
  parser.add_argument('--batch', type=int, default=8)
  parser.add_argument('--seq', type=int, default=2048)
  parser.add_argument('--warmup_s', type=float, default=2.5)
  parser.add_argument('--runs', type=int, default=30)
  parser.add_argument('--pallas', action='store_true',
                      help='also time coat with the Pallas FP8 GEMM')
  args = parser.parse_args()
  cfg = cm.LlamaConfig.preset(args.preset)
  device = jax.devices()[0]
  print(f'jax {jax.__version__}, device {device.device_kind},'
        f' {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC')
  runs = [('bf16', None), ('fp8_linear', None), ('coat', None)]
  if args.pallas:
    runs.append(('coat', 'pallas'))
  rows = []
  for precision, impl in runs:
    try:
      row = bench(cfg, precision, impl, args.batch, args.seq, args.warmup_s,
                  args.runs)
    except Exception as e:  # pylint: disable=broad-except
      print(f'{precision} [{impl}] failed: {type(e).__name__}: {e}'[:2000])
      continue
    print(row['mode'], 'residuals:', row.pop('residuals'))
    rows.append(row)
    _table(rows, args, cfg)


def _table(rows, args, cfg):
  unit = args.batch * args.seq * cfg.hidden_size * 2  # COAT's U
  base = next((r for r in rows if r['mode'] == 'bf16'), None)
  print(f'\n{args.preset} decoder layer, batch {args.batch}, seq {args.seq},'
        f' fwd+bwd; U = tokens x hidden x 2 bytes = {unit / 2**20:.0f} MiB')
  print(f'{"mode":<18}{"ms (median)":>12}{"min-max":>16}{"saved GiB":>10}'
        f'{"U":>7}{"(attn U)":>9}{"vs bf16":>8}{"temp GiB":>9}'
        f'{"f8 gemm":>8}{"bf16 gemm":>10}{"cudnn":>6}')
  for r in rows:
    ratio = r['saved'] / base['saved'] if base else float('nan')
    print(f'{r["mode"]:<18}{r["ms"]:>12.2f}'
          f'{r["ms_min"]:>8.2f}-{r["ms_max"]:<7.2f}'
          f'{r["saved"] / 2**30:>10.3f}{r["saved"] / unit:>7.2f}'
          f'{r["saved_attn"] / unit:>9.2f}{ratio:>8.3f}'
          f'{r["temp"] / 2**30:>9.2f}{r["f8"]:>8}{r["gemm"]:>10}'
          f'{r["cudnn"]:>6}')


if __name__ == '__main__':
  main()
