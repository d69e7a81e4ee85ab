"""Chunked cross entropy against a full-softmax float32 reference."""

import re
from unittest import mock

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from coat_jax.models.loss import chunked_cross_entropy
from coat_jax.training import sharding


def _reference(hidden, head, targets):
  """Sum of -log softmax over the targets >= 0, in float32 from BF16 inputs."""
  h = hidden.astype(jnp.bfloat16).astype(jnp.float32)
  w = head.astype(jnp.bfloat16).astype(jnp.float32)
  logp = jax.nn.log_softmax(
      jnp.dot(h, w, precision=jax.lax.Precision.HIGHEST), axis=-1)
  picked = jnp.take_along_axis(logp, jnp.maximum(targets, 0)[..., None],
                               -1)[..., 0]
  return -jnp.sum(jnp.where(targets >= 0, picked, 0.0))


def _inputs(seed, batch, seq, width, vocab):
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  hidden = jax.random.normal(k1, (batch, seq, width), jnp.bfloat16)
  head = 0.2 * jax.random.normal(k2, (width, vocab), jnp.float32)
  targets = jax.random.randint(k3, (batch, seq), 0, vocab)
  return hidden, head, targets.at[0, 1].set(-1)  # one ignored target


@pytest.mark.parametrize('chunk_size', (7, 16, 1024))
def test_loss_and_gradients_match_full_softmax(chunk_size, seed):
  hidden, head, targets = _inputs(seed, 2, 13, 32, 300)
  loss_fn = lambda h, w: chunked_cross_entropy(
      h, w, targets, chunk_size=chunk_size)[0]
  (loss, count) = chunked_cross_entropy(hidden, head, targets,
                                        chunk_size=chunk_size)
  ref_fn = lambda h, w: _reference(h, w, targets)
  assert int(count) == 2 * 13 - 1
  np.testing.assert_allclose(loss, ref_fn(hidden, head), rtol=1e-5)
  grads = jax.jit(jax.grad(loss_fn, argnums=(0, 1)))(hidden, head)
  ref_grads = jax.grad(ref_fn, argnums=(0, 1))(
      hidden.astype(jnp.float32), head)
  for g, ref in zip(grads, ref_grads):
    g = np.asarray(g, np.float32)
    ref = np.asarray(ref, np.float32)
    assert np.all(np.isfinite(g))
    # The logits gradient is rounded to BF16 before the backward GEMMs, and
    # dh is BF16 itself: up to 2 BF16 ulps (2^-7 relative) on top.
    np.testing.assert_allclose(g, ref, rtol=2**-7,
                               atol=1e-2 * np.abs(ref).max())
    cos = g.ravel() @ ref.ravel() / np.linalg.norm(g) / np.linalg.norm(ref)
    assert cos > 0.9999
  assert grads[0].dtype == jnp.bfloat16 and grads[1].dtype == jnp.float32
  # The ignored position gets no gradient through the head.
  ignored = np.zeros_like(np.asarray(targets, bool))
  ignored[0, 1] = True
  dh = np.asarray(grads[0], np.float32)
  np.testing.assert_array_equal(dh[ignored], 0.0)


def test_all_targets_ignored(seed):
  hidden, head, _ = _inputs(seed, 1, 5, 16, 40)
  targets = jnp.full((1, 5), -1)
  loss, count = chunked_cross_entropy(hidden, head, targets, chunk_size=2)
  assert float(loss) == 0.0 and float(count) == 0.0
  g = jax.grad(lambda w: chunked_cross_entropy(hidden, w, targets)[0])(head)
  np.testing.assert_array_equal(g, 0.0)


def _dot_input_dtypes(jaxpr):
  """Input dtypes of every dot_general in a jaxpr and its sub-jaxprs."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'dot_general':
      found.append(tuple(v.aval.dtype for v in eqn.invars))
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        inner = getattr(sub, 'jaxpr', sub)
        if hasattr(inner, 'eqns'):
          found += _dot_input_dtypes(inner)
  return found


def test_backward_gemms_run_in_bf16(seed):
  hidden, head, targets = _inputs(seed, 2, 8, 16, 64)
  grad_fn = jax.grad(
      lambda h, w: chunked_cross_entropy(h, w, targets, chunk_size=4)[0],
      argnums=(0, 1))
  dots = _dot_input_dtypes(jax.make_jaxpr(grad_fn)(hidden, head).jaxpr)
  # The chunk's logits, dh and dw, once each: backward recomputes nothing.
  assert len(dots) == 3, dots
  assert all(d == jnp.bfloat16 for pair in dots for d in pair), dots


def test_gradients_scale_with_the_cotangent(seed):
  # The gradients are computed in forward for a cotangent of 1; backward
  # scales them (lm_loss divides by the count, a loss scale multiplies).
  hidden, head, targets = _inputs(seed, 2, 9, 16, 48)
  loss_fn = lambda h, w, c: c * chunked_cross_entropy(
      h, w, targets, chunk_size=4)[0]
  g1 = jax.grad(loss_fn, argnums=(0, 1))(hidden, head, 1.0)
  g3 = jax.grad(loss_fn, argnums=(0, 1))(hidden, head, -0.375)
  np.testing.assert_allclose(np.asarray(g3[1]), -0.375 * np.asarray(g1[1]),
                             rtol=1e-6)
  np.testing.assert_allclose(np.asarray(g3[0], np.float32),
                             -0.375 * np.asarray(g1[0], np.float32),
                             rtol=2**-8)
  # The count has no gradient.
  g_count = jax.grad(lambda w: chunked_cross_entropy(
      hidden, w, targets, chunk_size=4)[1])(head)
  np.testing.assert_array_equal(g_count, 0.0)


def test_a_bf16_head_gets_a_bf16_gradient_rounded_once(seed):
  hidden, head, targets = _inputs(seed, 2, 9, 16, 48)
  head16 = head.astype(jnp.bfloat16)
  loss_fn = lambda w: chunked_cross_entropy(hidden, w, targets,
                                            chunk_size=4)[0] / 17.0
  g16 = jax.grad(loss_fn)(head16)
  g32 = jax.grad(loss_fn)(head16.astype(jnp.float32))
  assert g16.dtype == jnp.bfloat16
  # The float32 gradient (same bf16 values of the head), scaled, then
  # rounded once to bfloat16.
  np.testing.assert_array_equal(np.asarray(g16),
                                np.asarray(g32.astype(jnp.bfloat16)))


@pytest.mark.parametrize('chunk_size', [16, 24])  # 24: each device pads
@pytest.mark.parametrize('shape', [(1, 8, 1), (2, 4, 1), (8, 1, 1)])
def test_batch_sharded_tokens_stay_on_their_devices(shape, chunk_size, seed):
  """Under an FSDP or data-parallel mesh each device runs the chunk loop on
  its own tokens (`jax.shard_map`) with the head gathered whole: the loss,
  dh and dw are one device's up to rounding (GEMM shapes, the order of the
  sum over devices); the loop moves no activations (no all-to-all) and the
  step's only all-reduce follows it. Left to the partitioner, XLA sharded
  the chunks along H and all-reduced each chunk's float32 logits (FSDP) or
  gathered the whole batch on every device (data parallel)."""
  hidden, head, targets = _inputs(seed, 8, 64, 32, 300)
  grad = jax.jit(jax.value_and_grad(
      lambda h, w, t: chunked_cross_entropy(h, w, t,
                                            chunk_size=chunk_size)[0],
      argnums=(0, 1)))
  loss, (dh, dw) = grad(hidden, head, targets)
  mesh = sharding.make_mesh(shape)
  batch = NamedSharding(mesh, P(('data', 'fsdp')))
  args = (jax.device_put(hidden, batch),
          jax.device_put(head, NamedSharding(mesh, P('fsdp'))),
          jax.device_put(targets, batch))
  with jax.set_mesh(mesh):
    hlo = grad.lower(*args).compile().as_text()
    got_loss, (got_dh, got_dw) = grad(*args)
  np.testing.assert_allclose(got_loss, loss, rtol=1e-6)
  # dh: one bf16 ulp apart at most where the GEMMs' shapes (so their sums'
  # order) differ; near zero, float32 cancellation (1e-6 of the largest).
  dh = np.asarray(dh, np.float32)
  np.testing.assert_allclose(np.asarray(got_dh, np.float32), dh, rtol=2**-7,
                             atol=1e-6 * np.abs(dh).max())
  dw = np.asarray(dw)
  np.testing.assert_allclose(got_dw, dw, rtol=1e-5,
                             atol=1e-6 * np.abs(dw).max())
  assert 'all-to-all' not in hlo
  assert hlo.count(' all-reduce(') == 1, hlo
  for body in re.findall(r'body=(%[\w.-]+)', hlo):
    block = hlo[hlo.index(f'\n{body} '):]
    assert ' all-reduce(' not in block[:block.index('\n}')], body


def _fp8_reference(hidden, head, targets, grad_dtype):
  """The FP8 head's math in jnp: E4M3 hidden and head (one current scale
  each), float32 logits; d loss / d logits rounded to grad_dtype with the
  fixed scale 2^-15 (E5M2) or 2^-8 (E4M3). Returns (loss, dh, dw)."""
  from coat_jax import quant  # noqa: PLC0415
  qh = quant.quantize_per_tensor(hidden.reshape(-1, hidden.shape[-1]),
                                 'e4m3')
  qw = quant.quantize_per_tensor(head, 'e4m3')
  h = qh.values.astype(jnp.float32) * qh.scale
  w = qw.values.astype(jnp.float32) * qw.scale
  t = targets.reshape(-1)
  valid = t >= 0
  logits = jnp.dot(h, w, precision=jax.lax.Precision.HIGHEST)
  logp = jax.nn.log_softmax(logits, axis=-1)
  picked = jnp.take_along_axis(logp, jnp.maximum(t, 0)[:, None], -1)[:, 0]
  loss = -jnp.sum(jnp.where(valid, picked, 0.0))
  onehot = jax.nn.one_hot(t, head.shape[1])
  g = jnp.where(valid[:, None], jnp.exp(logp) - onehot, 0.0)
  s = 2.0**-15 if grad_dtype == 'e5m2' else 2.0**-8
  g = jnp.clip(g / s, -1e9, 1e9).astype(
      jnp.float8_e5m2 if grad_dtype == 'e5m2' else jnp.float8_e4m3fn
  ).astype(jnp.float32) * s
  dh = jnp.dot(g, w.T, precision=jax.lax.Precision.HIGHEST)
  dw = jnp.dot(h.T, g, precision=jax.lax.Precision.HIGHEST)
  return loss, dh.reshape(hidden.shape), dw


@pytest.mark.parametrize('grad_dtype', ['e5m2', 'e4m3'])
@pytest.mark.parametrize('chunk_size', (7, 16, 1024))
def test_fp8_head_is_its_reference(grad_dtype, chunk_size, seed):
  """On the CPU an FP8 GEMM is an exact float32 dot of the codes: the loss
  and both gradients are the reference's up to float32 summation order."""
  hidden, head, targets = _inputs(seed, 2, 13, 32, 304)
  fn = lambda h, w: chunked_cross_entropy(
      h, w, targets, chunk_size=chunk_size, fp8_grad_dtype=grad_dtype)[0]
  loss, (dh, dw) = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))(
      hidden, head)
  ref_loss, ref_dh, ref_dw = _fp8_reference(hidden, head, targets,
                                            grad_dtype)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert dh.dtype == hidden.dtype and dw.dtype == head.dtype
  np.testing.assert_allclose(np.asarray(dh, np.float32), ref_dh,
                             rtol=2**-7, atol=1e-3 * np.abs(ref_dh).max())
  np.testing.assert_allclose(dw, ref_dw, rtol=1e-4,
                             atol=1e-5 * np.abs(ref_dw).max())
  ignored = np.zeros(targets.shape, bool)
  ignored[0, 1] = True
  np.testing.assert_array_equal(np.asarray(dh, np.float32)[ignored], 0.0)


@pytest.mark.parametrize('grad_dtype', ['e5m2', 'e4m3'])
def test_fp8_head_within_fp8_tolerance_of_bf16(grad_dtype, seed):
  """Against the BF16 head on fresh inputs: loss within 1%, gradient
  cosines >= 0.99."""
  hidden, head, targets = _inputs(seed, 4, 64, 128, 1024)
  def run(fp8):
    fn = lambda h, w: chunked_cross_entropy(
        h, w, targets, chunk_size=96, fp8_grad_dtype=fp8)[0]
    return jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))(hidden, head)
  (loss, grads), (ref, ref_grads) = run(grad_dtype), run(None)
  np.testing.assert_allclose(loss, ref, rtol=1e-2)
  for g, r in zip(grads, ref_grads):
    g, r = np.asarray(g, np.float32).ravel(), np.asarray(r, np.float32).ravel()
    assert g @ r / np.linalg.norm(g) / np.linalg.norm(r) > 0.99


def test_fp8_head_gemms_are_fp8(seed):
  """Three FP8 GEMMs a chunk (logits, dh, dw) through `fp8_matmul` (which
  on the CPU is an exact float32 dot of the codes), and no other dot."""
  from coat_jax.models import loss as loss_lib  # noqa: PLC0415
  hidden, head, targets = _inputs(seed, 2, 8, 16, 64)
  seen = []

  def spy(a, b, *args, **kw):
    seen.append((a.dtype, b.dtype))
    return real(a, b, *args, **kw)

  real = loss_lib.fp8_matmul
  grad_fn = jax.grad(lambda h, w: chunked_cross_entropy(
      h, w, targets, chunk_size=16, fp8_grad_dtype='e5m2')[0],
                     argnums=(0, 1))
  with mock.patch.object(loss_lib, 'fp8_matmul', spy):
    dots = _dot_input_dtypes(jax.make_jaxpr(grad_fn)(hidden, head).jaxpr)
  e4, e5 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
  # Under grad only the custom VJP's forward is traced: logits, dh, dw.
  assert seen == [(e4, e4), (e5, e4), (e4, e5)], seen
  assert len(dots) == 3, dots


def test_fp8_head_bad_input(seed):
  hidden, head, targets = _inputs(seed, 1, 4, 16, 40)
  with pytest.raises(ValueError, match='vocab size=40.*fp8_head'):
    chunked_cross_entropy(hidden, head, targets, fp8_grad_dtype='e5m2')
  hidden, head, targets = _inputs(seed, 1, 4, 16, 48)
  with pytest.raises(ValueError, match='fp8_grad_dtype'):
    chunked_cross_entropy(hidden, head, targets, fp8_grad_dtype='e3m4')


def test_fp8_head_non_finite_hidden_gives_nan_loss(seed):
  hidden, head, targets = _inputs(seed, 1, 16, 16, 48)
  hidden = hidden.at[0, 3, 2].set(jnp.inf)
  loss, _ = chunked_cross_entropy(hidden, head, targets,
                                  fp8_grad_dtype='e5m2')
  assert np.isnan(float(loss))
