"""Chunked softmax cross entropy: the full FP32 logits never exist at once."""

import jax
import jax.numpy as jnp

from pallas_kernels import _common


def chunked_cross_entropy(
    hidden: jax.Array,
    head: jax.Array,
    targets: jax.Array,
    *,
    chunk_size: int = 1024,
    dtype=jnp.bfloat16,
) -> tuple[jax.Array, jax.Array]:
  """Sum of -log softmax(hidden @ head)[target] over tokens, chunk by chunk.

  Tokens are processed `chunk_size` at a time by a checkpointed function under
  `jax.lax.map`: at most one (chunk_size, V) float32 logits block is live, in
  the forward and in the backward (which recomputes it).

  Args:
    hidden: (..., H) final hidden states.
    head: (H, V) output projection (float32 param; cast to `dtype`).
    targets: (...) integer class ids; negative ids are ignored.
    chunk_size: tokens per chunk.
    dtype: matmul input dtype; logits accumulate in float32.

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
  w = head.astype(dtype)

  @jax.checkpoint
  def chunk_totals(h_c, t_c, w):
    logits = _logits(h_c, w)
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
    return jnp.sum(per_token, axis=0)

  totals = jax.lax.map(
      lambda xs: chunk_totals(xs[0], xs[1], w),
      (_chunks(h, chunk, token_axes), _chunks(t, chunk, token_axes)))
  loss_sum, count = jnp.sum(totals, axis=0)
  return loss_sum, count


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


@jax.custom_vjp
def _logits(h: jax.Array, w: jax.Array) -> jax.Array:
  """(T, H) @ (H, V) -> float32 logits; h and w share a dtype (bfloat16)."""
  return jnp.dot(h, w, preferred_element_type=jnp.float32)


def _logits_fwd(h, w):
  return _logits(h, w), (h, w)


def _logits_bwd(residuals, g):
  # The float32 logits gradient is rounded to the inputs' dtype so that both
  # backward GEMMs run in it, accumulating in float32; autodiff would mix a
  # float32 gradient with BF16 operands and run them as float32 (TF32) GEMMs.
  # Under Explicit mesh axes the tokens are sharded: dw's contraction over
  # them is spelled out (`dot_out_sharding`; None elsewhere).
  h, w = residuals
  g = g.astype(h.dtype)
  dh = jnp.dot(g, w.T, preferred_element_type=jnp.float32,
               out_sharding=_common.dot_out_sharding(g, w.T, 0, 1))
  dw = jnp.dot(h.T, g, preferred_element_type=jnp.float32,
               out_sharding=_common.dot_out_sharding(h.T, g, 0, 1))
  return dh.astype(h.dtype), dw.astype(w.dtype)


_logits.defvjp(_logits_fwd, _logits_bwd)
