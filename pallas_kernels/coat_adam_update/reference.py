"""The COAT Adam update of one leaf (no param): the pure-jnp reference.

Exactly the arithmetic of `coat_jax.scale_by_coat_adam` for one leaf, the
transformation optax chains before weight decay and the learning rate:

  m, v = dequantize(mu), dequantize(nu)
  m = (1 - b1) g + b1 m;  v = (1 - b2) g^2 + b2 v
  u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
  mu, nu = quantize_per_group(m), quantize_per_group(v)

It is `coat_adam_step.reference` without the last two lines (decay, lr).
"""

from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.coat_adam_step import reference as step_reference
from pallas_kernels.coat_adam_step.reference import Moment
from pallas_kernels.quantize_per_group import reference as group_reference


def hyperparams(count: jax.Array, b1: Any, b2: Any,
                eps: Any) -> dict[str, jax.Array]:
  """The float32 scalars of an update (count: this step's, 1 first)."""
  return step_reference.hyperparams(count, 0.0, b1, b2, eps, None)


def coat_adam_update(
    grad: jax.Array, mu: Moment, nu: Moment, count: jax.Array, *,
    b1: Any = 0.9, b2: Any = 0.999, eps: Any = 1e-8, group_size: int = 128,
    expansion: bool = True
) -> tuple[jax.Array, Moment, Moment]:
  """(float32 direction m_hat / (sqrt(v_hat) + eps), new mu, new nu)."""
  hp = hyperparams(count, b1, b2, eps)
  deq = lambda q: group_reference.dequantize_per_group(
      q.values, q.scale, q.exponent, group_size)
  u, m, v = step_reference.direction(
      grad.astype(jnp.float32), deq(mu), deq(nu), hp)
  quant = lambda x, like: Moment(*group_reference.quantize_per_group(
      x, group_size, like.values.dtype, expansion,
      scale_dtype=like.scale.dtype))
  return u, quant(m, mu), quant(v, nu)
