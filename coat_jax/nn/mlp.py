"""SwiGLU MLP: down(silu(gate(x)) * up(x)).

`fp8_swiglu` is a custom_vjp for silu(gate) * up that saves gate and up as
E4M3 1x16 groups (power-of-two E8M0 scales) and recomputes silu in backward,
so no silu output is kept. The product feeds the down projection, whose FP8
linear layer saves it per-tensor as E4M3.

In 'coat' mode with per-tensor scaling `CoatMLP` runs gate/up and SwiGLU as
one custom_vjp (`fp8_gate_up_swiglu`): SwiGLU's one-pass kernels return
max |h|, max |dgate| and max |dup| with their outputs, and these become the
per-tensor scales of the GEMMs that read those tensors, so no amax pass
reads them again (1b coat step on an H200: 185.4 -> 180.8 ms with the Pallas
kernels, RESULTS.md "e2e-1b").
"""

import functools
from typing import Any

from flax import nnx
import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp

from coat_jax.nn import fsdp
from coat_jax.nn import linear
from coat_jax.nn import precision as precision_lib
from coat_jax.nn.residuals import after_grads
from coat_jax.nn.residuals import with_residuals
from coat_jax.quant import QuantizedArray
from pallas_kernels.swiglu_fp8 import api as swiglu_fp8_api

# checkpoint_name of the gate and up projections' outputs (remat policies).
GATE_UP = 'mlp_gate_up'


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
  """Reference silu(gate) * up in the inputs' dtype (plain jnp)."""
  return jax.nn.silu(gate) * up


@jax.custom_vjp
def _fp8_swiglu(gate, up):
  return _fp8_swiglu_fwd(gate, up)[0]


def _fp8_swiglu_fwd(gate, up):
  """((h, amax |h|), residuals): the amax, a statistic without gradient,
  is the down projection's per-tensor scale."""
  def kernel(gate, up, *, implementation):
    h, gate_q, up_q, h_amax = swiglu_fp8_api.swiglu_fp8_fwd(
        gate, up, group_size=precision_lib.GROUP_SIZE,
        scale_dtype=precision_lib.ACTIVATION_SCALE_DTYPE,
        implementation=implementation)
    return h, *gate_q, *up_q, h_amax
  rows = fsdp.ROWS
  h, *groups, h_amax = fsdp.row_wise(kernel, (gate, up), (rows, rows),
                                     (rows,) * 5 + (fsdp.MAX,))
  gate_q, up_q = (QuantizedArray(*q, None, precision_lib.GROUP_SIZE)
                  for q in (groups[:2], groups[2:]))
  return with_residuals((h, h_amax), (gate_q, up_q))


def _swiglu_grads(residuals, grads):
  """(dgate, dup, amax |dgate|, amax |dup|) from `_fp8_swiglu_fwd`'s
  residuals and the gradients of (h, amax |h|) (the amax has none)."""
  dh, _ = grads
  (gate_q, up_q), dh = after_grads(residuals, dh)

  def kernel(gate_codes, gate_scales, up_codes, up_scales, dh, *,
             implementation):
    return swiglu_fp8_api.swiglu_fp8_bwd(
        (gate_codes, gate_scales), (up_codes, up_scales), dh,
        group_size=gate_q.group_size, implementation=implementation)
  rows = fsdp.ROWS
  return fsdp.row_wise(
      kernel, (gate_q.values, gate_q.scale, up_q.values, up_q.scale, dh),
      (rows,) * 5, (rows, rows, fsdp.MAX, fsdp.MAX))


def _fp8_swiglu_bwd(residuals, grads):
  return _swiglu_grads(residuals, grads)[:2]


_fp8_swiglu.defvjp(_fp8_swiglu_fwd, _fp8_swiglu_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _fp8_gate_up_swiglu_2d(x, w_gate, w_up, x_amax, kernel_dtypes,
                           implementation, gather_axes):
  return _fp8_gate_up_swiglu_fwd(x, w_gate, w_up, x_amax, kernel_dtypes,
                                 implementation, gather_axes)[0]


def _fp8_gate_up_swiglu_fwd(x, w_gate, w_up, x_amax, kernel_dtypes,
                            implementation, gather_axes):
  (gate, up), dense_residuals = linear.fp8_dense_2d_fwd(
      x, (w_gate, w_up), x_amax, kernel_dtypes, implementation, gather_axes,
      False)
  out, swiglu_residuals = _fp8_swiglu_fwd(gate, up)
  return out, (dense_residuals, swiglu_residuals)


def _fp8_gate_up_swiglu_bwd(kernel_dtypes, implementation, gather_axes,
                            residuals, grads):
  dense_residuals, swiglu_residuals = residuals
  dgate, dup, amax_dgate, amax_dup = _swiglu_grads(swiglu_residuals, grads)
  dx, (dw_gate, dw_up), _ = linear.fp8_dense_2d_bwd(
      kernel_dtypes, implementation, gather_axes, False, False,
      dense_residuals,
      (dgate, dup), grad_amaxes=(amax_dgate, amax_dup))
  return dx, dw_gate, dw_up, None  # x_amax: a statistic, no gradient


_fp8_gate_up_swiglu_2d.defvjp(_fp8_gate_up_swiglu_fwd,
                              _fp8_gate_up_swiglu_bwd)


def fp8_gate_up_swiglu(
    x: jax.Array, w_gate: jax.Array, w_up: jax.Array, *,
    implementation: str | None = None,
    gather_axes: tuple[Any, Any] | None = None,
    x_amax: jax.Array | None = None,
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
      gather_axes)
  return h[:rows].reshape(x.shape[:-1] + (h.shape[1],)), h_amax


def fp8_swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
  """silu(gate) * up, saving gate and up as FP8 1x16 groups.

  Args:
    gate: (..., I) bfloat16 (or float32), I a multiple of 16.
    up: same shape and dtype as gate.

  Returns:
    (..., I) in gate.dtype, computed in float32 from the exact inputs.
    Saved: 2 x (I bytes + I/16 one-byte scales) per row; silu is recomputed.
  """
  return fp8_swiglu_with_amax(gate, up)[0]


def fp8_swiglu_with_amax(gate: jax.Array,
                         up: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(`fp8_swiglu(gate, up)`, its max |.| as a float32 scalar without
  gradient, from the same pass: the down projection's `x_amax`)."""
  if gate.shape != up.shape or gate.dtype != up.dtype:
    raise ValueError(f'gate {gate.shape} {gate.dtype} and up {up.shape}'
                     f' {up.dtype} must have the same shape and dtype.')
  if not jnp.issubdtype(gate.dtype, jnp.floating):
    raise TypeError(f'gate has dtype {gate.dtype}; SwiGLU needs floats.')
  precision_lib.check_fp8_size('gate.shape[-1]', gate.shape[-1], 'coat')
  return _fp8_swiglu(gate, up)


class CoatMLP(nnx.Module):
  """SwiGLU MLP without biases (Llama): down(silu(gate(x)) * up(x)).

  Params: gate_proj and up_proj kernels (in_features, hidden_features),
  down_proj kernel (hidden_features, in_features), all `param_dtype`.
  gate and up read one quantized copy of x.

  Args:
    in_features: model width H (a multiple of 16 in FP8 modes).
    hidden_features: intermediate width I (a multiple of 16 in FP8 modes).
    dtype: computation dtype (bfloat16).
    param_dtype: parameter dtype (float32).
    precision: 'bf16', 'fp8_linear' (FP8 matmuls, BF16 SwiGLU) or 'coat'
      (FP8 matmuls and `fp8_swiglu`).
    kernel_init: initializer of the three kernels.
    implementation: `fp8_matmul` implementation ('xla', 'pallas',
      'triton', None).
    scaling: FP8 scaling of the projections, 'tensor' or 'block'.
    fp8_weight_gather: all-gather FSDP-sharded weights as FP8 (CoatLinear).
    rngs: random number generators.
  """

  def __init__(
      self,
      in_features: int,
      hidden_features: int,
      *,
      dtype: Any = jnp.bfloat16,
      param_dtype: Any = jnp.float32,
      precision: str = 'coat',
      kernel_init: Any = linear.default_kernel_init,
      implementation: str | None = None,
      scaling: str = 'tensor',
      fp8_weight_gather: bool = False,
      rngs: nnx.Rngs,
  ):
    precision_lib.check_fp8_size('in_features', in_features, precision)
    precision_lib.check_fp8_size('hidden_features', hidden_features,
                                 precision)
    kwargs = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype,
                  precision=precision, kernel_init=kernel_init,
                  implementation=implementation, scaling=scaling,
                  fp8_weight_gather=fp8_weight_gather, rngs=rngs)
    self.gate_proj = linear.CoatLinear(
        in_features, hidden_features, kernel_axes=('embed', 'mlp'), **kwargs)
    self.up_proj = linear.CoatLinear(
        in_features, hidden_features, kernel_axes=('embed', 'mlp'), **kwargs)
    self.down_proj = linear.CoatLinear(
        hidden_features, in_features, kernel_axes=('mlp', 'embed'), **kwargs)
    self.precision = precision

  def __call__(self, x: jax.Array, *, x_amax: jax.Array | None = None,
               residual: jax.Array | None = None,
               grad_amax_slot: bool = False
               ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """(..., in_features) -> (..., in_features) in `dtype`. x_amax: max |x|
    if x's producer computed it (`fp8_dense`). residual: None, or (...,
    in_features) added to the output in the down projection (`CoatLinear`):
    a pre-norm block's skip connection. grad_amax_slot: return (output,
    the down projection's slot) (`fp8_dense`)."""
    down = functools.partial(self.down_proj, residual=residual,
                             grad_amax_slot=grad_amax_slot)
    if (precision_lib.uses_fp8_activations(self.precision)
        and self.gate_proj.scaling == 'tensor'):
      kernels, gather_axes = linear.layer_kernels(
          [self.gate_proj, self.up_proj])
      h, h_amax = fp8_gate_up_swiglu(
          x.astype(self.gate_proj.dtype), *kernels,
          implementation=self.gate_proj.implementation,
          gather_axes=gather_axes, x_amax=x_amax)
      return down(h, x_amax=h_amax)
    gate, up = checkpoint_name(
        linear.fanout(x, [self.gate_proj, self.up_proj], x_amax=x_amax),
        GATE_UP)
    if precision_lib.uses_fp8_activations(self.precision):
      h, h_amax = fp8_swiglu_with_amax(gate, up)
      return down(h, x_amax=h_amax)
    return down(swiglu(gate, up))
