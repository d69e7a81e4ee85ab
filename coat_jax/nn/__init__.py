"""Flax NNX layers whose saved activations are FP8 (COAT).

`CoatLinear`, `CoatRMSNorm`, `CoatLayerNorm` and `CoatMLP` run as their
`recipe` says (`coat_jax.recipes`); the functional forms (`fp8_dense`,
`fp8_rms_norm`, `fp8_layer_norm`, `fp8_swiglu`) are `jax.custom_vjp`s whose
forward saves only FP8 tensors and tiny scales. `silu`, `gelu`, `swiglu` and
`geglu` are FP8-saving drop-ins for `jax.nn`'s, for activations in a model's
own code.
"""

from coat_jax.nn.activations import fp8_swiglu
from coat_jax.nn.activations import geglu
from coat_jax.nn.activations import gelu
from coat_jax.nn.activations import silu
from coat_jax.nn.activations import swiglu
from coat_jax.nn.fp8_matmul import fp8_matmul
from coat_jax.nn.layer_norm import CoatLayerNorm
from coat_jax.nn.layer_norm import fp8_layer_norm
from coat_jax.nn.layer_norm import layer_norm
from coat_jax.nn.linear import CoatLinear
from coat_jax.nn.linear import fp8_dense
from coat_jax.nn.mlp import CoatMLP
from coat_jax.nn.mlp import fp8_gate_up_swiglu
from coat_jax.nn.norm import CoatRMSNorm
from coat_jax.nn.norm import fp8_rms_norm
from coat_jax.nn.norm import rms_norm
from coat_jax.nn.partitioning import LOGICAL_AXIS_RULES
from coat_jax.nn.residuals import activation_residuals
from coat_jax.nn.residuals import saved_residuals

__all__ = [
    'CoatLayerNorm', 'CoatLinear', 'CoatMLP', 'CoatRMSNorm',
    'LOGICAL_AXIS_RULES', 'activation_residuals', 'fp8_dense',
    'fp8_gate_up_swiglu', 'fp8_layer_norm', 'fp8_matmul', 'fp8_rms_norm',
    'fp8_swiglu', 'geglu', 'gelu', 'layer_norm', 'rms_norm',
    'saved_residuals', 'silu', 'swiglu',
]
