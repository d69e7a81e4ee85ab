"""The fused COAT AdamW step for one leaf: public entry."""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _common
from pallas_kernels import dispatch
from pallas_kernels.coat_adam_step import reference
from pallas_kernels.coat_adam_step.reference import Moment


def _fields(q: Any, name: str) -> Moment:
  try:
    return Moment(q.values, q.scale, q.exponent)
  except AttributeError:
    raise TypeError(
        f'{name} must have fields values, scale, exponent (a'
        f' coat_jax.QuantizedArray or a {__name__}.Moment), got'
        f' {type(q).__name__}.') from None


def _rebuild(like: Any, new: Moment) -> Any:
  if dataclasses.is_dataclass(like):
    return dataclasses.replace(
        like, values=new.values, scale=new.scale, exponent=new.exponent)
  return type(like)(*new) if isinstance(like, tuple) else new


def check_grad_and_moments(grad: jax.Array, m: Moment, v: Moment,
                           expansion: bool) -> None:
  """Raises unless grad is floating and m, v are FP8 moments of its shape
  with an exponent exactly when `expansion`."""
  if not jnp.issubdtype(grad.dtype, jnp.floating):
    raise TypeError(f'grad has dtype {grad.dtype}; it must be floating.')
  for name, q in (('mu', m), ('nu', v)):
    _common.fp8_dtype(q.values.dtype, f'{name}.values.dtype')
    if q.values.shape != grad.shape:
      raise ValueError(
          f'{name}.values has shape {q.values.shape}, grad {grad.shape}.')
    if (q.exponent is None) == expansion:
      raise ValueError(
          f'{name}.exponent must be {"set" if expansion else "None"} with'
          f' expansion={expansion}.')


def _fusable(param_dtype: Any, group_size: int) -> bool:
  return (np.dtype(param_dtype) == np.float32 and group_size >= 2
          and group_size & (group_size - 1) == 0)


def runs_kernel(param_dtype: Any, group_size: int,
                implementation: str | None = None) -> bool:
  """Whether `coat_adam_step` runs its Pallas kernel (compiled or
  interpreted) for a param of this dtype, rather than its jnp reference.
  Only the kernel updates one layer of a stack in place (`layer=`)."""
  impl, _ = dispatch.resolve_implementation('coat_adam_step', implementation)
  return impl == 'pallas' and _fusable(param_dtype, group_size)


def coat_adam_step(
    param: jax.Array, grad: jax.Array, mu: Any, nu: Any, count: jax.Array,
    *, learning_rate: Any, b1: Any = 0.9, b2: Any = 0.999, eps: Any = 1e-8,
    weight_decay: Any = None, group_size: int = 128, expansion: bool = True,
    apply: Any = True, implementation: str | None = None, approx: bool = True,
    grad_scale: Any = 1.0, layer: int | None = None
) -> tuple[jax.Array, Any, Any]:
  """One COAT AdamW step on one leaf: new (param, mu, nu), in one pass.

  Same arithmetic and rounding as `coat_jax.coat_adamw` followed by
  `optax.apply_updates` (see `reference`). The Pallas kernel updates param
  and moments in place: under `jax.jit` donate them, or XLA copies them first.

  Args:
    param: float32 array of any shape (other dtypes use the XLA path).
    grad: floating array of param's shape.
    mu, nu: the FP8 moments (a `coat_jax.QuantizedArray` or a `Moment`):
      values FP8 of param's shape, scale float32 or bfloat16 and exponent
      float32 (or None without expansion) of shape
      shape[:-1] + (ceil(n / group_size),). Returned as the same type.
    count: int32 scalar, the step number including this step (1 first).
    learning_rate: this step's learning rate (a float or scalar array).
    b1, b2, eps: Adam constants.
    weight_decay: decoupled weight decay, or None (or 0.0) for none (masked
      leaves).
    group_size: the moments' group size (static).
    expansion: whether the moments use dynamic range expansion (static).
    apply: a bool scalar; False returns param and moments unchanged (a
      skipped step: non-finite gradients). Unlike a `jnp.where` after the
      step, it keeps the Pallas kernel in place: no copy of the old state.
    implementation: None (fastest available), 'xla' or 'pallas'.
    approx: the compiled GPU kernel's group math runs in the log2 domain on
      the approximate lg2/ex2 instructions, and Adam's division on rcp
      (faster; FP8 moments within a code step or two of the reference's in
      rare elements, decoded values within ~5e-6). False: the reference's
      exact ops. Interpreted kernels always use exact ops.
    grad_scale: a float32 scalar the gradient is multiplied by first (e.g.
      global-norm clipping's min(1, max_norm / norm), folded into the pass
      so that no scaled copy of the gradients is written).
    layer: None, or an int: param, mu and nu are a stack of layers
      (L, *grad.shape) along a leading axis and only `layer` takes the step
      (in place: the other layers' bytes are not touched), so that the
      per-layer gradients of unrolled layers need not be stacked first.

  Returns:
    (new_param, new_mu, new_nu).
  """
  m, v = _fields(mu, 'mu'), _fields(nu, 'nu')
  param = jnp.asarray(param)
  grad = jnp.asarray(grad)
  layer_shape = param.shape if layer is None else param.shape[1:]
  if grad.shape != layer_shape:
    raise ValueError(
        f'grad has shape {grad.shape} but param has shape {param.shape}'
        + ('.' if layer is None else
           f'; with layer={layer} it must be param.shape[1:].'))
  if layer is not None and not 0 <= layer < param.shape[0]:
    raise ValueError(f'layer={layer} is outside the stack of'
                     f' {param.shape[0]} layers (param {param.shape}).')
  check_grad_and_moments(jax.ShapeDtypeStruct(param.shape, grad.dtype), m, v,
                         expansion)
  impl, interpret = dispatch.resolve_implementation(
      'coat_adam_step', implementation)
  if impl == 'pallas' and _fusable(param.dtype, group_size):
    from pallas_kernels.coat_adam_step import pallas_triton
    hp = reference.hyperparams(
        count, learning_rate, b1, b2, eps, weight_decay, grad_scale)

    def kernel(state, grad, layer=None):
      return pallas_triton.coat_adam_step(
          *state[:1], grad, *state[1:], hp, apply, group_size=group_size,
          expansion=expansion,
          apply_weight_decay=not reference._no_decay(weight_decay),
          interpret=interpret, approx=approx,
          layer=None if layer is None else jnp.int32(layer))

    # Operands past 32-bit offsets (`_common.offsets_overflow`) run in
    # parts; one layer of such a stack runs as a slice, written back.
    state = (param, m, v)
    if layer is None:
      p, m2, v2 = _common.in_leading_parts(kernel, state, grad)
    elif not _common.offsets_overflow(*jax.tree.leaves(state)):
      p, m2, v2 = kernel(state, grad, layer)
    else:
      new = _common.in_leading_parts(
          kernel, jax.tree.map(lambda a: a[layer], state), grad)
      p, m2, v2 = jax.tree.map(lambda whole, x: whole.at[layer].set(x),
                               state, new)
  else:
    at = (lambda a: a) if layer is None else (lambda a: a[layer])
    p, m2, v2 = reference.coat_adam_step(
        at(param), grad, jax.tree.map(at, m), jax.tree.map(at, v), count,
        learning_rate=learning_rate, b1=b1, b2=b2, eps=eps,
        weight_decay=weight_decay, group_size=group_size,
        expansion=expansion, apply=apply, grad_scale=grad_scale)
    if layer is not None:  # written back in place (a dynamic-update-slice)
      p, m2, v2 = jax.tree.map(lambda whole, new: whole.at[layer].set(new),
                               (param, m, v), (p, m2, v2))
  return p, _rebuild(mu, m2), _rebuild(nu, v2)
