"""Block scales as float32 or as powers of two: what each costs in accuracy.

`quantize_blockwise` offers power-of-two scales (`pow2_scales=True`:
2^ceil(log2(amax / fp8_max)), exact to divide by, one byte of exponent
each) beside float32 ones (amax / fp8_max, which the layers use). This
measures both where they matter, on the 125m model with `scaling='block'`
and the stdlib corpus (optionally after some bf16 training steps, so the
weights are not the random init):

  1. the relative quantization error ||dequantize(q(t)) - t|| / ||t|| of
     every operand the block-scaled layers quantize in a train step,
     captured as they run: inputs x (1x128 tiles, and x^T tiled along the
     tokens), output gradients g (1x128 tiles, g^T in 128x128 blocks) and
     weights W (128x128 blocks), with per-tensor scaling beside them;
  2. the whole gradient against the float32 model's at the same params
     (matmuls at 'highest' precision): cosine and relative error, for block
     scaling with either scale, per-tensor scaling and plain bf16 (the
     floor that BF16 itself sets).

  PYTHONPATH=. python benchmarks/block_scales.py --train-steps 300 \
      --batch 8 --seq 512 --batches 8 --lr 1e-3

(RESULTS.md "quantize-blockwise"; the defaults are a quick CPU run.)
"""

import argparse
import contextlib
import functools
import hashlib
import time
from unittest import mock

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from coat_jax import quant
import coat_jax.models as cm
from coat_jax.training import DataConfig
from coat_jax.training.data import load_dataset
from pallas_kernels.quantize_blockwise import api as block_api

# Operand -> (dtype, layout of the GEMM's other copy: None, 'tiles' along
# the tokens, or 'blocks' of the transpose), as `coat_jax.nn.linear` runs
# block scaling.
OPERANDS = {'x': ('e4m3', 'tiles'), 'g': ('e5m2', 'blocks'),
            'W': ('e4m3', None)}


@contextlib.contextmanager
def block_quantizers(pow2: bool, capture: dict | None = None):
  """Within: the layers' block quantizers use power-of-two scales if `pow2`,
  and (if `capture` is a dict) hand each input to `capture[operand]` (a
  list of float32 numpy arrays, deduplicated), as the step runs."""
  original = block_api.quantize_blockwise
  original_parts = block_api.quantize_blockwise_parts
  seen = set()

  def record(operand, t):
    t = np.asarray(t, np.float32)
    digest = hashlib.sha1(t.tobytes()).hexdigest()
    if digest not in seen:
      seen.add(digest)
      capture[operand].append(t.reshape(-1, t.shape[-1]))

  def tap(operand, t):
    if capture is not None:
      jax.debug.callback(functools.partial(record, operand), t)

  def quantize(x, block=(1, 128), dtype='e4m3', **kw):
    operand = 'W' if tuple(block) == (128, 128) else (
        'g' if jnp.dtype(quant.fp8_dtype(dtype)) == jnp.float8_e5m2 else 'x')
    tap(operand, x)
    return original(x, block, dtype, **{**kw, 'pow2_scales': pow2})

  def quantize_parts(parts, dtype='e4m3', **kw):
    tap('g', jnp.concatenate(parts, axis=1))
    return original_parts(parts, dtype, **{**kw, 'pow2_scales': pow2})

  with mock.patch.object(block_api, 'quantize_blockwise', quantize), \
      mock.patch.object(block_api, 'quantize_blockwise_parts',
                        quantize_parts):
    yield


def _error(t, q) -> tuple[float, float]:
  """(sum of squared error, sum of squares) of q's dequantization against t."""
  d = np.asarray(quant.dequantize(q, jnp.float32), np.float64)
  t = np.asarray(t, np.float64).reshape(d.shape)
  return float(((d - t) ** 2).sum()), float((t ** 2).sum())


def operand_errors(t: np.ndarray, operand: str) -> dict[str, tuple]:
  """Squared-error sums of one captured 2-D operand, per scaling: the
  GEMM's own layout and its other copy (x^T, g^T) together."""
  dtype, other = OPERANDS[operand]
  sums = {'tensor': _error(t, quant.quantize_per_tensor(t, dtype))}
  for name, pow2 in (('block f32', False), ('block pow2', True)):
    if other is None:  # weights: one set of blocks serves W and W^T
      qs = [quant.quantize_blockwise(t, (128, 128), dtype, pow2_scales=pow2)]
      ts = [t]
    else:
      qs = quant.quantize_blockwise(
          t, (1, 128), dtype, transpose=True, pow2_scales=pow2,
          transpose_block=(128, 128) if other == 'blocks' else (1, 128))
      ts = [t, t.T]
    errs = [_error(a, q) for a, q in zip(ts, qs)]
    sums[name] = tuple(map(sum, zip(*errs)))
  if other is not None:  # per-tensor: x^T has the same error as x
    sums['tensor'] = tuple(2 * s for s in sums['tensor'])
  return sums


def _flat(tree) -> np.ndarray:
  return np.concatenate(
      [np.asarray(g, np.float64).ravel() for g in jax.tree.leaves(tree)])


def _cos(a, b) -> float:
  return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def compiled_gradient(cfg, precision, scaling, state, tokens, targets,
                      dtype=jnp.bfloat16):
  """(loss, grads) of the model at `state` (the bf16 model's), compiled now:
  it runs the block quantizers in force now, whenever it is called. A
  float32 model (the reference) runs its matmuls at 'highest' precision;
  the others as they train."""
  model = cm.Llama(cfg, precision=precision, scaling=scaling, dtype=dtype,
                   rngs=nnx.Rngs(0))
  graph, _ = nnx.split(model)
  loss_fn = lambda s, x, y: cm.lm_loss(nnx.merge(graph, s), x, y)
  with jax.default_matmul_precision(
      'highest' if dtype == jnp.float32 else None):
    return jax.jit(jax.value_and_grad(loss_fn)).lower(
        state, tokens, targets).compile()


def train_bf16(cfg, data, steps, batch, seq, lr):
  """The bf16 model's state after `steps` adamw steps (0: the init)."""
  model = cm.Llama(cfg, precision='bf16', rngs=nnx.Rngs(0))
  graph, state = nnx.split(model)
  if not steps:
    return state
  tx = optax.adamw(optax.warmup_cosine_decay_schedule(
      0.0, lr, max(steps // 10, 1), steps, lr / 10))

  @jax.jit
  def step(state, opt, tokens, targets):
    loss_fn = lambda s: cm.lm_loss(nnx.merge(graph, s), tokens, targets)
    loss, grads = jax.value_and_grad(loss_fn)(state)
    updates, opt = tx.update(grads, opt, state)
    return optax.apply_updates(state, updates), opt, loss

  opt = tx.init(state)
  for i in range(steps):
    tokens, targets = data.batch('train', 0, i, batch, seq)
    state, opt, loss = step(state, opt, tokens, targets)
    if i % max(steps // 5, 1) == 0 or i == steps - 1:
      print(f'bf16 training step {i}: loss {float(loss):.4f}', flush=True)
  return state


def main(argv=None) -> dict:
  """Prints both tables; returns {'quantization': {operand: {scaling:
  relative error}}, 'gradient': {model: (mean cosine, mean relative
  error)}}."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--layers', type=int, default=12,
                      help='decoder layers of the 125m config')
  parser.add_argument('--batch', type=int, default=2)
  parser.add_argument('--seq', type=int, default=256)
  parser.add_argument('--batches', type=int, default=2,
                      help='validation batches the gradient is taken on')
  parser.add_argument('--train-steps', type=int, default=0,
                      help='bf16 adamw steps before measuring (batch 16)')
  parser.add_argument('--lr', type=float, default=1e-3)
  args = parser.parse_args(argv)
  cfg = cm.LlamaConfig.preset('125m', num_layers=args.layers)
  data = load_dataset(DataConfig(seq_len=args.seq), cfg.vocab_size)
  print(f'jax {jax.__version__} on {jax.devices()[0].device_kind};'
        f' 125m, {args.layers} layers, {args.batches} val batches of'
        f' {args.batch} x {args.seq} tokens, after {args.train_steps} bf16'
        ' training steps', flush=True)
  start = time.perf_counter()
  state = train_bf16(cfg, data, args.train_steps, 16, args.seq, args.lr)

  batches = [data.batch('val', 0, i, args.batch, args.seq)
             for i in range(args.batches)]
  # name: (precision, scaling, power-of-two block scales)
  variants = {'float32': ('bf16', 'tensor', False),
              'bf16': ('bf16', 'tensor', False),
              'tensor': ('coat', 'tensor', False),
              'block f32': ('coat', 'block', False),
              'block pow2': ('coat', 'block', True)}
  steps = {}
  for name, (precision, scaling, pow2) in variants.items():
    with block_quantizers(pow2):
      steps[name] = compiled_gradient(
          cfg, precision, scaling, state, *batches[0],
          dtype=jnp.float32 if name == 'float32' else jnp.bfloat16)
  captured = {operand: [] for operand in OPERANDS}
  with block_quantizers(False, captured):
    capture = compiled_gradient(cfg, 'coat', 'block', state, *batches[0])
  capture(state, *batches[0])
  jax.effects_barrier()

  cos = {name: [] for name in variants if name != 'float32'}
  error = {name: [] for name in cos}
  losses = {name: [] for name in variants}
  for tokens, targets in batches:
    grads = {}
    for name, step in steps.items():
      loss, g = step(state, tokens, targets)
      losses[name].append(float(loss))
      grads[name] = _flat(g)
    truth = grads['float32']
    for name in cos:
      cos[name].append(_cos(grads[name], truth))
      error[name].append(np.linalg.norm(grads[name] - truth)
                         / np.linalg.norm(truth))

  print('\nrelative quantization error ||dequantize(q(t)) - t|| / ||t||'
        ' over every captured operand (both copies a GEMM reads):')
  quantization = {}
  print('| operand | tensors | per-tensor | block f32 | block pow2 |'
        ' pow2 / f32 |')
  print('|---|---|---|---|---|---|')
  for operand, tensors in captured.items():
    sums = [operand_errors(t, operand) for t in tensors]
    rel = {name: np.sqrt(sum(s[name][0] for s in sums)
                         / sum(s[name][1] for s in sums))
           for name in ('tensor', 'block f32', 'block pow2')}
    quantization[operand] = rel
    print(f'| {operand} ({OPERANDS[operand][0]}) | {len(tensors)} |'
          f' {rel["tensor"]:.4f} | {rel["block f32"]:.4f} |'
          f' {rel["block pow2"]:.4f} |'
          f' {rel["block pow2"] / rel["block f32"]:.3f} |')
  print('\nthe gradient against the float32 model\'s, over the validation'
        ' batches: cosine and ||g - g_f32|| / ||g_f32|| (mean, and the worst'
        ' batch), mean loss:')
  print('| model | cosine | relative error | loss |')
  print('|---|---|---|---|')
  print(f'| float32 | 1 | 0 | {np.mean(losses["float32"]):.5f} |')
  for name in cos:
    label = name if name == 'bf16' else f'coat, {name}'
    print(f'| {label} | {np.mean(cos[name]):.5f} ({min(cos[name]):.5f}) |'
          f' {np.mean(error[name]):.4f} ({max(error[name]):.4f}) |'
          f' {np.mean(losses[name]):.5f} |')
  print(f'({time.perf_counter() - start:.0f} s)')
  return {'quantization': quantization,
          'gradient': {name: (np.mean(cos[name]), np.mean(error[name]))
                       for name in cos}}


if __name__ == '__main__':
  main()
