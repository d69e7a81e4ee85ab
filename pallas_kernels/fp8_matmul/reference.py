"""Pure-jnp float32 reference for the FP8 matmul (the oracle of the tests)."""

import jax
import jax.numpy as jnp


def plus_c(acc, c, out_dtype):
  """float32 acc (+ c, in float32) rounded once to out_dtype."""
  if c is not None:
    acc = acc + c.astype(jnp.float32)
  return acc.astype(out_dtype)


def fp8_matmul_reference(a: jax.Array, b: jax.Array, a_scale, b_scale, *,
                         out_dtype=jnp.bfloat16, c=None) -> jax.Array:
  """(a @ b.T) * (a_scale * b_scale) (+ c) with exact float32 products.

  Args:
    a: (M, K) FP8 (or any float) array.
    b: (N, K) FP8 (or any float) array, K-major like a.
    a_scale: () float32 dequantization scale of a.
    b_scale: () float32 dequantization scale of b.
    out_dtype: dtype of the result.
    c: None or (M, N), added in float32 before the one rounding.

  Returns:
    (M, N) array of out_dtype. Products of FP8 values are exact in float32;
    the sum is an ordinary float32 sum (precision HIGHEST, no TF32).
  """
  acc = jax.lax.dot_general(
      a.astype(jnp.float32), b.astype(jnp.float32),
      (((1,), (1,)), ((), ())),
      precision=jax.lax.Precision.HIGHEST,
      preferred_element_type=jnp.float32)
  scale = (jnp.asarray(a_scale, jnp.float32)
           * jnp.asarray(b_scale, jnp.float32))
  return plus_c(acc * scale, c, out_dtype)


BLOCK_K = 128


def expand_b_scale(b_scale: jax.Array, n: int) -> jax.Array:
  """b's scales per (row of b, 128 of K): (N, KB) float32.

  (N, KB) is returned as is; (ceil(N / 128), KB) (one scale per 128x128
  block) is repeated over the block's rows. The two never have the same
  shape, since N is a multiple of 16 (ceil(N / 128) == N only for N == 1).
  """
  if b_scale.shape[0] == n:
    return b_scale
  return jnp.repeat(b_scale, BLOCK_K, axis=0)[:n]


def fp8_matmul_block_reference(a: jax.Array, b: jax.Array, a_scale, b_scale,
                               *, out_dtype=jnp.bfloat16,
                               block_dot=None, c=None) -> jax.Array:
  """Block-scaled (a @ b.T): each 128-K partial sum scaled, then summed.

  out[m, n] = sum_kb (sum_{k in kb} a[m, k] b[n, k]) a_scale[m, kb]
  b_scale[n or n // 128, kb]: exact float32 products, float32 sums (precision
  HIGHEST), the partial sums scaled by a_scale * b_scale and added in
  increasing kb. K is zero-padded to a multiple of 128.

  Args:
    a: (M, K) FP8 (or any float).
    b: (N, K) FP8 (or any float), K-major.
    a_scale: (M, ceil(K / 128)) float32.
    b_scale: (ceil(N / 128), ceil(K / 128)) or (N, ceil(K / 128)) float32.
    out_dtype: dtype of the result.
    block_dot: `(a_block (M, 128), b_block (N, 128)) -> float32 (M, N)`;
      None: float32 operands, precision HIGHEST (exact FP8 products).
    c: None or (M, N), added to the float32 sum before the one rounding.

  Returns:
    (M, N) array of out_dtype.
  """
  if block_dot is None:
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    block_dot = lambda ab, bb: jax.lax.dot_general(
        ab, bb, (((1,), (1,)), ((), ())),
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32)
  m, k = a.shape
  n = b.shape[0]
  kb = -(-k // BLOCK_K)
  pad = kb * BLOCK_K - k
  a = jnp.pad(a, ((0, 0), (0, pad)))
  b = jnp.pad(b, ((0, 0), (0, pad)))
  a_scale = jnp.asarray(a_scale, jnp.float32)
  b_scale = expand_b_scale(jnp.asarray(b_scale, jnp.float32), n)
  a_blocks = a.reshape(m, kb, BLOCK_K).transpose(1, 0, 2)
  b_blocks = b.reshape(n, kb, BLOCK_K).transpose(1, 0, 2)

  def step(acc, blocks):
    ab, bb, sa, sb = blocks
    part = block_dot(ab, bb)
    return acc + part * (sa[:, None] * sb[None, :]), None

  acc, _ = jax.lax.scan(
      step, jnp.zeros((m, n), jnp.float32),
      (a_blocks, b_blocks, a_scale.T, b_scale.T))
  return plus_c(acc, c, out_dtype)
