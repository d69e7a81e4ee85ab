"""SwiGLU MLP: down(silu(gate(x)) * up(x)).

`fp8_swiglu` is a custom_vjp for silu(gate) * up that saves gate and up as
E4M3 1x16 groups (power-of-two E8M0 scales) and recomputes silu in backward,
so no silu output is kept. The product feeds the down projection, whose FP8
linear layer saves it per-tensor as E4M3.
"""

from typing import Any

from flax import nnx
import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp

from coat_jax.nn import linear
from coat_jax.nn import precision as precision_lib
from coat_jax.nn.residuals import after_grads
from coat_jax.nn.residuals import name_fp8_residuals
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
  # XLA by default (faster in the step than the one-pass Pallas kernel,
  # RESULTS.md "kernels-fused"); its amax |h| (out[3]) is unused.
  h, gate_q, up_q, _ = swiglu_fp8_api.swiglu_fp8_fwd(
      gate, up, group_size=precision_lib.GROUP_SIZE,
      scale_dtype=precision_lib.ACTIVATION_SCALE_DTYPE)
  gate_q, up_q = (QuantizedArray(*q, None, precision_lib.GROUP_SIZE)
                  for q in (gate_q, up_q))
  return h, name_fp8_residuals((gate_q, up_q))


def _fp8_swiglu_bwd(residuals, dh):
  (gate_q, up_q), dh = after_grads(residuals, dh)
  dgate, dup, _, _ = swiglu_fp8_api.swiglu_fp8_bwd(
      (gate_q.values, gate_q.scale), (up_q.values, up_q.scale), dh,
      group_size=gate_q.group_size)
  return dgate, dup


_fp8_swiglu.defvjp(_fp8_swiglu_fwd, _fp8_swiglu_bwd)


def fp8_swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
  """silu(gate) * up, saving gate and up as FP8 1x16 groups.

  Args:
    gate: (..., I) bfloat16 (or float32), I a multiple of 16.
    up: same shape and dtype as gate.

  Returns:
    (..., I) in gate.dtype, computed in float32 from the exact inputs.
    Saved: 2 x (I bytes + I/16 one-byte scales) per row; silu is recomputed.
  """
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

  def __call__(self, x: jax.Array) -> jax.Array:
    """(..., in_features) -> (..., in_features) in `dtype`."""
    gate, up = checkpoint_name(
        linear.fanout(x, [self.gate_proj, self.up_proj]), GATE_UP)
    if precision_lib.uses_fp8_activations(self.precision):
      h = fp8_swiglu(gate, up)
    else:
      h = swiglu(gate, up)
    return self.down_proj(h)
