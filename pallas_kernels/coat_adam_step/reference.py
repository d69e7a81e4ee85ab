"""The COAT AdamW step on one parameter: the pure-jnp reference.

Exactly the arithmetic of `coat_jax.coat_adamw` (optax's chain of
`scale_by_coat_adam`, `add_decayed_weights`, `scale_by_learning_rate`)
followed by `optax.apply_updates`, for one leaf:

  m, v = dequantize(mu), dequantize(nu)
  m = (1 - b1) g + b1 m;  v = (1 - b2) g^2 + b2 v
  u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
  u = u + wd p                     (unless weight_decay is None or 0)
  p = p + (-lr) u
  mu, nu = quantize_per_group(m), quantize_per_group(v)
"""

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import _common
from pallas_kernels.quantize_per_group import reference as group_reference


class Moment(NamedTuple):
  """An FP8 moment, field-compatible with `coat_jax.QuantizedArray`.

  Attributes:
    values: FP8 codes, the param's shape.
    scale: float32, shape[:-1] + (ceil(n / group_size),).
    exponent: float32 like scale (dynamic range expansion) or None.
  """

  values: jax.Array
  scale: jax.Array
  exponent: jax.Array | None


def hyperparams(
    count: jax.Array, learning_rate: Any, b1: Any, b2: Any, eps: Any,
    weight_decay: Any, grad_scale: Any = 1.0
) -> dict[str, jax.Array]:
  """The float32 scalars of a step, computed as optax computes them.

  Args:
    count: int32, the step number including this step (optax's
      `safe_increment(state.count)`, 1 on the first step).
    learning_rate: the learning rate of this step (a schedule already
      evaluated at optax's count, i.e. count - 1).
    b1, b2, eps, weight_decay: floats or float32 scalars.
    grad_scale: the gradient is multiplied by it first (global-norm
      clipping folded into the pass; 1 leaves it exactly as it is).
  """
  f32 = lambda v: jnp.asarray(v, jnp.float32)
  return dict(
      c1=f32(1 - b1), b1=f32(b1), c2=f32(1 - b2), b2=f32(b2),
      bc1=f32(1 - b1**count), bc2=f32(1 - b2**count), eps=f32(eps),
      wd=f32(0.0 if weight_decay is None else weight_decay),
      neg_lr=f32(-1 * learning_rate), gscale=f32(grad_scale))


def direction(
    g: jax.Array, m: jax.Array, v: jax.Array, hp: dict[str, jax.Array],
    ops: _common.Ops = _common.XLA_OPS
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Adam on dequantized moments: (m_hat / (sqrt(v_hat) + eps), m, v) new.

  optax's `scale_by_adam` arithmetic, operation for operation, on the
  gradient times hp['gscale'] (exact when it is 1).
  """
  g = g * hp['gscale']
  m = hp['c1'] * g + hp['b1'] * m
  v = hp['c2'] * (g * g) + hp['b2'] * v
  v_hat = ops.div_scalar(v, hp['bc2'])
  u = ops.div2(m, hp['bc1'], ops.sqrt(v_hat) + hp['eps'])  # m_hat / den
  return u, m, v


def update(
    p: jax.Array, g: jax.Array, m: jax.Array, v: jax.Array,
    hp: dict[str, jax.Array], apply_weight_decay: bool,
    ops: _common.Ops = _common.XLA_OPS
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The float32 AdamW arithmetic on dequantized moments: (p, m, v) new."""
  u, m, v = direction(g, m, v, hp, ops)
  if apply_weight_decay:
    u = u + hp['wd'] * p
  return p + hp['neg_lr'] * u, m, v


def coat_adam_step(
    param: jax.Array, grad: jax.Array, mu: Moment, nu: Moment,
    count: jax.Array, *, learning_rate: Any, b1: Any = 0.9, b2: Any = 0.999,
    eps: Any = 1e-8, weight_decay: Any = None, group_size: int = 128,
    expansion: bool = True, apply: Any = True, grad_scale: Any = 1.0
) -> tuple[jax.Array, Moment, Moment]:
  """One fused COAT AdamW step for one leaf, in jnp (see module doc).

  With `apply` False (a bool scalar) param and moments come back unchanged;
  the gradient is multiplied by `grad_scale` first.
  """
  hp = hyperparams(count, learning_rate, b1, b2, eps, weight_decay,
                   grad_scale)
  deq = lambda q: group_reference.dequantize_per_group(
      q.values, q.scale, q.exponent, group_size)
  p, m, v = update(
      param, grad.astype(jnp.float32), deq(mu), deq(nu), hp,
      apply_weight_decay=not _no_decay(weight_decay))
  quant = lambda x, like: Moment(*group_reference.quantize_per_group(
      x, group_size, like.values.dtype, expansion,
      scale_dtype=like.scale.dtype))
  new = (p.astype(param.dtype), quant(m, mu), quant(v, nu))
  if apply is True:
    return new
  return jax.tree.map(lambda a, b: jnp.where(apply, a, b), new,
                      (param, mu, nu))


def _no_decay(weight_decay: Any) -> bool:
  return weight_decay is None or (
      isinstance(weight_decay, int | float) and weight_decay == 0.0)
