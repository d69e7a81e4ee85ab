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


@pytest.mark.parametrize('implementation', ['xla', 'pallas'])
def test_grad_scale_is_global_norm_clipping(implementation):
  # train.py folds clip_by_global_norm into the pass as a gradient scale.
  max_norm = 1.0
  kw = dict(learning_rate=1e-2, weight_decay=0.1)
  tx = optax.chain(optax.clip_by_global_norm(max_norm),
                   coat_jax.coat_adamw(**kw))
  apply = coat_jax.optim.fused_coat_adamw(**kw, implementation=implementation)
  params = _params()
  state_ref = tx.init(params)
  state = state_ref[1]
  p_ref = p = params
  for i in range(3):
    g = _grads(params, i)  # norm ~ 80: every step clips
    norm = optax.tree.norm(g)
    assert norm > 10 * max_norm
    u, state_ref = tx.update(g, state_ref, p_ref)
    p_ref = optax.apply_updates(p_ref, u)
    p, state = jax.jit(apply)(g, state, p, True, max_norm / norm)
  for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(p_ref)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                               atol=1e-6)
  unclipped = params
  s = tx.init(params)[1]
  for i in range(3):
    unclipped, s = apply(_grads(params, i), s, unclipped)
  assert not np.allclose(np.asarray(unclipped['w']), np.asarray(p['w']),
                         atol=1e-4)  # the scale changed the step


def test_fused_needs_fp8_moments_and_its_own_state():
  params = _params()
  apply = coat_jax.optim.fused_coat_adamw(1e-3)
  fp32 = coat_jax.coat_adamw(1e-3, moment_dtypes=('float32', 'float32'))
  with pytest.raises(ValueError, match='FP8 moments'):
    apply(params, fp32.init(params), params)
  with pytest.raises(TypeError, match='coat_adamw'):
    apply(params, optax.adamw(1e-3).init(params), params)


@pytest.mark.parametrize('implementation', ['xla', 'pallas'])
def test_apply_if_false_skips_the_step(implementation):
  kw = dict(learning_rate=optax.linear_schedule(1e-2, 1e-3, 5),
            weight_decay=0.1)
  apply = jax.jit(coat_jax.optim.fused_coat_adamw(
      **kw, implementation=implementation))
  params = _params()
  state = coat_jax.coat_adamw(**kw).init(params)
  p, state = apply(_grads(params, 0), state, params)
  bad = jax.tree.map(lambda g: g.at[0].set(jnp.nan), _grads(params, 1))
  p2, state2 = apply(bad, state, p, jnp.bool_(False))
  for a, b in zip(jax.tree.leaves((p2, state2)), jax.tree.leaves((p, state))):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a, np.float32),
                                  np.asarray(b, np.float32))
  assert int(state2[0].count) == 1 and int(state2[2].count) == 1
  p3, state3 = apply(_grads(params, 1), state, p, jnp.bool_(True))
  assert int(state3[0].count) == 2 and int(state3[2].count) == 2
  assert not np.array_equal(np.asarray(p3['w']), np.asarray(p['w']))


@pytest.mark.parametrize('implementation', ['xla', 'pallas'])
def test_per_layer_gradients_step_like_the_stacked_one(implementation, seed):
  """A stacked leaf (L, ...) given a tuple of its L layers' gradients takes
  the stacked step: the Pallas kernel layer by layer in place, XLA's version
  on the gradients stacked first (stepping one layer at a time there
  rewrote the whole stack per layer: a transposed float32 copy of it, +9.5
  GiB per device at 1b under data parallelism)."""
  kw = dict(learning_rate=1e-2, weight_decay=0.1)
  apply = coat_jax.optim.fused_coat_adamw(**kw, implementation=implementation)
  params = {'w': jax.random.normal(jax.random.key(seed), (3, 16, 256)) * 0.1}
  state = coat_jax.coat_adamw(**kw).init(params)
  g = _grads(params, 0)
  per_layer = {'w': tuple(g['w'])}
  want = jax.jit(apply)(g, state, params)
  got = jax.jit(apply)(per_layer, state, params)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a, np.float32),
                                  np.asarray(b, np.float32))
  if implementation == 'xla':  # no layer written into the stack
    text = str(jax.make_jaxpr(apply)(per_layer, state, params))
    assert 'dynamic_update_slice' not in text and 'scatter' not in text


@pytest.mark.parametrize('implementation', ['xla', 'pallas'])
def test_xla_steps_one_leaf_after_another(implementation):
  """XLA's version takes each leaf's step behind one optimization barrier
  that also holds the previous leaf's results: no moment is decoded before
  its gradient exists and one leaf's temporaries live at a time (Llama-2-7B,
  FSDP on 4 H200s, compiled: the step's temp 13.24 -> 12.68 GiB per
  device, XLA had decoded moments into byte masks during backward). The
  kernel steps in place and needs none. Same results either way."""
  kw = dict(learning_rate=1e-2, weight_decay=0.1)
  apply = coat_jax.optim.fused_coat_adamw(**kw, implementation=implementation)
  params = _params()
  state = coat_jax.coat_adamw(**kw).init(params)
  grads = _grads(params, 0)
  text = str(jax.make_jaxpr(apply)(grads, state, params))
  assert text.count('optimization_barrier') == (
      len(params) if implementation == 'xla' else 0)
  want = jax.jit(coat_jax.optim.fused_coat_adamw(
      **kw, implementation='pallas'))(grads, state, params)
  got = jax.jit(apply)(grads, state, params)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a, np.float32),
                                  np.asarray(b, np.float32))


def test_specs_step_each_devices_shard_as_the_whole_arrays(seed):
  """With the params' specs under a mesh of several devices, each leaf whose
  shards keep the moments' groups whole takes the Pallas step inside
  shard_map, per device (what several GPUs run): elementwise within a group,
  so the results are the kernel's on the whole arrays (to float rounding
  here: XLA:CPU compiles the interpreted kernel per shape, and a few
  elements of a (3, 4, 256) slice came out 1 ulp from the (3, 16, 256)
  array's, without any mesh). atol: where a param ends near zero, a 1-ulp
  difference in its update (lr 1e-2: ~6e-10) is a large relative one (CI
  once saw 5.7e-6 at -4.25e-5); a wrong shard differs by far more."""
  from jax.sharding import NamedSharding  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  from coat_jax.training import sharding  # noqa: PLC0415
  mesh = sharding.make_mesh((2, 4, 1))
  keys = jax.random.split(jax.random.key(seed), 6)
  params = {'rows': jax.random.normal(keys[0], (16, 512)),
            'cols': jax.random.normal(keys[1], (4, 1024)),
            'split_groups': jax.random.normal(keys[2], (16, 384)),
            'stack': jax.random.normal(keys[3], (3, 16, 256)),
            'scanned': jax.random.normal(keys[4], (3, 16, 256)),
            'whole': jax.random.normal(keys[5], (40,))}
  specs = {'rows': P('fsdp', None), 'cols': P(None, 'fsdp'),
           'split_groups': P(None, 'fsdp'),  # 96 a device: groups split
           'stack': P(None, ('data', 'fsdp'), None),
           'scanned': P(None, 'fsdp'), 'whole': P()}
  kw = dict(learning_rate=optax.linear_schedule(1e-2, 1e-3, 5),
            weight_decay=0.1, mask={k: k != 'whole' for k in params})
  apply = coat_jax.optim.fused_coat_adamw(**kw, implementation='pallas')
  state = coat_jax.coat_adamw(**kw).init(params)
  p, s = params, state
  for i in range(2):  # the second step reads FP8 moments of the first
    g = _grads(params, i)
    g = {**g, 'stack': tuple(g['stack'])}  # unrolled layers' gradients
    p, s = jax.jit(apply)(g, s, p, jnp.bool_(True), 0.5)
  placed = jax.device_put(
      (params, state), jax.tree.map(
          lambda x: NamedSharding(mesh, P()), (params, state)))
  placed = (jax.tree.map(lambda x, spec: jax.device_put(
      x, NamedSharding(mesh, spec)), placed[0], specs), placed[1])
  sharded = jax.jit(lambda g, s, p: apply(g, s, p, jnp.bool_(True), 0.5,
                                          specs))
  with jax.set_mesh(mesh):
    p2, s2 = placed
    for i in range(2):
      g = _grads(params, i)
      g = {**g, 'stack': tuple(g['stack'])}
      p2, s2 = sharded(g, s2, p2)
    text = str(jax.make_jaxpr(sharded)(g, s2, p2))
  # rows, cols, scanned (one stacked gradient), whole, and the stack's
  # three layers; not split_groups.
  assert text.count('shard_map[') == 7
  for a, b in zip(jax.tree.leaves(p2), jax.tree.leaves(p)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)
  for got, want in ((s2[0].mu, s[0].mu), (s2[0].nu, s[0].nu)):
    for name in params:
      codes, codes_want = (np.asarray(m[name].values, np.float32)
                           for m in (got, want))
      assert np.mean(codes == codes_want) > 0.999, name  # flips at ties
      np.testing.assert_allclose(got[name].scale, want[name].scale,
                                 rtol=1e-6)
  for name, shard in (('rows', (4, 512)), ('cols', (4, 256))):
    assert p2[name].sharding.shard_shape(p2[name].shape) == shard
