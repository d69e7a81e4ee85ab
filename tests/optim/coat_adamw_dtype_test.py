"""coat_adamw returns updates in the dtypes optax.adamw returns: the
gradient's promoted with the param's (bf16 params and grads: bf16)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import coat_jax

SEED = 69


def _tree(dtype, seed):
  k = jax.random.split(jax.random.key(seed), 2)
  return {'kernel': (jax.random.normal(k[0], (16, 256)) * 0.1).astype(dtype),
          'bias': jax.random.normal(k[1], (256,)).astype(dtype)}


@pytest.mark.parametrize('moments', [('e4m3', 'e4m3'), ('float32',) * 2])
@pytest.mark.parametrize('param_dtype,grad_dtype', [
    (jnp.bfloat16, jnp.bfloat16), (jnp.bfloat16, jnp.float32),
    (jnp.float32, jnp.bfloat16), (jnp.float32, jnp.float32),
    (jnp.float16, jnp.float16)])
def test_update_dtypes_match_optax_adamw(param_dtype, grad_dtype, moments):
  params = _tree(param_dtype, SEED)
  grads = _tree(grad_dtype, SEED + 1)
  mask = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)
  args = dict(learning_rate=1e-2, weight_decay=0.1, mask=mask)
  tx = coat_jax.coat_adamw(**args, moment_dtypes=moments)
  reference = optax.adamw(**args)
  state, ref_state = tx.init(params), reference.init(params)
  for _ in range(2):
    updates, state = jax.jit(tx.update)(grads, state, params)
    want, ref_state = jax.jit(reference.update)(grads, ref_state, params)
    assert jax.tree.map(lambda x: x.dtype, updates) == jax.tree.map(
        lambda x: x.dtype, want)
  if moments == ('float32',) * 2 and param_dtype == grad_dtype == (
      jnp.float32):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
                 updates, want)


def test_bf16_params_step_in_bf16():
  params = _tree(jnp.bfloat16, SEED)
  tx = coat_jax.coat_adamw(1e-2)
  updates, _ = tx.update(_tree(jnp.bfloat16, SEED + 1), tx.init(params),
                         params)
  new = optax.apply_updates(params, updates)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(updates))
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(new))
