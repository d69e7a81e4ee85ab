"""FP8 optimizer states for any optax optimizer whose state mirrors the params.

`fp8_states(optax.lion(1e-4))` keeps Lion's momentum, `fp8_states(
optax.sgd(1e-2, momentum=0.9))` the trace, `fp8_states(optax.adamw(1e-3))`
both moments, as COAT keeps Adam's: FP8 codes in groups along each param's
last axis with a float32 scale (and expansion exponent) per group. Each
update dequantizes them, runs the inner optimizer in float32 and quantizes
its new state again. A state subtree "mirrors the params" when it has the
params' tree structure and shapes (and floating leaves); everything else
(step counts, scalars, schedules' state) is kept as the inner optimizer
keeps it.

For AdamW prefer `coat_adamw`: the same state, and one fused pass per leaf.
"""

from typing import Any

import jax
import jax.numpy as jnp
import optax

from coat_jax import quant
from coat_jax.optim import coat_adam
from coat_jax.optim import moments
from pallas_kernels import _common


def _mirror_test(params: Any):
  """A predicate: does a state subtree mirror `params` (tree, shapes)?"""
  treedef = jax.tree.structure(params)
  shapes = [jnp.shape(p) for p in jax.tree.leaves(params)]

  def mirrors(x: Any) -> bool:
    if jax.tree.structure(x) != treedef:
      return False
    leaves = jax.tree.leaves(x)
    return all(
        jnp.shape(a) == s and jnp.issubdtype(jnp.result_type(a), jnp.floating)
        for a, s in zip(leaves, shapes))

  return mirrors


def fp8_states(
    inner: optax.GradientTransformation,
    group_size: int = 128,
    dtype: str = 'e4m3',
    expansion: bool = True,
) -> optax.GradientTransformation:
  """Wraps `inner` so that its param-shaped state leaves are stored in FP8.

  Args:
    inner: an optax optimizer (momentum SGD, Lion, Adam-family, ...).
    group_size: static quantization group size along each param's last axis.
    dtype: FP8 format of the stored leaves, 'e4m3' or 'e5m2'.
    expansion: use COAT's dynamic range expansion (recommended: it keeps the
      small entries of a group that linear FP8 flushes to zero).

  Returns:
    An `optax.GradientTransformation` with `inner`'s state structure, each
    param-mirroring subtree's leaves `quant.QuantizedArray`s (1 byte per
    element plus 8 bytes per group of `group_size` with expansion: 1.0625
    bytes per param per state at 128, against 4 in float32).
  """
  if not isinstance(inner, optax.GradientTransformation):
    raise TypeError(
        f'inner must be an optax.GradientTransformation (e.g.'
        f' optax.lion(1e-4)), got {type(inner).__name__}.')
  group_size = coat_adam._check_group_size(group_size)  # pylint: disable=protected-access
  _common.fp8_dtype(dtype, 'dtype')

  def quantize(x):
    return quant.quantize_per_group(
        x.astype(jnp.float32), group_size, dtype, expansion=expansion)

  def init_fn(params):
    coat_adam._check_floating(params, 'params')  # pylint: disable=protected-access
    state = inner.init(params)
    mirrors = _mirror_test(params)
    # As in coat_adamw: without the barrier XLA constant-folds the
    # quantization of zero states (slow to compile for big leaves). Params
    # in nnx Variables: FP8 leaves in the layout nnx.Optimizer keeps.
    return moments.nnx_layout(jax.tree.map(
        lambda x: jax.tree.map(quantize, jax.lax.optimization_barrier(x))
        if mirrors(x) else x, state, is_leaf=mirrors))

  def update_fn(updates, state, params=None, **extra_args):
    treedef = jax.tree.structure(updates)
    mirrors = _mirror_test(updates)
    # The inner state's layout, from its init on the updates' shapes; the
    # stored state may hold each FP8 leaf in another container (nnx State).
    layout = jax.eval_shape(inner.init, updates)
    outer = jax.tree.structure(layout, is_leaf=mirrors)
    is_fp8 = [mirrors(x) for x in outer.flatten_up_to(layout)]
    try:
      stored = outer.flatten_up_to(state)
    except (ValueError, TypeError):
      raise moments.mismatch_error(updates, state, 'state') from None
    olds = [moments.per_param(updates, s) if f else None
            for s, f in zip(stored, is_fp8)]
    floats = outer.flatten_up_to(layout)

    def dequantize(old, like):
      return treedef.unflatten([
          quant.dequantize(moments.as_quantized(q, group_size)).astype(
              a.dtype)
          for q, a in zip(old, treedef.flatten_up_to(like))])

    inner_state = outer.unflatten([
        dequantize(old, like) if f else s
        for s, old, like, f in zip(stored, olds, floats, is_fp8)])
    updates, new = optax.with_extra_args_support(inner).update(
        updates, inner_state, params, **extra_args)

    def requantize(x, old):
      return treedef.unflatten([
          moments.like(quantize(a), q)
          for a, q in zip(treedef.flatten_up_to(x), old)])

    return updates, outer.unflatten([
        requantize(x, old) if f else x
        for x, old, f in zip(outer.flatten_up_to(new), olds, is_fp8)])

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
