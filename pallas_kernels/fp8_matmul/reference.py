"""Pure-jnp float32 reference for the FP8 matmul (the oracle of the tests)."""

import jax
import jax.numpy as jnp


def fp8_matmul_reference(a: jax.Array, b: jax.Array, a_scale, b_scale, *,
                         out_dtype=jnp.bfloat16) -> jax.Array:
  """(a @ b.T) * (a_scale * b_scale) with exact float32 products.

  Args:
    a: (M, K) FP8 (or any float) array.
    b: (N, K) FP8 (or any float) array, K-major like a.
    a_scale: () float32 dequantization scale of a.
    b_scale: () float32 dequantization scale of b.
    out_dtype: dtype of the result.

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
  return (acc * scale).astype(out_dtype)
