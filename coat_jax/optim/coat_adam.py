"""COAT AdamW: Adam whose moments live in FP8 with dynamic range expansion."""

from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from coat_jax import quant
from coat_jax.optim import moments
from pallas_kernels import _common
from pallas_kernels.coat_adam_update import api as update_op

# The formats a moment may be stored in.
MOMENT_DTYPES = ('e4m3', 'e5m2', 'float32')


class ScaleByCoatAdamState(NamedTuple):
  """State of `scale_by_coat_adam`.

  Attributes:
    count: int32 scalar, the number of steps taken.
    mu: first moments, a tree like the params whose leaves are
      `quant.QuantizedArray`s (groups along each param's last axis), or
      float32 arrays when the moment dtype is 'float32'.
    nu: second moments, the same.
  """

  count: jax.Array
  mu: Any
  nu: Any


def _check_moment_dtypes(moment_dtypes: Any) -> tuple[str, str]:
  if (not isinstance(moment_dtypes, tuple | list) or len(moment_dtypes) != 2
      or any(d not in MOMENT_DTYPES for d in moment_dtypes)):
    raise ValueError(
        f'moment_dtypes={moment_dtypes!r} must be a pair (first moment, second'
        f' moment) of formats from {MOMENT_DTYPES}, e.g. ("e4m3", "e4m3").')
  return tuple(moment_dtypes)


def _check_group_size(group_size: Any) -> int:
  if isinstance(group_size, jax.Array | np.ndarray):
    raise ValueError(
        'group_size must be a Python int, not an array. With'
        ' optax.inject_hyperparams, pass static_args=("group_size",).')
  if (isinstance(group_size, bool) or not isinstance(group_size, int)
      or group_size <= 0):
    raise ValueError(
        f'group_size={group_size!r} must be a positive integer (128 is'
        ' COAT\'s choice for optimizer states).')
  return group_size


def _check_floating(tree: Any, argname: str) -> None:
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
      raise TypeError(
          f'{argname}{jax.tree_util.keystr(path)} has dtype'
          f' {jnp.result_type(leaf)}; coat_adamw only optimizes floating-point'
          ' params. Keep integer leaves out of the optimized tree (e.g. with'
          ' optax.partition or by storing them outside nnx.Param).')


def _is_moment(x: Any) -> bool:
  return moments.is_moment(x)


def _check_updates_match(updates: Any, mus: list) -> None:
  """Raises unless each leaf of `updates` has its moment's shape."""
  for (path, g), m in zip(jax.tree_util.tree_leaves_with_path(updates), mus):
    if jnp.shape(g) != jnp.shape(m):
      raise ValueError(
          f'updates{jax.tree_util.keystr(path)} has shape {jnp.shape(g)} but'
          f' the param it updates has shape {jnp.shape(m)}: the gradients must'
          ' match the params passed to tx.init.')


def _quantizer(moment_dtype: str, group_size: int, expansion: bool):
  if moment_dtype == 'float32':
    return lambda x: x.astype(jnp.float32)
  return lambda x: quant.quantize_per_group(
      x, group_size, moment_dtype, expansion=expansion)


def _dequantize(m: Any) -> jax.Array:
  return quant.dequantize(m) if _is_moment(m) else m


def scale_by_coat_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    group_size: int = 128,
    moment_dtypes: tuple[str, str] = ('e4m3', 'e4m3'),
    expansion: bool = True,
    implementation: str | None = None,
) -> optax.GradientTransformation:
  """Rescales updates by Adam, keeping both moments in FP8 (COAT).

  Each step dequantizes m and v, updates them in float32
  (m = b1 m + (1 - b1) g, v = b2 v + (1 - b2) g^2), returns the bias-corrected
  m_hat / (sqrt(v_hat) + eps) computed from these unquantized moments (in
  the dtype `optax.scale_by_adam` returns: the gradient's, promoted with the
  param's when `params` are given, so bf16 params get bf16 updates), and then
  requantizes m and v in groups of `group_size` along each param's last axis.
  Every param is quantized, whatever its size. With expansion and E4M3 the
  state is 2.125 bytes per param (FP8 codes plus a float32 max and exponent per
  group of 128) against float32 Adam's 8.

  Args:
    b1: decay rate of the first moment.
    b2: decay rate of the second moment.
    eps: added to the denominator.
    group_size: static quantization group size (with
      `optax.inject_hyperparams`, pass `static_args=('group_size',)`).
    moment_dtypes: formats of (m, v): each 'e4m3', 'e5m2' or 'float32';
      ('float32', 'float32') is exactly `optax.scale_by_adam`.
    expansion: use COAT's dynamic range expansion for FP8 moments.
    implementation: how FP8 moments are updated: None (the fastest
      available: one Pallas pass per leaf on one Hopper GPU, the jnp
      reference elsewhere), 'xla' (the reference), or 'pallas' (interpreted
      off GPU, for tests). The Pallas kernel may differ from the reference
      by float rounding (see `pallas_kernels.coat_adam_update`).

  Returns:
    An `optax.GradientTransformation` with `ScaleByCoatAdamState`.
  """
  group_size = _check_group_size(group_size)
  mu_dtype, nu_dtype = _check_moment_dtypes(moment_dtypes)
  if implementation not in _common.IMPLEMENTATIONS:
    raise ValueError(
        f'implementation={implementation!r} must be one of'
        f' {_common.IMPLEMENTATIONS}: None picks the fastest available.')
  fused = 'float32' not in (mu_dtype, nu_dtype)
  quantize_mu = _quantizer(mu_dtype, group_size, expansion)
  quantize_nu = _quantizer(nu_dtype, group_size, expansion)

  def init_fn(params):
    _check_floating(params, 'params')
    zeros = optax.tree.zeros_like(params, dtype=jnp.float32)
    # Without the barrier XLA constant-folds the quantization of the zeros,
    # which took > 8 s per leaf of the 1b model to compile on a GPU.
    zeros = jax.lax.optimization_barrier(zeros)
    # Params in nnx Variables: moments in the layout nnx.Optimizer keeps.
    return ScaleByCoatAdamState(
        count=jnp.zeros([], jnp.int32),
        mu=moments.nnx_layout(jax.tree.map(quantize_mu, zeros)),
        nu=moments.nnx_layout(jax.tree.map(quantize_nu, zeros)),
    )

  def update_fn(updates, state, params=None):
    _check_floating(updates, 'updates')
    treedef = jax.tree.structure(updates)
    # The moments may come back in other containers (nnx.Optimizer hands
    # them back as nnx State mappings): pair them with the updates by the
    # params' tree, and return each new moment in the container it came in.
    old_mu = moments.per_param(updates, state.mu)
    old_nu = moments.per_param(updates, state.nu)
    as_q = lambda m: moments.as_quantized(m, group_size)
    mus, nus = [as_q(m) for m in old_mu], [as_q(v) for v in old_nu]
    _check_updates_match(updates, mus)
    gs = [g.astype(jnp.float32) for g in treedef.flatten_up_to(updates)]
    count_inc = optax.safe_increment(state.count)
    out = [_adam_leaf(g, m, v, count_inc) for g, m, v in zip(gs, mus, nus)]
    new_mu = [moments.like(o[1], m) for o, m in zip(out, old_mu)]
    new_nu = [moments.like(o[2], v) for o, v in zip(out, old_nu)]
    # In the dtype optax's scale_by_adam gives (its moments are the params'
    # dtype): the gradient's and the param's promoted.
    dtypes = [g.dtype for g in treedef.flatten_up_to(updates)]
    if params is not None:
      dtypes = [jnp.promote_types(d, p.dtype)
                for d, p in zip(dtypes, treedef.flatten_up_to(params))]
    new_updates = [o[0].astype(d) for o, d in zip(out, dtypes)]
    return treedef.unflatten(new_updates), ScaleByCoatAdamState(
        count=count_inc, mu=treedef.unflatten(new_mu),
        nu=treedef.unflatten(new_nu))

  def _adam_leaf(g, mu, nu, count):
    """(update, new mu, new nu) of one leaf: optax's scale_by_adam math."""
    if fused:  # the same math, and one Pallas pass per leaf on a GPU
      return update_op.coat_adam_update(
          g, mu, nu, count, b1=b1, b2=b2, eps=eps, group_size=group_size,
          expansion=expansion, implementation=implementation)
    m = optax.tree.update_moment(g, _dequantize(mu), b1, 1)
    v = optax.tree.update_moment_per_elem_norm(g, _dequantize(nu), b2, 2)
    m_hat = optax.tree.bias_correction(m, b1, count)
    v_hat = optax.tree.bias_correction(v, b2, count)
    return m_hat / (jnp.sqrt(v_hat) + eps), quantize_mu(m), quantize_nu(v)

  return optax.GradientTransformation(init_fn, update_fn)


def coat_adamw(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-4,
    mask: Any | Callable[[optax.Params], Any] | None = None,
    *,
    group_size: int = 128,
    moment_dtypes: tuple[str, str] = ('e4m3', 'e4m3'),
    expansion: bool = True,
    implementation: str | None = None,
) -> optax.GradientTransformation:
  """AdamW with FP8 moments (COAT), a drop-in for `optax.adamw`.

  `chain(scale_by_coat_adam(...), add_decayed_weights(weight_decay, mask),
  scale_by_learning_rate(learning_rate))`, exactly as optax composes `adamw`:
  the decay is decoupled and multiplied by the learning rate, as in PyTorch.

  Args:
    learning_rate: a float or an optax schedule.
    b1: decay rate of the first moment.
    b2: decay rate of the second moment.
    eps: added to the denominator.
    weight_decay: decoupled weight decay strength.
    mask: tree of bools (or a function of the params returning one) saying
      which params get weight decay; all are quantized regardless.
    group_size: static quantization group size along each param's last axis.
    moment_dtypes: formats of (m, v): 'e4m3', 'e5m2' or 'float32'.
    expansion: use COAT's dynamic range expansion for FP8 moments.
    implementation: None (fastest available), 'xla' or 'pallas', as for
      `scale_by_coat_adam`. Weight decay and the learning rate stay in the
      chain, where XLA fuses them with `optax.apply_updates`.

  Returns:
    An `optax.GradientTransformation`.
  """
  return optax.chain(
      scale_by_coat_adam(
          b1, b2, eps, group_size=group_size, moment_dtypes=moment_dtypes,
          expansion=expansion, implementation=implementation),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate),
  )
