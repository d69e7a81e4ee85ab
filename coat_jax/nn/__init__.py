"""Flax NNX layers whose saved activations are FP8 (COAT).

`CoatLinear`, `CoatRMSNorm`, `CoatMLP` take `precision='bf16' | 'fp8_linear'
| 'coat'`; the functional forms (`fp8_dense`, `fp8_rms_norm`, `fp8_swiglu`)
are `jax.custom_vjp`s whose forward saves only FP8 tensors and tiny scales.
"""

from coat_jax.nn.fp8_matmul import fp8_matmul
from coat_jax.nn.fp8_matmul import fp8_matmul_groups
from coat_jax.nn.linear import CoatLinear
from coat_jax.nn.linear import bf16_dense
from coat_jax.nn.linear import dense
from coat_jax.nn.linear import fanout
from coat_jax.nn.linear import fill_grad_amax_slot
from coat_jax.nn.linear import fp8_dense
from coat_jax.nn.mlp import CoatMLP
from coat_jax.nn.mlp import fp8_gate_up_swiglu
from coat_jax.nn.mlp import fp8_swiglu
from coat_jax.nn.mlp import swiglu
from coat_jax.nn.norm import CoatRMSNorm
from coat_jax.nn.norm import fp8_rms_norm
from coat_jax.nn.norm import fp8_rms_norm_with_input
from coat_jax.nn.norm import rms_norm
from coat_jax.nn.partitioning import LOGICAL_AXIS_RULES
from coat_jax.nn.precision import PRECISIONS
from coat_jax.nn.residuals import activation_residuals
from coat_jax.nn.residuals import nbytes
from coat_jax.nn.residuals import saved_residuals

__all__ = [
    'CoatLinear', 'CoatMLP', 'CoatRMSNorm', 'LOGICAL_AXIS_RULES',
    'PRECISIONS', 'activation_residuals', 'bf16_dense', 'dense', 'fanout',
    'fill_grad_amax_slot', 'fp8_dense', 'fp8_gate_up_swiglu', 'fp8_matmul',
    'fp8_matmul_groups', 'fp8_rms_norm', 'fp8_rms_norm_with_input',
    'fp8_swiglu', 'nbytes', 'rms_norm', 'saved_residuals', 'swiglu',
]
