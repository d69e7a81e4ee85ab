"""`FusedCoatAdamW`: an `nnx.Optimizer` whose update is COAT AdamW's fused
in-place step.

`nnx.Optimizer(model, coat_adamw(...))` computes updates with optax and adds
them with `optax.apply_updates`: under jit the gradients, the clipped
gradients and the updates are each a param-sized float32 tree, and every
param, moment and update is read and written in passes of their own.
`FusedCoatAdamW` keeps that optimizer's state, step for step the same, and
updates each param and its two FP8 moments in one pass
(`fused_coat_adamw`: the Pallas kernel on a Hopper GPU, in place where the
state is donated; its jnp reference elsewhere). Global-norm clipping enters
that pass as a gradient scale, so no clipped copy of the gradients is
written.
"""

from collections.abc import Callable
from typing import Any

from flax import nnx
import optax

from coat_jax.optim.coat_adam import coat_adamw
from coat_jax.optim.fused import clip_scale
from coat_jax.optim.fused import fused_coat_adamw


class FusedCoatAdamW(nnx.Optimizer):
  """`nnx.Optimizer(model, coat_adamw(...), wrt=wrt)`, optionally after
  `optax.clip_by_global_norm(clip_norm)`, updated by the fused step.

  The state (`opt_state`, `step`) is exactly that of `nnx.Optimizer` with
  `tx = optax.chain(optax.clip_by_global_norm(clip_norm), coat_adamw(...))`
  (or `coat_adamw(...)` alone without `clip_norm`), so checkpoints are
  interchangeable with it, and `update` gives its result up to float
  rounding of the fused arithmetic.

  Usage, as for `nnx.Optimizer`:

    optimizer = coat_jax.optim.FusedCoatAdamW(
        model, 3e-4, b2=0.95, weight_decay=0.1, clip_norm=1.0)

    @nnx.jit(donate_argnums=(0, 1))
    def train_step(model, optimizer, batch):
      loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
      optimizer.update(model, grads)
      return loss

  Donate the model and the optimizer (as above, or their `nnx.split` state
  under `jax.jit`) so the kernel writes params and moments in place.

  Args:
    model: the NNX module whose `wrt` variables this optimizer updates.
    learning_rate, b1, b2, eps, weight_decay, mask, group_size, expansion,
      implementation: as for `coat_adamw` (FP8 E4M3 moments in both slots).
    clip_norm: None, or clip the gradients to this global norm first.
    wrt: the variables to update (`nnx.Param` by default).
  """

  def __init__(
      self,
      model: nnx.Module,
      learning_rate: optax.ScalarOrSchedule,
      b1: float = 0.9,
      b2: float = 0.999,
      eps: float = 1e-8,
      weight_decay: float = 1e-4,
      mask: Any | Callable[[optax.Params], Any] | None = None,
      *,
      clip_norm: float | None = None,
      group_size: int = 128,
      expansion: bool = True,
      implementation: str | None = None,
      wrt: Any = nnx.Param,
  ):
    if clip_norm is not None and not clip_norm > 0:
      raise ValueError(f'clip_norm={clip_norm!r} must be positive, or None'
                       ' for no clipping.')
    adamw = coat_adamw(learning_rate, b1, b2, eps, weight_decay, mask,
                       group_size=group_size, expansion=expansion,
                       implementation=implementation)
    tx = (adamw if clip_norm is None else
          optax.chain(optax.clip_by_global_norm(clip_norm), adamw))
    super().__init__(model, tx, wrt=wrt)
    self.clip_norm = clip_norm
    self.fused_step = fused_coat_adamw(
        learning_rate, b1, b2, eps, weight_decay, mask,
        group_size=group_size, expansion=expansion,
        implementation=implementation)

  def update(self, model: nnx.Module, grads: Any, /, **kwargs) -> None:
    """Steps `model`'s `wrt` variables with `grads` (an `nnx.State` or
    module-shaped tree of them, as `nnx.grad` returns) in one fused pass
    per param; the state steps as `nnx.Optimizer.update`'s would."""
    if kwargs:
      raise TypeError(f'FusedCoatAdamW.update takes no keyword arguments'
                      f' (got {sorted(kwargs)}): they are for optax'
                      ' transformations that read extra arguments.')
    params = nnx.as_pure(nnx.state(model, self.wrt))
    grads = nnx.as_pure(nnx.state(grads, self.wrt))
    state = nnx.as_pure(self.opt_state)
    if self.clip_norm is None:
      new_params, new_state = self.fused_step(grads, state, params)
    else:
      clip_state, adam_state = state
      scale = clip_scale(optax.tree.norm(grads), self.clip_norm)
      new_params, adam_state = self.fused_step(grads, adam_state, params,
                                               grad_scale=scale)
      new_state = (clip_state, adam_state)
    nnx.update(model, new_params)
    nnx.update(self.opt_state, nnx.state(new_state))
    self.step[...] += 1
