"""What a full train step keeps, per mode: compiled.memory_analysis().

Compiles value_and_grad of lm_loss for a Llama at two depths and reports the
temp bytes and the marginal bytes per layer (the difference over the extra
layers), which is what backward keeps for one layer. Runs anywhere (CPU
included); nothing is executed.

  PYTHONPATH=. python benchmarks/step_memory.py --preset 125m --layers 4,12
"""

import argparse

from flax import nnx
import jax
import jax.numpy as jnp

from coat_jax import models

MODES = ('bf16', 'fp8_linear', 'coat')
# XLA:CPU removes optimization barriers (jax.checkpoint's, the FP8 layers')
# before fusion, XLA:GPU only after scheduling: on a CPU, compile with this
# to keep what a GPU step keeps (`gpu_like_options`).
KEEP_BARRIERS = {'xla_disable_hlo_passes': 'cse_barrier_expander'}


def compile_loss_step(cfg, precision, batch, seq, compiler_options=None,
                      scaling='tensor'):
  """value_and_grad of lm_loss for a Llama of `cfg` on (batch, seq) tokens,
  compiled ahead of time from shapes only (nothing is allocated)."""
  model = nnx.eval_shape(lambda: models.Llama(
      cfg, precision=precision, scaling=scaling, rngs=nnx.Rngs(0)))
  graph, state = nnx.split(model)
  step = jax.jit(jax.value_and_grad(
      lambda s, t, y: models.lm_loss(nnx.merge(graph, s), t, y)))
  tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
  return step.lower(state, tokens, tokens).compile(compiler_options)


def gpu_like_options() -> dict | None:
  """Compiler options under which this backend keeps optimization barriers
  as XLA:GPU does: KEEP_BARRIERS on CPU, None (the defaults) elsewhere."""
  return KEEP_BARRIERS if jax.default_backend() == 'cpu' else None


def temp_bytes(cfg, precision, batch, seq, compiler_options=None):
  return compile_loss_step(cfg, precision, batch, seq, compiler_options
                           ).memory_analysis().temp_size_in_bytes


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--preset', default='125m')
  parser.add_argument('--layers', default='4,12')
  parser.add_argument('--batch', type=int, default=4)
  parser.add_argument('--seq', type=int, default=512)
  args = parser.parse_args()
  lo, hi = (int(n) for n in args.layers.split(','))
  rows = {}
  for precision in MODES:
    t = [temp_bytes(models.LlamaConfig.preset(args.preset, num_layers=n),
                    precision, args.batch, args.seq) for n in (lo, hi)]
    rows[precision] = (t[0], t[1], (t[1] - t[0]) / (hi - lo))
  cfg = models.LlamaConfig.preset(args.preset)
  unit = args.batch * args.seq * cfg.hidden_size * 2
  print(f'{jax.devices()[0].device_kind}, jax {jax.__version__},'
        f' {args.preset}, batch {args.batch} x {args.seq}')
  print(f'| mode | temp, {lo} layers | temp, {hi} layers | per layer |'
        ' per layer (U) | per layer vs bf16 |')
  print('|---|---|---|---|---|---|')
  for precision, (a, b, per) in rows.items():
    print(f'| {precision} | {a / 2**20:.1f} MiB | {b / 2**20:.1f} MiB |'
          f' {per / 2**20:.1f} MiB | {per / unit:.2f} |'
          f' {per / rows["bf16"][2]:.3f} |')


if __name__ == '__main__':
  main()
