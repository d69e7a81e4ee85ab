"""COAT AdamW as one fused pass per leaf: param, grad, m, v in; param, m, v out.

`coat_adamw` is an optax transformation: it returns updates, which
`optax.apply_updates` then adds, so an XLA step reads and writes every param
and update twice more. `fused_coat_adamw` gives the same step on the same
state as one call per leaf to `pallas_kernels.coat_adam_step` (the Pallas
kernel on a Hopper GPU, its jnp reference elsewhere).
"""

from collections.abc import Callable
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import optax

from coat_jax.optim import moments
from coat_jax.optim.coat_adam import ScaleByCoatAdamState
from pallas_kernels import _common
from pallas_kernels.coat_adam_step import api as fused_step


def clip_scale(norm: jax.Array, max_norm: float) -> jax.Array:
  """min(1, max_norm / norm) as a float32 scalar: global-norm clipping as
  the `grad_scale` of `fused_coat_adamw`'s step (1 where norm is below
  max_norm, norm 0 included), as `optax.clip_by_global_norm` scales."""
  return jnp.where(norm < max_norm, 1.0, max_norm / norm).astype(jnp.float32)


def fused_coat_adamw(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-4,
    mask: Any | Callable[[optax.Params], Any] | None = None,
    *,
    group_size: int = 128,
    expansion: bool = True,
    implementation: str | None = None,
) -> Callable[[Any, Any, Any], tuple[Any, Any]]:
  """`apply(grads, state, params, apply_if=True, grad_scale=1.0, specs=None)
  -> (new_params, new_state)`.

  The state is that of `coat_adamw(...)` with the same arguments (FP8
  moments in both slots); the result equals `tx.update` followed by
  `optax.apply_updates` up to float rounding of the fused arithmetic. Under
  `jax.jit`, donate params and state so the kernel updates them in place.

  Args:
    learning_rate, b1, b2, eps, weight_decay, mask, group_size, expansion:
      as for `coat_adamw`.
    implementation: None (the fastest available), 'xla' or 'pallas'.

  `apply_if` (a bool scalar, e.g. whether the gradients are finite) False
  skips the step: params and state come back unchanged, count included. The
  kernel then writes nothing, so it stays in place, where a `jnp.where` on
  its results would keep the old state alive and copy it. `grad_scale` (a
  float32 scalar) multiplies the gradients inside the pass: global-norm
  clipping as `min(1, max_norm / norm)` without writing scaled gradients.

  `grads` mirrors `params`, except that a stacked leaf (L, ...) may get a
  tuple of L per-layer gradients instead (unrolled layers sliced from a
  stack): where the Pallas kernel runs, each layer then takes its step in
  place in the stacked param and moments, and no stacked copy of the
  gradients is ever written; XLA's version stacks them first.

  `specs` (a tree like params of `PartitionSpec`s over the mesh of the
  caller's `jax.set_mesh`, as the state is placed) lets the kernel run on
  several devices: each device steps its own shard of every leaf inside
  `jax.shard_map` (a bare pallas_call under a multi-device jit would be
  replicated), where otherwise XLA's version runs. It takes effect with
  implementation 'pallas', or None on GPUs that run the Pallas kernels, for
  each leaf whose spec keeps the moments' groups whole on every device (a
  sharded last axis split into whole groups; a stack's layer axis not
  sharded). The step is elementwise within a group, so the results are
  those of the kernel on the whole arrays.
  """

  def apply(grads, state, params, apply_if=True, grad_scale=1.0, specs=None):
    adam, decay_state, lr_state = state
    if not isinstance(adam, ScaleByCoatAdamState):
      raise TypeError('state must come from coat_adamw(...).init, got'
                      f' {type(adam).__name__} in its first slot.')
    step = lambda c: jnp.where(apply_if, optax.safe_increment(c), c)
    count = optax.safe_increment(adam.count)  # this step's, for the math
    if callable(learning_rate):
      lr = learning_rate(lr_state.count)
      lr_state = lr_state._replace(count=step(lr_state.count))
    else:
      lr = learning_rate
    if mask is None:
      decay = jax.tree.map(lambda _: True, params)
    else:
      decay = mask(params) if callable(mask) else mask
    treedef = jax.tree.structure(params)
    old_mu = moments.per_param(params, adam.mu)
    old_nu = moments.per_param(params, adam.nu)
    as_q = lambda m: moments.as_quantized(m, group_size)
    mus, nus = [as_q(m) for m in old_mu], [as_q(v) for v in old_nu]
    if not all(moments.is_moment(m) for m in mus + nus):
      raise ValueError('fused_coat_adamw needs FP8 moments in both slots'
                       ' (moment_dtypes without "float32").')

    scalars = (count, lr, apply_if, grad_scale)
    # shard_map takes arrays: the same scalars on every device.
    scalar_arrays = tuple(jnp.asarray(x) for x in scalars)

    def step_leaf(p, g, m, v, d, spec):
      """One leaf's step; with `spec`, the kernel on each device's shard."""
      impl = implementation if spec is None else 'pallas'

      def kernel_step(p, g, m, v, scalars, layer=None):
        count, lr, apply_if, grad_scale = scalars
        return fused_step.coat_adam_step(
            p, g, m, v, count, learning_rate=lr, b1=b1, b2=b2, eps=eps,
            weight_decay=weight_decay if d else None, group_size=group_size,
            expansion=expansion, apply=apply_if, implementation=impl,
            grad_scale=grad_scale, layer=layer)

      def run(p, g, m, v, layer=None):
        if spec is None:
          return kernel_step(p, g, m, v, scalars, layer)
        g_spec = spec if layer is None else P(*spec[1:])
        return jax.shard_map(
            functools.partial(kernel_step, layer=layer),
            in_specs=(spec, g_spec, spec, spec, P()),
            out_specs=(spec, spec, spec), check_vma=False)(
                p, g, m, v, scalar_arrays)

      if not isinstance(g, tuple | list):
        return run(p, g, m, v)
      if p.ndim < 1 or len(g) != p.shape[0]:
        raise ValueError(
            f'grads hold {len(g)} per-layer gradients for a param of shape'
            f' {p.shape}: a stacked param (L, ...) takes exactly L.')
      if not fused_step.runs_kernel(p.dtype, group_size, impl):
        # The jnp step would rewrite the whole stack for each layer; XLA
        # did so in a transposed copy of it under data parallelism
        # (docs/decisions.md#comment-figures).
        return run(p, jnp.stack(g), m, v)
      for layer, g_layer in enumerate(g):  # in place, layer by layer
        p, m, v = run(p, g_layer, m, v, layer)
      return p, m, v

    mesh = _shard_mesh(specs, implementation)
    spec_leaves = (treedef.flatten_up_to(specs) if mesh is not None
                   else [None] * treedef.num_leaves)
    out = []
    for p, g, m, v, d, spec in zip(
        jax.tree.leaves(params), moments.per_param(params, grads), mus, nus,
        treedef.flatten_up_to(decay), spec_leaves, strict=True):
      if spec is not None and not _whole_groups(
          spec, p, isinstance(g, tuple | list), mesh, group_size):
        spec = None
      if spec is None and not fused_step.runs_kernel(
          p.dtype, group_size, implementation):
        # XLA's steps: one leaf after the other, each once its gradient
        # exists. Otherwise XLA decoded the moments during backward (into
        # four byte masks an element, alive at the step's peak) and
        # stacked several leaves' gradients at once
        # (docs/decisions.md#comment-figures). The kernel steps in place.
        out[-1:], (p, g, m, v) = jax.lax.optimization_barrier(
            (out[-1:], (p, g, m, v)))
      out.append(step_leaf(p, g, m, v, d, spec))
    new = lambda i, old: treedef.unflatten(
        [moments.like(o[i], m) for o, m in zip(out, old)])
    kept_count = jnp.where(apply_if, count, adam.count)
    params = treedef.unflatten([o[0] for o in out])
    return params, (ScaleByCoatAdamState(
        kept_count, new(1, old_mu), new(2, old_nu)),
                    decay_state, lr_state)

  return apply


def _shard_mesh(specs: Any, implementation: str | None):
  """The caller's mesh if `specs` are given and its devices run the Pallas
  step on their shards (several devices; 'pallas', or None on GPUs that run
  the kernels), else None."""
  mesh = jax.sharding.get_abstract_mesh()
  if specs is None or mesh.empty or mesh.size == 1:
    return None
  if implementation == 'pallas' or (implementation is None
                                    and _common.gpus_run_pallas()):
    return mesh
  return None


def _whole_groups(spec: P, param: jax.Array, per_layer: bool, mesh,
                  group_size: int) -> bool:
  """Whether the kernel can step `param` (with its moments) shard by shard
  under `spec`: a fusable float32 leaf, every sharded axis divisible, the
  last one into whole groups, and, for per-layer gradients, the layer axis
  whole."""
  if not fused_step.runs_kernel(param.dtype, group_size, 'pallas'):
    return False
  entries = tuple(spec) + (None,) * (param.ndim - len(spec))
  if len(entries) != param.ndim or (per_layer and entries[0] is not None):
    return False
  for axis, (names, size) in enumerate(zip(entries, param.shape)):
    if names is None:
      continue
    names = names if isinstance(names, tuple) else (names,)
    shards = math.prod(mesh.shape[n] for n in names)
    if size % shards or (axis == param.ndim - 1
                         and (size // shards) % group_size):
      return False
  return True
