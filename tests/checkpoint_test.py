"""Orbax round trips of the FP8 optimizer state, and refusal of mismatches."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import coat_jax
from coat_jax import checkpoint


def _setup():
  params = {'w': jax.random.normal(jax.random.key(0), (8, 256)),
            'b': jnp.zeros(5)}
  tx = coat_jax.coat_adamw(1e-2, weight_decay=0.1)

  @jax.jit
  def step(params, state, i):
    grads = jax.tree.map(
        lambda p: jax.random.normal(jax.random.fold_in(jax.random.key(1), i),
                                    p.shape), params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return params, tx.init(params), step


def _assert_bitwise_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(np.atleast_1d(x).view(np.uint8),
                                  np.atleast_1d(y).view(np.uint8))


def test_save_restore_continue_is_bit_exact(tmp_path):
  params, state, step = _setup()
  for i in range(3):
    params, state = step(params, state, i)
  checkpoint.save(tmp_path / 'ckpt', {'params': params, 'opt': state})
  restored = checkpoint.restore(tmp_path / 'ckpt',
                                {'params': params, 'opt': state})
  _assert_bitwise_equal(restored, {'params': params, 'opt': state})
  assert restored['opt'][0].mu['w'].values.dtype == jnp.float8_e4m3fn
  p1, s1 = params, state
  p2, s2 = restored['params'], restored['opt']
  for i in range(3, 6):
    p1, s1 = step(p1, s1, i)
    p2, s2 = step(p2, s2, i)
  _assert_bitwise_equal((p1, s1), (p2, s2))


def test_restore_onto_another_sharding(tmp_path):
  params, state, step = _setup()
  params, state = step(params, state, 0)
  checkpoint.save(tmp_path / 'ckpt', state)
  mesh = jax.make_mesh((4,), ('x',), devices=jax.devices()[:4])
  spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('x'))
  template = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                     sharding=spec if x.ndim == 2 else None),
      state)
  restored = checkpoint.restore(tmp_path / 'ckpt', template)
  assert restored[0].mu['w'].values.sharding == spec
  _assert_bitwise_equal(restored, state)


def test_mismatched_template_is_refused(tmp_path):
  params, state, _ = _setup()
  checkpoint.save(tmp_path / 'ckpt', {'params': params, 'opt': state})
  wrong_dtype = {'params': jax.tree.map(lambda x: x.astype(jnp.bfloat16),
                                        params), 'opt': state}
  with pytest.raises(ValueError, match=r'params/w: checkpoint has float32'
                     r'\[8, 256\], template has bfloat16\[8, 256\]'):
    checkpoint.restore(tmp_path / 'ckpt', wrong_dtype)
  # FP8 moments restored into an FP32-moment optimizer's state: refused.
  fp32_state = coat_jax.coat_adamw(
      1e-2, moment_dtypes=('float32', 'float32')).init(params)
  with pytest.raises(ValueError, match='values: in the checkpoint, not in'):
    checkpoint.restore(tmp_path / 'ckpt',
                       {'params': params, 'opt': fp32_state})
  with pytest.raises(FileNotFoundError, match='No checkpoint'):
    checkpoint.restore(tmp_path / 'missing', params)
