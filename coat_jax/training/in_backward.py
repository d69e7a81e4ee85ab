"""A train step that takes each decoder layer's optimizer step inside backward.

The ordinary step (`trainer._train_step`) holds every gradient at once: the
optimizer runs after backward. Here each decoder layer steps as soon as
backward has produced its gradient, which is then dead, so at most a few
layers' gradients are ever live (docs/in_backward.md).

Mechanism. The layers' optimizer state travels through the loss as a
*carrier*: (stacked layer params, their FP8 first and second moments, and
two float32 scalars: the running sum of squares of the layer gradients and
whether the loss is finite). Each layer i passes the carrier through a
`jax.custom_vjp` identity (`_layer_hook`) that also returns its slice of the
stacked params, which the layer reads (`Decoder.hidden_states`' `layers=`).
The loss leaves through another identity (`_seal`) that takes the carrier.
In backward the carrier's *cotangent* is the optimizer state: `_seal`'s
backward starts it from the (unchanged) state, each hook's backward receives
it with the layer's gradient, steps layer i of the stacks (in place: the
Pallas kernel's `layer=`, or a dynamic-update-slice) and hands it on; the
cotangent `jax.grad` returns for the carrier is the stepped state.
The other params (embeddings, final norm and LM head; a VLM's vision tower
and projector too) step after backward, as usual. train.py takes this step
with `optim.apply_in_backward=true` (`trainer.build`).

Invariants:
  * Each layer's step is that of `fused_coat_adamw` on the ordinary step's
    gradient, with the same learning rate, bias-correction count and
    gradient scale: with clip 'none' (or a clip norm that never bites) the
    step equals the ordinary fused step up to float rounding.
  * The gradient scale is known before backward, so clipping cannot use this
    step's global norm: clip 'previous' scales every gradient by
    min(1, clip_norm / n) with n the global norm of the last finite step (0,
    i.e. no clipping, at the first step), kept in the optimizer state
    (`PreviousNormState`); clip 'none' scales by 1.
  * Non-finite values: a layer steps iff the loss and its own gradient are
    finite. The other params, the step count and the learning-rate
    schedule step iff the loss and the whole gradient are finite;
    otherwise the step counts as non-finite (`state['nonfinite']`,
    metrics['finite'] False) though layers whose gradients were finite did
    step. A non-finite loss (the usual fault) therefore changes no param.
  * One device, unrolled layers, one microbatch (`check_supported`).
  * With `offload` (train.offload='optimizer') the optimizer state stays in
    pinned host memory: each layer's moments come to the device for its
    step and go back, so at most a few layers' moments are on the device.
"""

from collections.abc import Callable
import functools
from typing import Any
from typing import NamedTuple

from flax import nnx
import jax
import jax.numpy as jnp
import optax

from coat_jax.models.decoder import LayerFeed
from coat_jax.optim import fused
from coat_jax.optim import moments
from coat_jax.optim.coat_adam import ScaleByCoatAdamState
from pallas_kernels.coat_adam_step import api as fused_step

# How the in-backward step clips (`optim.in_backward_clip`): by the previous
# step's global gradient norm, or not at all.
CLIPS = ('previous', 'none')


class PreviousNormState(NamedTuple):
  """State of `clip_by_previous_norm`: `norm`, float32 scalar, the global
  gradient norm of the last step whose norm was finite (0 before any)."""

  norm: jax.Array


def clip_by_previous_norm(max_norm: float) -> optax.GradientTransformation:
  """Scales the updates by min(1, max_norm / n), n the global norm of the
  previous updates that were finite (no scaling at the first step), and
  records this step's norm if finite.

  The clipping of the in-backward step, as an optax transformation: its
  state is the one that step keeps (`make_train_step`), and a chain with it
  runs the same clipping through `tx.update`.
  """
  if not max_norm > 0:
    raise ValueError(f'max_norm={max_norm!r} must be positive.')

  def init(params):
    del params
    return PreviousNormState(jnp.zeros((), jnp.float32))

  def update(updates, state, params=None):
    del params
    norm = optax.tree.norm(updates)
    scale = fused.clip_scale(state.norm, max_norm)
    updates = jax.tree.map(lambda g: (g * scale).astype(g.dtype), updates)
    return updates, PreviousNormState(
        jnp.where(jnp.isfinite(norm), norm, state.norm).astype(jnp.float32))

  return optax.GradientTransformation(init, update)


def clipping(clip: str, max_norm: float) -> optax.GradientTransformation:
  """The clipping transformation that goes before AdamW in the optimizer
  of an in-backward step: `clip_by_previous_norm` ('previous') or none
  ('none', `optax.identity`, whose state is that of optax's global-norm
  clipping)."""
  if clip == 'previous':
    return clip_by_previous_norm(max_norm)
  _check_clip(clip)
  return optax.identity()


def _check_clip(clip: str) -> None:
  if clip not in CLIPS:
    raise ValueError(f'clip={clip!r} must be one of {CLIPS}: in-backward'
                     " steps cannot clip by the step's own global norm.")


def check_supported(*, fused_optimizer: bool, scan_layers: bool,
                    microbatches: int, num_devices: int) -> None:
  """Raises ValueError naming the setting to change where an in-backward
  step cannot run."""
  problems = [
      (not fused_optimizer, 'needs the fused optimizer (optim.name='
       'coat_adamw with FP8 moments, optim.fused unset or true)'),
      (scan_layers, 'needs unrolled layers (model.scan_layers=false)'),
      (microbatches != 1, 'steps once per batch, so it cannot accumulate'
       f' microbatches (train.microbatches={microbatches}: set 1)'),
      (num_devices != 1, f'runs on one device ({num_devices} given: make'
       ' one visible, e.g. CUDA_VISIBLE_DEVICES=0)')]
  for bad, why in problems:
    if bad:
      raise ValueError(f'optim.apply_in_backward=true {why}.')


def make_train_step(
    task: Any, graphdef: Any, *, learning_rate: optax.ScalarOrSchedule,
    b1: float, b2: float, eps: float, weight_decay: float,
    mask: Any | Callable[[optax.Params], Any] | None = None,
    group_size: int = 128, expansion: bool = True, clip: str = 'previous',
    clip_norm: float = 1.0, implementation: str | None = None,
    offload: bool = False,
) -> Callable[..., tuple[Any, dict]]:
  """`train_step(state, *batch) -> (state, metrics)`, each decoder layer
  stepping inside backward.

  Args:
    task: a `tasks.Task`: its `loss` (model, *batch, layers=...) -> scalar,
      its decoder's layers (`decoder.num_layers`, unrolled) and where they
      sit in the params (`layers_of`, `with_layers`).
    graphdef: the task model's nnx graphdef.
    learning_rate, b1, b2, eps, weight_decay, mask, group_size, expansion,
      implementation: as for `fused_coat_adamw`; `mask` is evaluated on the
      whole params tree (the stacked layer params included).
    clip: one of `CLIPS` (module docstring).
    clip_norm: the clip norm of clip 'previous'.
    offload: the optimizer state is in pinned host memory and stays there
      (train.offload='optimizer'): layer i's moments come to the device in
      backward, step and are written back into the host stacks; the rest of
      the state comes over for the steps after backward and goes back.

  The state is the trainer's: {'params', 'opt_state', 'step', 'nonfinite'}
  with opt_state = (clip state, coat_adamw state), the state of
  `optax.chain(clipping(clip, clip_norm), coat_adamw(...))` with the same
  arguments and FP8 moments. metrics: {'loss', 'grad_norm' (this step's
  global norm, before clipping), 'finite'}. Donate the state under jit.
  """
  _check_clip(clip)
  scalar = lambda x: jnp.asarray(x, jnp.float32)
  layers_of, with_layers = task.layers_of, task.with_layers
  without_layers = lambda tree: with_layers(tree, None)

  def layer_step(i, state, grads, scalars, decay, apply_if):
    """Layer i of the stacked params and moments steps with its grads
    (with `offload`, the moment stacks in host memory: slice i comes to
    the device, steps, and is written back)."""
    params, mu, nu = state
    count, lr, grad_scale = scalars
    treedef = jax.tree.structure(params)
    if offload:
      at_i = lambda tree: jax.tree.map(lambda a: a[i], tree)
      state_i = (at_i(params), *jax.device_put((at_i(mu), at_i(nu)),
                                               jax.memory.Space.Device))
    else:
      state_i = state
    out = [fused_step.coat_adam_step(
        p, g, m, v, count, learning_rate=lr, b1=b1, b2=b2, eps=eps,
        weight_decay=weight_decay if d else None, group_size=group_size,
        expansion=expansion, apply=apply_if, implementation=implementation,
        grad_scale=grad_scale, layer=None if offload else i)
           for p, m, v, g, d in zip(
               *(treedef.flatten_up_to(x) for x in state_i),
               treedef.flatten_up_to(grads), treedef.flatten_up_to(decay),
               strict=True)]
    new = tuple(treedef.unflatten([o[k] for o in out]) for k in range(3))
    if not offload:
      return new
    new_params, *new_moments = new
    put = lambda whole, x: jax.tree.map(lambda a, b: a.at[i].set(b), whole, x)
    on_host = jax.device_put(tuple(new_moments), jax.memory.Space.Host)
    return (put(params, new_params), put(mu, on_host[0]), put(nu, on_host[1]))

  def train_step(state, *batch):
    params = state['params']
    clip_state, (adam, decay_state, lr_state) = state['opt_state']
    if not isinstance(adam, ScaleByCoatAdamState):
      raise TypeError('state["opt_state"] must be (clip state, coat_adamw'
                      f' state), got {type(adam).__name__} in the AdamW'
                      ' slot.')
    if offload:  # the scalars now, the moments later (`layer_step`, below)
      clip_state, decay_state, lr_state, count = jax.device_put(
          (clip_state, decay_state, lr_state, adam.count),
          jax.memory.Space.Device)
      adam = adam._replace(count=count)
    decay = _decay(mask, params)
    stacked = layers_of(params)
    quantized = lambda tree: _as_quantized(stacked, tree, group_size)
    layer_state = (stacked, quantized(layers_of(adam.mu)),
                   quantized(layers_of(adam.nu)))
    count = optax.safe_increment(adam.count)  # this step's, for the math
    lr = (learning_rate(lr_state.count) if callable(learning_rate)
          else learning_rate)
    grad_scale = (scalar(1.0) if clip == 'none'
                  else fused.clip_scale(clip_state.norm, clip_norm))
    scalars = (count, scalar(lr), grad_scale)
    step_layer = functools.partial(layer_step, decay=layers_of(decay))
    hook = _layer_hook(step_layer)
    recompute = _recomputed_layer(step_layer)

    def loss_of(rest, carrier):
      # The layers read their params from the carrier through the hook, or
      # under remat 'full' run in `_recomputed_layer` (`LayerFeed`).
      feed = LayerFeed(
          carrier, lambda i, c: hook(i, c, scalars),
          lambda i, c, fn, stream: recompute(i, fn, c, stream, scalars))
      model = nnx.merge(graphdef, with_layers(rest, stacked))
      loss = task.loss(model, *batch, layers=feed)
      return _seal(feed.source, loss)

    carrier = (layer_state, (scalar(0.0), scalar(0.0)))
    value, (grads, carrier) = jax.value_and_grad(
        loss_of, argnums=(0, 1))(without_layers(params), carrier)
    (new_stacked, new_mu, new_nu), (layer_sq, _) = carrier
    norm = jnp.sqrt(layer_sq + _sum_of_squares(grads))
    finite = jnp.isfinite(value) & jnp.isfinite(norm)

    rest_moments = (without_layers(adam.mu), without_layers(adam.nu))
    if offload:  # after backward, as `trainer._train_step` brings them
      grads, rest_moments = jax.lax.optimization_barrier(
          (grads, jax.device_put(rest_moments, jax.memory.Space.Device)))
    apply_rest = fused.fused_coat_adamw(
        learning_rate, b1, b2, eps, weight_decay,
        mask=without_layers(decay), group_size=group_size,
        expansion=expansion, implementation=implementation)
    new_rest, (rest_adam, decay_state, lr_state) = apply_rest(
        grads, (ScaleByCoatAdamState(adam.count, *rest_moments),
                decay_state, lr_state), without_layers(params), finite,
        grad_scale)
    in_container = lambda new, old: jax.tree.map(
        moments.like, new, old, is_leaf=moments.is_moment)
    adam = ScaleByCoatAdamState(
        rest_adam.count,
        with_layers(rest_adam.mu, in_container(new_mu, layers_of(adam.mu))),
        with_layers(rest_adam.nu, in_container(new_nu, layers_of(adam.nu))))
    if clip == 'previous':
      clip_state = PreviousNormState(
          jnp.where(finite, norm, clip_state.norm).astype(jnp.float32))
    opt_state = (clip_state, (adam, decay_state, lr_state))
    if offload:  # the layers' moments are there already
      opt_state = jax.device_put(opt_state, jax.memory.Space.Host)
    new_state = {
        'params': with_layers(new_rest, new_stacked),
        'opt_state': opt_state,
        'step': state['step'] + 1,
        'nonfinite': state['nonfinite'] + (~finite).astype(jnp.int32),
    }
    return new_state, {'loss': value, 'grad_norm': norm, 'finite': finite}

  return train_step


def _layer_hook(layer_step):
  """`hook(i, carrier, scalars) -> (carrier, layer i's params)`: the
  identity on the carrier, and its params' slice i; in backward the
  carrier's cotangent (the layers' state, updated by the layers after i)
  has layer i stepped by `layer_step(i, state, grads, scalars, apply_if)`
  with the cotangent of the slice, its gradient (module docstring)."""

  def forward(i, carrier):
    (params, _, _), _ = carrier
    return carrier, jax.tree.map(lambda a: a[i], params)

  @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
  def hook(i, carrier, scalars):
    del scalars
    return forward(i, carrier)

  def fwd(i, carrier, scalars):
    return forward(i, carrier), scalars

  def bwd(i, scalars, cotangents):
    (state, (sum_sq, loss_finite)), grads = cotangents
    own = _sum_of_squares(grads)
    apply_if = (loss_finite > 0) & jnp.isfinite(own)
    # Layer i's slices are read from the carrier as it arrives: without the
    # barrier XLA reads them from the step's input (the slices are equal),
    # which must then outlive the in-place steps of the layers after i: a
    # copy of every stack.
    state = jax.lax.optimization_barrier(state)
    state = layer_step(i, state, grads, scalars, apply_if=apply_if)
    return (state, (sum_sq + own, loss_finite)), None

  hook.defvjp(fwd, bwd)
  return hook


def _recomputed_layer(layer_step):
  """`run(i, fn, carrier, stream, scalars) -> (carrier, fn(layer i's
  params, stream))`, remat 'full' for an in-backward layer: forward keeps
  only the stream; backward reads layer i's params from the carrier's
  cotangent as it arrives (layer i not stepped yet), recomputes fn there,
  and steps layer i as `_layer_hook` does. A remat of the hook and layer
  would recompute from the forward's carrier instead, which the in-place
  steps of the layers after i overwrite: XLA would keep a copy of every
  stack for it."""

  def forward(i, fn, carrier, stream):
    (params, _, _), _ = carrier
    return carrier, fn(jax.tree.map(lambda a: a[i], params), stream)

  @functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
  def run(i, fn, carrier, stream, scalars):
    del scalars
    return forward(i, fn, carrier, stream)

  def fwd(i, fn, carrier, stream, scalars):
    return forward(i, fn, carrier, stream), (stream, scalars)

  def bwd(i, fn, residuals, cotangents):
    stream, scalars = residuals
    (state, (sum_sq, loss_finite)), stream_cotangent = cotangents
    state = jax.lax.optimization_barrier(state)
    params = jax.tree.map(lambda a: a[i], state[0])
    _, vjp = jax.vjp(fn, params, stream)
    grads, stream_cotangent = vjp(stream_cotangent)
    own = _sum_of_squares(grads)
    apply_if = (loss_finite > 0) & jnp.isfinite(own)
    state = layer_step(i, state, grads, scalars, apply_if=apply_if)
    return ((state, (sum_sq + own, loss_finite)), stream_cotangent,
            jax.tree.map(jnp.zeros_like, scalars))

  run.defvjp(fwd, bwd)
  return run


@jax.custom_vjp
def _seal(carrier, loss):
  """The loss, unchanged; in backward the carrier's cotangent is the
  layers' state as the carrier brought it, with a zero sum of squares and
  whether the loss is finite (1.0 or 0.0)."""
  del carrier
  return loss


def _seal_fwd(carrier, loss):
  return loss, (carrier, loss)


def _seal_bwd(residuals, g):
  (state, (zero, _)), loss = residuals
  finite = jnp.isfinite(loss).astype(jnp.float32)
  return (state, (jnp.zeros_like(zero), finite)), g


_seal.defvjp(_seal_fwd, _seal_bwd)


def _sum_of_squares(tree: Any) -> jax.Array:
  """float32 sum of every element squared."""
  return sum((jnp.sum(jnp.square(x.astype(jnp.float32)))
              for x in jax.tree.leaves(tree)), jnp.zeros((), jnp.float32))


def _decay(mask: Any, params: Any) -> Any:
  """The weight-decay flags of every param (a tree like params)."""
  if mask is None:
    return jax.tree.map(lambda _: True, params)
  return mask(params) if callable(mask) else mask


def _as_quantized(params: Any, tree: Any, group_size: int) -> Any:
  """`tree` (moments mirroring params) with each moment a QuantizedArray;
  raises unless every one is FP8."""
  treedef = jax.tree.structure(params)
  leaves = [moments.as_quantized(m, group_size)
            for m in moments.per_param(params, tree)]
  if not all(moments.is_moment(m) for m in leaves):
    raise ValueError('an in-backward step needs FP8 moments in both slots'
                     ' (moment_dtypes without "float32").')
  return treedef.unflatten(leaves)
