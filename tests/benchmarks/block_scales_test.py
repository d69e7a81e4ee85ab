"""benchmarks/block_scales.py: the scale switch, the capture and the error
bookkeeping it reports (the figures themselves: RESULTS.md)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import block_scales
from coat_jax.nn.linear import fp8_dense


def _normal(seed, shape):
  return np.random.default_rng(seed).standard_normal(shape).astype(
      np.float32)


def test_power_of_two_scales_cost_the_exact_tile_max():
  # Float32 scales map each tile's max onto fp8_max exactly; powers of two
  # land it anywhere in [fp8_max / 2, fp8_max]: the error grows (most where
  # a few elements hold most of a tile's energy, as here down the columns
  # of rows of different magnitudes), by less than the 2x of a binade.
  # In E4M3, tiles beat one tensor scale there (E5M2's range absorbs the
  # rows' spread either way).
  t = _normal(0, (256, 384)) * np.exp(_normal(1, (256, 1)) * 2)
  for operand in block_scales.OPERANDS:
    errs = block_scales.operand_errors(t, operand)
    rel = {k: np.sqrt(e / s) for k, (e, s) in errs.items()}
    ratio = rel['block pow2'] / rel['block f32']
    print(operand, {k: f'{v:.4f}' for k, v in rel.items()})
    assert 1.0 < ratio < 2.0, (operand, rel)
    assert 0.01 < rel['block f32'] < 0.1, (operand, rel)
    if operand == 'x':
      assert rel['block f32'] < 0.95 * rel['tensor'], (operand, rel)


def test_layers_switch_scales_and_hand_over_their_operands():
  x = jnp.asarray(_normal(2, (256, 128)), jnp.bfloat16)
  w = jnp.asarray(_normal(3, (128, 256)) * 0.05)

  def loss(x, w):
    (y,) = fp8_dense(x, [w], scaling='block', implementation='xla')
    return jnp.sum(y.astype(jnp.float32) ** 2)

  grads = {}
  for pow2 in (False, True):
    captured = {operand: [] for operand in block_scales.OPERANDS}
    with block_scales.block_quantizers(pow2, captured):
      grads[pow2] = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
      jax.effects_barrier()
    assert [len(captured[k]) for k in ('x', 'g', 'W')] == [1, 1, 1]
    np.testing.assert_array_equal(captured['x'][0], np.float32(x))
    np.testing.assert_array_equal(captured['W'][0], np.float32(w))
  exact = jax.grad(lambda x, w: jnp.sum((x.astype(jnp.float32) @ w) ** 2),
                   argnums=(0, 1))(x, w)

  def cos(a, b):
    a, b = np.float32(a).ravel(), np.float32(b).ravel()
    return np.vdot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b))

  for a, b, want in zip(grads[False], grads[True], exact):
    assert not np.array_equal(np.float32(a), np.float32(b))
    assert cos(a, want) > 0.99 and cos(b, want) > 0.99


@pytest.mark.slow
def test_tiny_run_reports_both_measures():
  got = block_scales.main(['--layers', '1', '--batch', '1', '--seq', '128',
                           '--batches', '1', '--train-steps', '2'])
  for operand, rel in got['quantization'].items():
    assert rel['block f32'] <= rel['block pow2'] < 2 * rel['block f32'], (
        operand, rel)
  grad = got['gradient']
  assert set(grad) == {'bf16', 'tensor', 'block f32', 'block pow2'}
  # BF16 sets the floor; FP8 GEMMs stay close to the float32 gradient.
  for name in ('tensor', 'block f32', 'block pow2'):
    cos, err = grad[name]
    assert grad['bf16'][1] < err < 0.1 and cos > 0.99, (name, grad)
