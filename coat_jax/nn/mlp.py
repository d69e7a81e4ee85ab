"""Gated MLPs: down(act(gate(x)) * up(x)), with SwiGLU (Llama) or GeGLU
(Gemma).

With FP8 activations the product saves gate and up as E4M3 groups and
recomputes the activation in backward (`coat_jax.nn.activations`), so no
activation output is kept; the product feeds the down projection, whose FP8
linear layer saves it per-tensor as E4M3.

With FP8 matmuls, FP8 activations and per-tensor scaling `CoatMLP` runs
gate/up and SwiGLU as one custom_vjp (`fp8_gate_up_swiglu`): SwiGLU's
one-pass kernels return max |h|, max |dgate| and max |dup| with their
outputs, and these become the per-tensor scales of the GEMMs that read
those tensors, so no amax pass reads them again (RESULTS.md "e2e-1b").
"""

import functools
from typing import Any

from flax import nnx
import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp

from coat_jax import recipes
from coat_jax.nn import activations
from coat_jax.nn import linear

# checkpoint_name of the gate and up projections' outputs (remat policies).
GATE_UP = 'mlp_gate_up'

ACTIVATIONS = ('silu', 'gelu_tanh')


def swiglu_reference(gate: jax.Array, up: jax.Array) -> jax.Array:
  """silu(gate) * up in the inputs' dtype (plain jnp)."""
  return jax.nn.silu(gate) * up


def _glu(activation: str, gate: jax.Array, up: jax.Array) -> jax.Array:
  """The plain jnp gated activation (autodiff decides what it saves)."""
  if activation == 'silu':
    return swiglu_reference(gate, up)
  return jax.nn.gelu(gate, approximate=True) * up


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _fp8_gate_up_swiglu_2d(x, w_gate, w_up, x_amax, kernel_dtypes,
                           implementation, gather_axes, grad_dtype,
                           group_size):
  return _fp8_gate_up_swiglu_fwd(x, w_gate, w_up, x_amax, kernel_dtypes,
                                 implementation, gather_axes, grad_dtype,
                                 group_size)[0]


def _fp8_gate_up_swiglu_fwd(x, w_gate, w_up, x_amax, kernel_dtypes,
                            implementation, gather_axes, grad_dtype,
                            group_size):
  del grad_dtype  # backward's
  (gate, up), dense_residuals = linear.fp8_dense_2d_fwd(
      x, (w_gate, w_up), x_amax, kernel_dtypes, implementation, gather_axes,
      False)
  out, swiglu_residuals = activations.fp8_swiglu_fwd(gate, up, group_size)
  return out, (dense_residuals, swiglu_residuals)


def _fp8_gate_up_swiglu_bwd(kernel_dtypes, implementation, gather_axes,
                            grad_dtype, group_size, residuals, grads):
  del group_size  # the residuals carry it
  dense_residuals, swiglu_residuals = residuals
  dgate, dup, amax_dgate, amax_dup = activations.fp8_swiglu_grads(
      swiglu_residuals, grads)
  dx, (dw_gate, dw_up), _ = linear.fp8_dense_2d_bwd(
      kernel_dtypes, implementation, gather_axes, False, False,
      dense_residuals, (dgate, dup), grad_amaxes=(amax_dgate, amax_dup),
      grad_dtype=grad_dtype)
  return dx, dw_gate, dw_up, None  # x_amax: a statistic, no gradient


_fp8_gate_up_swiglu_2d.defvjp(_fp8_gate_up_swiglu_fwd,
                              _fp8_gate_up_swiglu_bwd)


def fp8_gate_up_swiglu(
    x: jax.Array, w_gate: jax.Array, w_up: jax.Array, *,
    implementation: str | None = None,
    gather_axes: tuple[Any, Any] | None = None,
    x_amax: jax.Array | None = None, grad_dtype: str = 'e5m2',
    group_size: int = 16,
) -> tuple[jax.Array, jax.Array]:
  """silu(x @ w_gate) * (x @ w_up) as `fp8_dense` (per-tensor scaling) and
  `fp8_swiglu` in one custom_vjp, saving what they save.

  One rule for both lets SwiGLU's backward hand max |dgate| and max |dup|,
  computed in its own pass, to the quantizers of those gradients (a
  cotangent cannot carry them across two custom_vjps): no amax pass over
  them.

  Args:
    x: (..., H) bfloat16 (or float32); H a multiple of 16.
    w_gate, w_up: (H, I) kernels (float32 params); I a multiple of 16.
    implementation: `fp8_matmul`'s implementation.
    gather_axes: None, or the two kernels' logical axis names (FP8
      all-gathers under FSDP, see `fp8_dense`).
    x_amax: max |x| if x's producer computed it, else None (`fp8_dense`).
    grad_dtype: the output gradients' FP8 format (`fp8_dense`).
    group_size: elements per saved FP8 group of gate and up.

  Returns:
    (h (..., I) in x.dtype, max |h| (float32 scalar, no gradient): the down
    projection's `x_amax`).
  """
  kernels = (w_gate, w_up)
  linear.check_fp8_dense_args(x, kernels, gather_axes)
  x2, rows = linear.fp8_rows(x)
  h, h_amax = _fp8_gate_up_swiglu_2d(
      x2, w_gate, w_up, linear.given_amax(x_amax),
      tuple(jnp.dtype(w.dtype) for w in kernels), implementation,
      gather_axes, grad_dtype, group_size)
  return h[:rows].reshape(x.shape[:-1] + (h.shape[1],)), h_amax


class CoatMLP(nnx.Module):
  """Gated MLP without biases: down(act(gate(x)) * up(x)), act SiLU
  (SwiGLU: Llama, Mistral, Qwen, OLMo) or tanh-GELU (GeGLU: Gemma).

  Params: gate_proj and up_proj kernels (in_features, hidden_features),
  down_proj kernel (hidden_features, in_features), all `param_dtype`.
  gate and up read one quantized copy of x.

  Args:
    in_features: model width H (a multiple of 16 with FP8 matmuls).
    hidden_features: intermediate width I (a multiple of 16 with FP8
      matmuls).
    dtype: computation dtype (bfloat16).
    param_dtype: parameter dtype (float32).
    recipe: a `coat_jax.Recipe` or a preset name (default `recipes.COAT`).
    activation: 'silu' (SwiGLU) or 'gelu_tanh' (GeGLU).
    kernel_init: initializer of the three kernels.
    implementation: `fp8_matmul` implementation ('xla', 'pallas', None).
    rngs: random number generators.
    precision: the older name of `recipe` (a preset name).
  """

  def __init__(
      self,
      in_features: int,
      hidden_features: int,
      *,
      dtype: Any = jnp.bfloat16,
      param_dtype: Any = jnp.float32,
      recipe: recipes.Recipe | str | None = None,
      activation: str = 'silu',
      kernel_init: Any = linear.default_kernel_init,
      implementation: str | None = None,
      rngs: nnx.Rngs,
      precision: str | None = None,
  ):
    recipe = recipes.from_arguments(recipe, precision)
    if activation not in ACTIVATIONS:
      raise ValueError(f'activation={activation!r} must be one of'
                       f' {ACTIVATIONS}.')
    recipe.check_size('in_features', in_features)
    recipe.check_size('hidden_features', hidden_features)
    kwargs = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype,
                  recipe=recipe, kernel_init=kernel_init,
                  implementation=implementation, rngs=rngs)
    self.gate_proj = linear.CoatLinear(
        in_features, hidden_features, kernel_axes=('embed', 'mlp'), **kwargs)
    self.up_proj = linear.CoatLinear(
        in_features, hidden_features, kernel_axes=('embed', 'mlp'), **kwargs)
    self.down_proj = linear.CoatLinear(
        hidden_features, in_features, kernel_axes=('mlp', 'embed'), **kwargs)
    self.recipe = recipe
    self.activation = activation

  def __call__(self, x: jax.Array, *, x_amax: jax.Array | None = None,
               residual: jax.Array | None = None,
               grad_amax_slot: bool = False
               ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """(..., in_features) -> (..., in_features) in `dtype`. x_amax: max |x|
    if x's producer computed it (`fp8_dense`). residual: None, or (...,
    in_features) added to the output in the down projection (`CoatLinear`):
    a pre-norm block's skip connection. grad_amax_slot: return (output,
    the down projection's slot) (`fp8_dense`)."""
    r = self.recipe
    down = functools.partial(self.down_proj, residual=residual,
                             grad_amax_slot=grad_amax_slot)
    fp8_swiglu = r.fp8_activations and self.activation == 'silu'
    if fp8_swiglu and r.fp8_matmuls and r.scaling == 'tensor':
      kernels, gather_axes = linear.layer_kernels(
          [self.gate_proj, self.up_proj])
      h, h_amax = fp8_gate_up_swiglu(
          x.astype(self.gate_proj.compute_dtype(x)), *kernels,
          implementation=self.gate_proj.implementation,
          gather_axes=gather_axes, x_amax=x_amax, grad_dtype=r.grad_dtype,
          group_size=r.activation_group_size)
      return down(h, x_amax=h_amax)
    gate, up = checkpoint_name(
        linear.fanout(x, [self.gate_proj, self.up_proj], x_amax=x_amax),
        GATE_UP)
    if fp8_swiglu:
      h, h_amax = activations.fp8_swiglu_with_amax(
          gate, up, group_size=r.activation_group_size)
      return down(h, x_amax=h_amax)
    if r.fp8_activations:  # GeGLU
      return down(activations.geglu(gate, up,
                                    group_size=r.activation_group_size))
    return down(_glu(self.activation, gate, up))
