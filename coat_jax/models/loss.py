"""Chunked softmax cross entropy: the full FP32 logits never exist at once."""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

from coat_jax import quant
from coat_jax.nn import fsdp
from coat_jax.nn.fp8_matmul import fp8_matmul
from coat_jax.recipes import FP8_MULTIPLE
from pallas_kernels import _common


def chunked_cross_entropy(
    hidden: jax.Array,
    head: jax.Array,
    targets: jax.Array,
    *,
    chunk_size: int = 2048,
    dtype=jnp.bfloat16,
    fp8_grad_dtype: str | None = None,
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
    fp8_grad_dtype: None (the three GEMMs in `dtype`), or 'e5m2' / 'e4m3':
      the three GEMMs in FP8 (`Recipe.fp8_head`), with float32
      accumulation: hidden and head as E4M3 with one current scale each
      (the head quantized once, not per chunk), and each chunk's
      d loss / d logits, which lies in [-1, 1], in this format with a fixed
      power-of-two scale (no amax pass). H and V must be multiples of 16.

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
  if fp8_grad_dtype is not None:
    _common.fp8_dtype(fp8_grad_dtype, 'fp8_grad_dtype')
    bad = [f'{n}={v}' for n, v in (('hidden size', width),
                                   ('vocab size', head.shape[-1]))
           if v % FP8_MULTIPLE]
    if bad:
      raise ValueError(f'an FP8 head needs multiples of {FP8_MULTIPLE}:'
                       f' {", ".join(bad)}; set Recipe.fp8_head=False.')
    dtype = fp8_grad_dtype  # a static marker: see `_totals`
  else:
    dtype = jnp.dtype(dtype)
  h = hidden.reshape(-1, width)
  if fp8_grad_dtype is None:
    h = h.astype(dtype)
  t = targets.reshape(-1).astype(jnp.int32)
  if fsdp.batch_shards(t.shape[0]) > 1:
    return _per_device_totals(h, head, t, chunk_size, dtype)
  return _totals(h, head, t, chunk_size, dtype)


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
  """(loss sum, count) of (T, H) h against (T,) targets t; dtype: the
  GEMMs' input dtype, or an FP8 gradient format's name."""
  tokens = t.shape[0]
  chunk = min(chunk_size, tokens)
  # Tokens sharded by Explicit mesh axes (None elsewhere): see `_chunks`.
  token_axes = (_common.explicit_spec(h) or (None,))[0]
  if isinstance(dtype, str):
    if token_axes is not None:
      raise ValueError('an FP8 head does not run on tokens sharded by'
                       ' Explicit mesh axes; set Recipe.fp8_head=False.')
    chunk = -(-chunk // FP8_MULTIPLE) * FP8_MULTIPLE  # the FP8 GEMMs' tile
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


class _Fp8Head(NamedTuple):
  """The head's GEMM operands in FP8, made once a step: E4M3 codes of the
  (H, V) head and of its transpose (V, H) (the logits GEMM's K-major
  operand), their dequantization scale, and the gradient format."""
  w: jax.Array
  w_t: jax.Array
  w_scale: jax.Array
  grad_dtype: str

  @classmethod
  def of(cls, head: jax.Array, grad_dtype: str) -> '_Fp8Head':
    q = quant.quantize_per_tensor(head.astype(jnp.float32), 'e4m3')
    return cls(q.values, q.values.T, q.scale, grad_dtype)

  def logits(self, h_c: jax.Array, h_scale: jax.Array) -> jax.Array:
    """(C, V) float32 logits of E4M3 codes h_c (C, H)."""
    return fp8_matmul(h_c, self.w_t, h_scale, self.w_scale,
                      out_dtype=jnp.float32)

  def grad_scale(self) -> float:
    """A power of two under which |d loss / d logits| <= 1 fits the
    gradient format: 2^-15 for E5M2 (max 57344), 2^-8 for E4M3 (448)."""
    return 2.0 ** -int(np.log2(_common.fp8_max(self.grad_dtype)))

  def backward(self, h_c, h_scale, g):
    """(dh (C, H), dw (H, V)) float32 of float32 g = d loss / d logits
    (C, V) and E4M3 codes h_c (C, H)."""
    s = self.grad_scale()
    g_c = _common.saturate(g * np.float32(1 / s), self.grad_dtype)
    dh = fp8_matmul(g_c, self.w, s, self.w_scale, out_dtype=jnp.float32)
    dw = fp8_matmul(h_c.T, g_c.T, h_scale, s, out_dtype=jnp.float32)
    return dh, dw


def _logits_and_totals(h_c, w, t_c, h_scale=None):
  """(float32 logits (C, V), logsumexp (C,), valid (C,), [loss sum,
  count]) of one chunk; w is (H, V) in h_c's dtype, or an `_Fp8Head` with
  h_c E4M3 codes dequantized by h_scale."""
  if isinstance(w, _Fp8Head):
    logits = w.logits(h_c, h_scale)
  else:
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
  w, h, h_scale = _operands(h, head, dtype)

  def body(_, xs):
    return None, _logits_and_totals(xs[0], w, xs[1], h_scale)[3]

  _, totals = jax.lax.scan(body, None, (_chunks(h, chunk, token_axes),
                                        _chunks(t, chunk, token_axes)))
  return jnp.sum(totals, axis=0)


def _operands(h, head, dtype):
  """(w, h, h_scale): the head cast to dtype, h and None; or with an FP8
  gradient format's name for dtype, the head as an `_Fp8Head` and h as
  E4M3 codes with their scale (one current scale over all tokens)."""
  if isinstance(dtype, str):
    q = quant.quantize_per_tensor(h, 'e4m3')
    return _Fp8Head.of(head, dtype), q.values, q.scale
  return head.astype(dtype), h, None


def _chunk_totals_fwd(h, head, t, chunk, token_axes, dtype, head_dtype):
  del head_dtype
  # The loss is the last op of the step, so its gradients are known in
  # forward up to the cotangent (a scalar): each chunk's d loss_sum / d
  # logits (softmax - one-hot, rounded to dtype so that both GEMMs run in
  # it, accumulating in float32) goes straight into dh and dw. Backward
  # only scales them: no logits recomputed, none saved.
  w, h_in, h_scale = _operands(h, head, dtype)
  vocab = head.shape[1]
  dh_dtype = h.dtype

  def body(dw, xs):
    h_c, t_c = xs
    logits, lse, valid, totals = _logits_and_totals(h_c, w, t_c, h_scale)
    onehot = jnp.arange(vocab, dtype=jnp.int32)[None, :] == t_c[:, None]
    g = jnp.where(valid[:, None], jnp.exp(logits - lse[:, None]) - onehot,
                  0.0)
    if isinstance(w, _Fp8Head):
      dh_c, dw_c = w.backward(h_c, h_scale, g)
      return dw + dw_c, (totals, dh_c.astype(dh_dtype))
    g = g.astype(dtype)
    # Under Explicit mesh axes the tokens are sharded: dw's contraction over
    # them is spelled out (`dot_out_sharding`; None elsewhere).
    dh_c = jnp.dot(g, w.T, preferred_element_type=jnp.float32,
                   out_sharding=_common.dot_out_sharding(g, w.T, 0, 1))
    dw = dw + jnp.dot(h_c.T, g, preferred_element_type=jnp.float32,
                      out_sharding=_common.dot_out_sharding(h_c.T, g, 0, 1))
    return dw, (totals, dh_c.astype(dh_dtype))

  # Varying where head is (shard_map).
  dw = jnp.zeros_like(head, jnp.float32)
  dw, (totals, dh) = jax.lax.scan(
      body, dw, (_chunks(h_in, chunk, token_axes),
                 _chunks(t, chunk, token_axes)))
  return jnp.sum(totals, axis=0), (_unchunks(dh, token_axes), dw)


def _chunk_totals_bwd(chunk, token_axes, dtype, head_dtype, residuals, g):
  del chunk, token_axes, dtype
  dh, dw = residuals  # dw float32, rounded once, to the head's dtype
  scale = g[0]  # the count has no gradient
  return ((dh.astype(jnp.float32) * scale).astype(dh.dtype),
          (dw * scale).astype(head_dtype), None)


_chunk_totals.defvjp(_chunk_totals_fwd, _chunk_totals_bwd)
