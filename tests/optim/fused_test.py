"""fused_coat_adamw equals coat_adamw + optax.apply_updates."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import coat_jax


def _params():
  k = jax.random.split(jax.random.key(0), 3)
  return {'w': jax.random.normal(k[0], (16, 256)) * 0.1,
          'b': jnp.zeros(40), 'norm': jnp.ones(128)}


def _grads(params, i):
  return jax.tree.map(
      lambda p: jax.random.t(jax.random.fold_in(jax.random.key(1), i), 3.0,
                             p.shape), params)


@pytest.mark.parametrize('implementation', ['xla', 'pallas'])
def test_fused_matches_optax_path(implementation):
  kw = dict(learning_rate=optax.linear_schedule(1e-2, 1e-3, 5),
            weight_decay=0.1, mask={'w': True, 'b': False, 'norm': False})
  tx = coat_jax.coat_adamw(**kw)
  apply = coat_jax.optim.fused_coat_adamw(**kw, implementation=implementation)
  params = _params()
  state_ref = state = tx.init(params)
  p_ref = p = params
  step_ref = jax.jit(lambda p, s, g: (
      lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g, s, p)))
  for i in range(3):
    g = _grads(params, i)
    p_ref, state_ref = step_ref(p_ref, state_ref, g)
    p, state = jax.jit(apply)(g, state, p)
  for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(p_ref)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6,
                               atol=1e-7)
  mu, mu_ref = state[0].mu['w'], state_ref[0].mu['w']
  codes = np.asarray(mu.values).astype(np.float32)
  codes_ref = np.asarray(mu_ref.values).astype(np.float32)
  assert np.mean(codes == codes_ref) > 0.999  # one-step flips at ties only
  assert int(state[0].count) == 3 and int(state[2].count) == 3


def test_fused_needs_fp8_moments_and_its_own_state():
  params = _params()
  apply = coat_jax.optim.fused_coat_adamw(1e-3)
  fp32 = coat_jax.coat_adamw(1e-3, moment_dtypes=('float32', 'float32'))
  with pytest.raises(ValueError, match='FP8 moments'):
    apply(params, fp32.init(params), params)
  with pytest.raises(TypeError, match='coat_adamw'):
    apply(params, optax.adamw(1e-3).init(params), params)
