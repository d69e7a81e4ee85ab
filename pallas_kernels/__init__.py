"""Pallas kernels for coat-jax: FP8 quantization and the fused COAT step.

Each op is a subpackage with `api.py` (the public function, `implementation=`
None | 'xla' | 'pallas'), `reference.py` (pure jnp: the 'xla' path and the
oracle) and its Pallas backend, e.g.
`pallas_kernels.coat_adam_step.coat_adam_step(...)`. `dispatch` holds the
registry: which implementation None picks per op and where each runs;
`use_implementation` changes that within a scope. `fp8_matmul` is not
imported here: import it where needed.

Importing the package changes no global state. jax 0.11 deprecates the
Pallas Triton backend that most kernels lower with and warns (a
DeprecationWarning, shown by pytest) when a jitted function lowers them;
filter it where unwanted:
`warnings.filterwarnings('ignore', 'The Pallas Triton backend is deprecated')`.
"""

from pallas_kernels import coat_adam_step
from pallas_kernels import quantize_per_group
from pallas_kernels import quantize_per_tensor
from pallas_kernels import rms_norm_fp8
from pallas_kernels import swiglu_fp8
from pallas_kernels.dispatch import resolve_implementation
from pallas_kernels.dispatch import use_implementation
from pallas_kernels.workarounds import ask_ptxas_once

__all__ = ['ask_ptxas_once', 'coat_adam_step', 'quantize_per_group',
           'quantize_per_tensor', 'resolve_implementation', 'rms_norm_fp8',
           'swiglu_fp8', 'use_implementation']
