"""Chunked softmax cross entropy: the full FP32 logits never exist at once."""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from coat_jax.nn import fsdp
from pallas_kernels import _common


def chunked_cross_entropy(
    hidden: jax.Array,
    head: jax.Array,
    targets: jax.Array,
    *,
    chunk_size: int = 2048,
    dtype=jnp.bfloat16,
) -> tuple[jax.Array, jax.Array]:
  """Sum of -log softmax(hidden @ head)[target] over tokens, chunk by chunk.

  Tokens are processed `chunk_size` at a time under `jax.lax.scan`: at most
  one (chunk_size, V) float32 logits block is live. Under differentiation
  the forward pass computes the gradients too (chunk by chunk, from the
  logits it has), since the loss is a step's last op: backward only scales
  them by the cotangent, and no logits are kept or recomputed.

  Args:
    hidden: (..., H) final hidden states.
    head: (H, V) output projection (float32 param; cast to `dtype`).
    targets: (...) integer class ids; negative ids are ignored.
    chunk_size: tokens per chunk. Each chunk adds its weight gradient into a
      float32 (H, V) sum, read and written once a chunk: 2048 rather than
      1024 is faster for a little more memory
      (docs/decisions.md#comment-figures).
    dtype: matmul input dtype; logits accumulate in float32.

  Under an FSDP mesh (`coat_jax.nn.fsdp`: Auto axes, tokens sharded over
  'data' x 'fsdp') each device runs the chunks of its own tokens.

  Returns:
    (loss_sum, count): float32 scalars, the summed loss over the targets that
    are >= 0 and their number.
  """
  if not jnp.issubdtype(targets.dtype, jnp.integer):
    raise TypeError(f'targets has dtype {targets.dtype}; it must hold integer'
                    ' token ids (e.g. int32).')
  if targets.shape != hidden.shape[:-1]:
    raise ValueError(f'targets has shape {targets.shape}; expected'
                     f' {hidden.shape[:-1]} (hidden.shape[:-1]).')
  if chunk_size <= 0:
    raise ValueError(f'chunk_size={chunk_size} must be positive.')
  width = hidden.shape[-1]
  h = hidden.reshape(-1, width).astype(dtype)
  t = targets.reshape(-1).astype(jnp.int32)
  if fsdp.batch_shards(t.shape[0]) > 1:
    return _per_device_totals(h, head, t, chunk_size, jnp.dtype(dtype))
  return _totals(h, head, t, chunk_size, jnp.dtype(dtype))


def _per_device_totals(h, head, t, chunk_size, dtype):
  """`_totals` of each device's tokens under an FSDP mesh (Auto axes), the
  head gathered whole, the sums and the head's gradient summed over the
  devices.

  Left to the partitioner, the chunk loop's (T / chunk, chunk, H) tokens
  lost their batch sharding: under FSDP XLA moved the activations to H
  slices (an all-to-all) and all-reduced every chunk's float32 partial
  logits (262 MB a chunk at vocab 32000) on the critical path; under data
  parallelism every device gathered and ran the whole batch's chunks. Here
  the float32 head is all-gathered once and its gradient all-reduced once
  (docs/decisions.md#comment-figures).
  """
  axes = fsdp.BATCH_AXES

  def local(h, head, t):
    # The head varies over the devices from here on, so that its
    # gradient (each device's tokens' part) is summed over them.
    head = jax.lax.pcast(head, axes, to='varying')
    totals = _totals(h, head, t, chunk_size, dtype)
    return tuple(jax.lax.psum(x, axes) for x in totals)

  return jax.shard_map(
      local, in_specs=(P(axes), P(), P(axes)), out_specs=(P(), P()),
      axis_names=set(axes))(h, head, t)


def _totals(h, head, t, chunk_size, dtype):
  """(loss sum, count) of (T, H) h in dtype against (T,) targets t."""
  tokens = t.shape[0]
  chunk = min(chunk_size, tokens)
  # Tokens sharded by Explicit mesh axes (None elsewhere): see `_chunks`.
  token_axes = (_common.explicit_spec(h) or (None,))[0]
  if token_axes is not None:
    shards = _common.mesh_size(h, token_axes)
    chunk = -(-chunk // shards) * shards
  pad = -tokens % chunk
  if pad:
    h = jnp.pad(h, ((0, pad), (0, 0)))
    t = jnp.pad(t, (0, pad), constant_values=-1)
  totals = _chunk_totals(h, head, t, chunk, token_axes, dtype,
                         jnp.dtype(head.dtype))
  return totals[0], totals[1]


def _chunks(x: jax.Array, chunk: int, token_axes) -> jax.Array:
  """(T, ...) -> (T / chunk, chunk, ...): chunk i holds tokens i * chunk to
  (i + 1) * chunk - 1.

  With the tokens sharded over the mesh axes `token_axes` (Explicit axes;
  chunk a multiple of their size), `lax.map` cannot run over a sharded axis:
  chunk i then holds every (T / chunk)-th token from i, sharded like the
  tokens (a sum does not care about the order of its terms).
  """
  n = x.shape[0] // chunk
  if token_axes is None:
    return x.reshape((n, chunk) + x.shape[1:])
  spec = jax.sharding.PartitionSpec(token_axes, *(None,) * x.ndim)
  return jnp.swapaxes(jax.lax.reshape(x, (chunk, n) + x.shape[1:],
                                      out_sharding=spec), 0, 1)


def _unchunks(x: jax.Array, token_axes) -> jax.Array:
  """The inverse of `_chunks`: (T / chunk, chunk, ...) -> (T, ...)."""
  n, chunk = x.shape[:2]
  if token_axes is None:
    return x.reshape((n * chunk,) + x.shape[2:])
  spec = jax.sharding.PartitionSpec(token_axes, *(None,) * (x.ndim - 2))
  return jax.lax.reshape(jnp.swapaxes(x, 0, 1), (n * chunk,) + x.shape[2:],
                         out_sharding=spec)


def _logits_and_totals(h_c, w, t_c):
  """(float32 logits (C, V), logsumexp (C,), valid (C,), [loss sum,
  count]) of one chunk; w is (H, V) in h_c's dtype."""
  logits = jnp.dot(h_c, w, preferred_element_type=jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(
      logits, jnp.maximum(t_c, 0)[:, None], axis=-1)[:, 0]
  valid = t_c >= 0
  # Loss and count reduced as one array: with tokens sharded, one
  # all-reduce after the logits. A separate count all-reduce depends on
  # nothing and XLA:CPU may run it beside the layers' while loop, whose
  # own all-reduces then meet it in different orders on different
  # devices: a deadlock.
  per_token = jnp.stack([jnp.where(valid, lse - picked, 0.0),
                         valid.astype(jnp.float32)], axis=-1)
  return logits, lse, valid, jnp.sum(per_token, axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _chunk_totals(h, head, t, chunk, token_axes, dtype, head_dtype):
  """[loss sum, count] (float32) of (T, H) h in dtype against (T,) targets
  t, T a multiple of chunk, through the (H, V) head (head_dtype) cast to
  dtype."""
  del head_dtype
  w = head.astype(dtype)

  def body(_, xs):
    return None, _logits_and_totals(xs[0], w, xs[1])[3]

  _, totals = jax.lax.scan(body, None, (_chunks(h, chunk, token_axes),
                                        _chunks(t, chunk, token_axes)))
  return jnp.sum(totals, axis=0)


def _chunk_totals_fwd(h, head, t, chunk, token_axes, dtype, head_dtype):
  del head_dtype
  # The loss is the last op of the step, so its gradients are known in
  # forward up to the cotangent (a scalar): each chunk's d loss_sum / d
  # logits (softmax - one-hot, rounded to dtype so that both GEMMs run in
  # it, accumulating in float32) goes straight into dh and dw. Backward
  # only scales them: no logits recomputed, none saved.
  w = head.astype(dtype)
  vocab = w.shape[1]

  def body(dw, xs):
    h_c, t_c = xs
    logits, lse, valid, totals = _logits_and_totals(h_c, w, t_c)
    onehot = jnp.arange(vocab, dtype=jnp.int32)[None, :] == t_c[:, None]
    g = jnp.where(valid[:, None],
                  jnp.exp(logits - lse[:, None]) - onehot, 0.0).astype(dtype)
    # Under Explicit mesh axes the tokens are sharded: dw's contraction over
    # them is spelled out (`dot_out_sharding`; None elsewhere).
    dh_c = jnp.dot(g, w.T, preferred_element_type=jnp.float32,
                   out_sharding=_common.dot_out_sharding(g, w.T, 0, 1))
    dw = dw + jnp.dot(h_c.T, g, preferred_element_type=jnp.float32,
                      out_sharding=_common.dot_out_sharding(h_c.T, g, 0, 1))
    return dw, (totals, dh_c.astype(dtype))

  dw = jnp.zeros_like(w, jnp.float32)  # varying where w is (shard_map)
  dw, (totals, dh) = jax.lax.scan(
      body, dw, (_chunks(h, chunk, token_axes), _chunks(t, chunk, token_axes)))
  return jnp.sum(totals, axis=0), (_unchunks(dh, token_axes), dw)


def _chunk_totals_bwd(chunk, token_axes, dtype, head_dtype, residuals, g):
  del chunk, token_axes, dtype
  dh, dw = residuals  # dw float32, rounded once, to the head's dtype
  scale = g[0]  # the count has no gradient
  return ((dh.astype(jnp.float32) * scale).astype(dh.dtype),
          (dw * scale).astype(head_dtype), None)


_chunk_totals.defvjp(_chunk_totals_fwd, _chunk_totals_bwd)
