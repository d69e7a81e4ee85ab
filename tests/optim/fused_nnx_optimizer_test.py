"""FusedCoatAdamW: nnx.Optimizer's coat_adamw state, stepped by the fused
pass, against nnx.Optimizer(model, chain(clip, coat_adamw)) itself."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import coat_jax

KW = dict(learning_rate=optax.linear_schedule(1e-2, 1e-3, 5), b2=0.95,
          weight_decay=0.1, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1,
                                                        p))


class MLP(nnx.Module):
  """Two linears with biases and a norm: matrices, vectors, odd sizes."""

  def __init__(self, rngs):
    self.up = nnx.Linear(48, 256, rngs=rngs)
    self.norm = nnx.RMSNorm(256, rngs=rngs)
    self.down = nnx.Linear(256, 40, rngs=rngs)

  def __call__(self, x):
    return self.down(jax.nn.gelu(self.norm(self.up(x))))


def _batch(i, scale):
  k1, k2 = jax.random.split(jax.random.fold_in(jax.random.key(3), i))
  return (jax.random.normal(k1, (16, 48)),
          scale * jax.random.normal(k2, (16, 40)))


def _loss(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


def _train(optimizer_of, steps, scale, implementation=None):
  model = MLP(nnx.Rngs(0))
  optimizer = optimizer_of(model)

  @nnx.jit(donate_argnums=(0, 1))
  def step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(_loss)(model, x, y)
    optimizer.update(model, grads)
    return loss, optax.tree.norm(grads)

  norms = []
  for i in range(steps):
    _, norm = step(model, optimizer, *_batch(i, scale))
    norms.append(float(norm))
  return model, optimizer, norms


@pytest.mark.parametrize('clip_norm,scale', [(None, 1.0), (10.0, 1.0),
                                             (0.05, 30.0)])
@pytest.mark.parametrize('implementation', ['xla', 'pallas'])
def test_fused_optimizer_steps_as_nnx_optimizer(clip_norm, scale,
                                                implementation):
  """Same params (float rounding of the fused arithmetic), same state tree
  and step, with the clip inactive, active at every step, or absent."""
  def reference(model):
    tx = coat_jax.coat_adamw(**KW, implementation=implementation)
    if clip_norm is not None:
      tx = optax.chain(optax.clip_by_global_norm(clip_norm), tx)
    return nnx.Optimizer(model, tx, wrt=nnx.Param)

  fused = lambda model: coat_jax.FusedCoatAdamW(
      model, **KW, clip_norm=clip_norm, implementation=implementation)
  model_ref, opt_ref, norms = _train(reference, 4, scale)
  model, opt, _ = _train(fused, 4, scale)
  if clip_norm == 0.05:
    assert min(norms) > 0.05  # every step clipped
  elif clip_norm == 10.0:
    assert max(norms) < 10.0  # no step clipped
  got, want = nnx.state(model, nnx.Param), nnx.state(model_ref, nnx.Param)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                               atol=1e-6)
  start = nnx.state(MLP(nnx.Rngs(0)), nnx.Param)
  moved = [float(jnp.max(jnp.abs(a - b))) for a, b in
           zip(jax.tree.leaves(got), jax.tree.leaves(start))]
  assert min(moved) > 1e-4  # every param stepped
  s, s_ref = nnx.state(opt), nnx.state(opt_ref)
  assert jax.tree.structure(s) == jax.tree.structure(s_ref)
  assert int(opt.step[...]) == int(opt_ref.step[...]) == 4
  codes = [np.mean(np.asarray(a) == np.asarray(b))
           for a, b in zip(jax.tree.leaves(s), jax.tree.leaves(s_ref))
           if a.dtype == jnp.float8_e4m3fn]
  assert codes and min(codes) > 0.99  # FP8 moments: flips at ties only


def test_fused_optimizer_state_restores_into_nnx_optimizer():
  """Its state is nnx.Optimizer's: one loads into the other and the next
  step of each agrees."""
  model, opt, _ = _train(lambda m: coat_jax.FusedCoatAdamW(
      m, **KW, clip_norm=1.0), 2, 1.0)
  tx = optax.chain(optax.clip_by_global_norm(1.0), coat_jax.coat_adamw(**KW))
  other = nnx.Optimizer(model, tx, wrt=nnx.Param)
  nnx.update(other, nnx.state(opt))
  twin = nnx.clone(model)
  x, y = _batch(5, 1.0)
  opt.update(model, nnx.grad(_loss)(model, x, y))
  other.update(twin, nnx.grad(_loss)(twin, x, y))
  for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)),
                  jax.tree.leaves(nnx.state(twin, nnx.Param))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                               atol=1e-6)


def test_fused_optimizer_bad_arguments():
  model = MLP(nnx.Rngs(0))
  with pytest.raises(ValueError, match='clip_norm=0.0 must be positive'):
    coat_jax.FusedCoatAdamW(model, 1e-3, clip_norm=0.0)
  opt = coat_jax.FusedCoatAdamW(model, 1e-3)
  grads = nnx.grad(_loss)(model, *_batch(0, 1.0))
  with pytest.raises(TypeError, match='takes no keyword arguments'):
    opt.update(model, grads, value=1.0)
