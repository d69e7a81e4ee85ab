"""Pallas kernels for coat-jax: FP8 quantization and the fused COAT step.

Each op is a subpackage with `api.py` (the public function, `implementation=`
None | 'xla' | 'pallas'), `reference.py` (pure jnp: the 'xla' path and the
oracle) and its Pallas backend, e.g.
`pallas_kernels.coat_adam_step.coat_adam_step(...)`. `dispatch` holds the
registry: which implementation None picks per op and where each runs;
`use_implementation` changes that within a scope. `fp8_matmul` is not
imported here: import it where needed.
"""

from pallas_kernels import coat_adam_step
from pallas_kernels import quantize_per_group
from pallas_kernels import quantize_per_tensor
from pallas_kernels import rms_norm_fp8
from pallas_kernels import swiglu_fp8
from pallas_kernels.dispatch import resolve_implementation
from pallas_kernels.dispatch import use_implementation

__all__ = ['coat_adam_step', 'quantize_per_group', 'quantize_per_tensor',
           'resolve_implementation', 'rms_norm_fp8', 'swiglu_fp8',
           'use_implementation']
