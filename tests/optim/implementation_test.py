"""coat_adamw(implementation=...): the Pallas kernel trains like the
reference (interpreted on CPU, compiled with approximate lg2/ex2 on a GPU),
and a resumed run is bit-exact on the same implementation."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import coat_jax
from coat_jax import checkpoint


def _problem(width=256):
  k = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(k[0], (64, 32))
  y = jnp.tanh(x @ jax.random.normal(k[1], (32, 8)) / 6)
  params = {'w1': jax.random.normal(k[2], (32, width)) * 0.1,
            'b1': jnp.zeros(width),
            'w2': jax.random.normal(k[3], (8, width)) * 0.05}
  loss = lambda p: jnp.mean(
      (jnp.tanh(x @ p['w1'] + p['b1']) @ p['w2'].T - y) ** 2)
  return params, loss


def _trainer(implementation, loss):
  tx = optax.chain(optax.clip_by_global_norm(1.0), coat_jax.coat_adamw(
      3e-3, weight_decay=0.01, implementation=implementation))

  @jax.jit
  def step(params, state):
    value, grads = jax.value_and_grad(loss)(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value

  return tx, step


def _curve(implementation, steps, width=256):
  params, loss = _problem(width)
  tx, step = _trainer(implementation, loss)
  state = tx.init(params)
  losses = []
  for _ in range(steps):
    params, state, value = step(params, state)
    losses.append(float(value))
  return np.array(losses)


def test_interpreted_kernel_trains_like_the_reference():
  ref, ours = _curve('xla', 12), _curve('pallas', 12)
  assert ref[-1] < 0.8 * ref[0]
  # The interpreted kernel runs the reference's ops: equal up to FMA
  # contraction (an FP8 code step in rare elements).
  np.testing.assert_allclose(ours, ref, rtol=1e-4)


def _resume_is_bit_exact(implementation, tmp_path, steps=3):
  params, loss = _problem()
  tx, step = _trainer(implementation, loss)
  state = tx.init(params)
  for _ in range(steps):
    params, state, _ = step(params, state)
  checkpoint.save(tmp_path / 'ckpt', (params, state))
  p2, s2 = checkpoint.restore(tmp_path / 'ckpt', (params, state))
  for _ in range(steps):
    params, state, _ = step(params, state)
    p2, s2, _ = step(p2, s2)
  for a, b in zip(jax.tree.leaves((params, state)), jax.tree.leaves((p2, s2))):
    np.testing.assert_array_equal(
        np.atleast_1d(np.asarray(a)).view(np.uint8),
        np.atleast_1d(np.asarray(b)).view(np.uint8))


def test_resume_is_bit_exact_interpreted(tmp_path):
  _resume_is_bit_exact('pallas', tmp_path)


@pytest.mark.gpu
def test_gpu_kernel_trains_like_the_reference():
  """Approximate lg2/ex2 in the compiled kernel: over 200 steps the loss
  curve stays within 1% of the reference's loss drop at every step (the
  losses end ~500x below where they start, so a relative tolerance on the
  last ones would measure noise: on an H200 they ended 0.0043 and 0.0037
  from 2.21)."""
  ref, ours = _curve('xla', 200, 4096), _curve('pallas', 200, 4096)
  print(f'\nloss {ref[0]:.5f} -> xla {ref[-1]:.6f}, kernel {ours[-1]:.6f}')
  assert ref[-1] < 0.5 * ref[0]
  drop = ref[0] - ref[-1]
  np.testing.assert_array_less(np.abs(np.asarray(ours) - np.asarray(ref)),
                               0.01 * drop)


@pytest.mark.gpu
@pytest.mark.parametrize('implementation', ['xla', None])
def test_gpu_resume_is_bit_exact(implementation, tmp_path):
  _resume_is_bit_exact(implementation, tmp_path)
