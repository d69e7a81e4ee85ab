"""The COAT Adam update for one leaf (the optax path): public entry."""

from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import _common
from pallas_kernels import dispatch
from pallas_kernels.coat_adam_step import api as step_api
from pallas_kernels.coat_adam_update import reference


def coat_adam_update(
    grad: jax.Array, mu: Any, nu: Any, count: jax.Array, *, b1: Any = 0.9,
    b2: Any = 0.999, eps: Any = 1e-8, group_size: int = 128,
    expansion: bool = True, implementation: str | None = None,
    approx: bool = True
) -> tuple[jax.Array, Any, Any]:
  """One COAT Adam update of one leaf: (direction, new mu, new nu).

  The arithmetic and rounding of `coat_jax.scale_by_coat_adam` (see
  `reference`). The Pallas kernel reads grad and the FP8 moments once and
  writes the float32 direction and the new moments (in place: under
  `jax.jit` donate the state, or XLA copies the moments first).

  Args:
    grad: floating array of any shape.
    mu, nu: the FP8 moments (a `coat_jax.QuantizedArray` or a
      `coat_adam_step.Moment`) of grad's shape; returned as the same type.
    count: int32 scalar, the step number including this step (1 first).
    b1, b2, eps: Adam constants.
    group_size: the moments' group size (static).
    expansion: whether the moments use dynamic range expansion (static).
    implementation: None (fastest available), 'xla' or 'pallas'.
    approx: the compiled GPU kernel's group math runs in the log2 domain on
      the approximate lg2/ex2 instructions, and Adam's division on rcp
      (faster; FP8 moments within a code step or two of the reference's in
      rare elements, decoded values within ~5e-6). False: the reference's
      exact ops. Interpreted kernels always use exact ops.

  Returns:
    (float32 direction of grad's shape, new_mu, new_nu).
  """
  m, v = step_api._fields(mu, 'mu'), step_api._fields(nu, 'nu')  # pylint: disable=protected-access
  grad = jnp.asarray(grad)
  step_api.check_grad_and_moments(grad, m, v, expansion)
  impl, interpret = dispatch.resolve_implementation(
      'coat_adam_update', implementation)
  fusable = group_size >= 2 and group_size & (group_size - 1) == 0
  if impl == 'pallas' and fusable:
    from pallas_kernels.coat_adam_step import pallas_triton  # pylint: disable=g-import-not-at-top
    hp = reference.hyperparams(count, b1, b2, eps)

    def kernel(moments, grad):
      return pallas_triton.coat_adam_update(
          grad, *moments, hp, group_size=group_size, expansion=expansion,
          interpret=interpret, approx=approx)

    # In parts where `_common.offsets_overflow`.
    u, (m2, v2) = _common.in_leading_parts(
        lambda moments, grad: (lambda u, *mv: (u, tuple(mv)))(
            *kernel(moments, grad)),
        (m, v), grad,
        out_shapes=jax.ShapeDtypeStruct(grad.shape, jnp.float32))
  else:
    u, m2, v2 = reference.coat_adam_update(
        grad, m, v, count, b1=b1, b2=b2, eps=eps, group_size=group_size,
        expansion=expansion)
  return u, step_api._rebuild(mu, m2), step_api._rebuild(nu, v2)  # pylint: disable=protected-access
