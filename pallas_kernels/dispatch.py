"""Which implementation of each op runs: the registry and its one resolver.

Every op has two implementations: 'xla', its jnp reference (it runs on any
backend and is the tests' oracle), and 'pallas', its Pallas kernel, which
compiles only for the devices its `Backend` names. `OPS` is the registry:
per op, what its kernel needs and the default, the measured winner where
both run. Every public function takes `implementation=` None | 'xla' |
'pallas' and asks `resolve_implementation` which one runs;
`use_implementation` changes what None means inside a scope (the tests run
the kernels interpreted on a CPU that way).

Example:
  with pallas_kernels.use_implementation('pallas', interpret=True):
    grads = jax.jit(jax.grad(loss))(params)  # traced here: the kernels
"""

from collections.abc import Callable
from collections.abc import Iterator
import contextlib
import contextvars
import dataclasses
import functools
import importlib
from typing import NamedTuple

import jax

from pallas_kernels import _device

IMPLEMENTATIONS = ('xla', 'pallas')


@functools.cache
def _imports(module: str) -> bool:
  try:
    importlib.import_module(module)
  except ImportError:
    return False
  return True


@dataclasses.dataclass(frozen=True)
class Backend:
  """Where a Pallas kernel runs.

  Attributes:
    needs: the devices it compiles for, as error messages name them.
    compiles_here: whether the default backend's devices are those and the
      jax module it lowers with imports.
    interpretable: whether it also runs interpreted (`interpret=True`) on
      any backend, as the tests run it on a CPU.
  """

  needs: str
  compiles_here: Callable[[], bool]
  interpretable: bool


TRITON = Backend(
    needs='a GPU of compute capability 9.0 or newer',
    compiles_here=lambda: (_device.has_fp8_gpus()
                           and _imports('jax.experimental.pallas.triton')),
    interpretable=True)
MOSAIC_GPU = Backend(
    needs="a Hopper GPU (sm_90) and jax's Mosaic GPU",
    compiles_here=lambda: (_device.is_hopper()
                           and _imports('jax.experimental.pallas.mosaic_gpu')),
    interpretable=False)


@dataclasses.dataclass(frozen=True)
class Op:
  """One op's entry: 'xla' runs anywhere, 'pallas' where `pallas` says.

  Attributes:
    pallas: where its Pallas kernel runs.
    default: what implementation=None runs where the kernel compiles on a
      single device: the measured winner. Elsewhere None runs 'xla' (a
      pallas_call under a jit over several devices would be replicated:
      there the kernels run per shard inside `jax.shard_map`).
  """

  pallas: Backend
  default: str


# The registry. Each default is the winner of the measurements in the
# benchmarks/RESULTS.md section named beside it.
OPS: dict[str, Op] = {
    # "Quantization kernels and the fused COAT AdamW step": the quantize
    # kernel beats XLA's fusion; the dequantize kernel loses to it with
    # expansion.
    'quantize_per_group': Op(TRITON, default='pallas'),
    'dequantize_per_group': Op(TRITON, default='xla'),
    # The same section; also `quantize_per_tensor_parts` and `tensor_amax`.
    'quantize_per_tensor': Op(TRITON, default='pallas'),
    'coat_adam_step': Op(TRITON, default='pallas'),
    # "Optimizer step": the step's kernel without the param.
    'coat_adam_update': Op(TRITON, default='pallas'),
    # "Block quantizers": one pass writes both layouts (the Pallas path
    # takes the Mosaic GPU kernel where it compiles and fits, see
    # `quantize_blockwise.api`).
    'quantize_blockwise': Op(TRITON, default='pallas'),
    # "One-pass FP8 RMSNorm and SwiGLU", and "End to end, Llama 1b config"
    # (the 1b step is faster with them once they hand their amaxes to the
    # quantizers of the GEMMs that read their outputs).
    'rms_norm_fp8': Op(TRITON, default='pallas'),
    'swiglu_fp8': Op(TRITON, default='pallas'),
    # "FP8 GEMM: Pallas Mosaic GPU vs cuBLASLt": on par with cuBLASLt per
    # GEMM, no faster in a layer or the train step.
    'fp8_matmul': Op(MOSAIC_GPU, default='xla'),
    # "Block-scaled FP8 GEMM": the 'xla' emulation runs one GEMM per 128
    # of K.
    'fp8_matmul_block_scaled': Op(MOSAIC_GPU, default='pallas'),
}


class Resolved(NamedTuple):
  """The implementation that runs.

  Attributes:
    implementation: 'xla' or 'pallas'.
    interpret: whether the Pallas kernel runs interpreted (False for 'xla').
  """

  implementation: str
  interpret: bool


_XLA = Resolved('xla', False)
# What implementation=None means here: (None | 'xla' | 'pallas', interpret).
_SCOPED: contextvars.ContextVar[tuple[str | None, bool]] = (
    contextvars.ContextVar('pallas_kernels_implementation',
                           default=(None, False)))


def _check_name(implementation: str | None) -> None:
  if implementation is not None and implementation not in IMPLEMENTATIONS:
    raise ValueError(
        f'implementation={implementation!r} must be None, \'xla\' or'
        ' \'pallas\': None picks the fastest available.')


def _entry(op: str) -> Op:
  try:
    return OPS[op]
  except KeyError:
    raise ValueError(
        f'op={op!r} is not in the registry; ops: {sorted(OPS)}.') from None


def _pallas(entry: Op, interpret: bool) -> Resolved | None:
  """The op's kernel: interpreted if asked or off GPU (where it can be),
  compiled where it compiles; None if neither."""
  if entry.pallas.interpretable and (interpret or not _device.on_gpu()):
    return Resolved('pallas', True)
  if not interpret and entry.pallas.compiles_here():
    return Resolved('pallas', False)
  return None


def resolve_implementation(op: str, implementation: str | None) -> Resolved:
  """The implementation of `op` that runs for a caller's `implementation`.

  Args:
    op: a key of `OPS`.
    implementation: 'xla'; 'pallas' (compiled where its backend compiles,
      interpreted on other backends if it can be, else a ValueError); or
      None: the scope's choice (`use_implementation`) if it can run here,
      otherwise the op's default where its kernel compiles on a single
      device, otherwise 'xla'.

  Returns:
    The `Resolved` (implementation, interpret) pair.

  Raises:
    ValueError: an unknown op or implementation, or 'pallas' where the
      kernel cannot run.
  """
  entry = _entry(op)
  _check_name(implementation)
  if implementation is None:
    scoped, interpret = _SCOPED.get()
    if scoped == 'xla':
      return _XLA
    if scoped == 'pallas':
      resolved = _pallas(entry, interpret)
      if resolved is not None:
        return resolved
    if (entry.default == 'pallas' and entry.pallas.compiles_here()
        and _device.single_device()):
      return Resolved('pallas', False)
    return _XLA
  if implementation == 'xla':
    return _XLA
  resolved = _pallas(entry, interpret=False)
  if resolved is None:
    raise ValueError(
        f"implementation='pallas' for {op} needs {entry.pallas.needs}; the"
        f' default backend here is {jax.default_backend()!r}. Use'
        " implementation='xla' or None here.")
  return resolved


@contextlib.contextmanager
def use_implementation(implementation: str | None, *,
                       interpret: bool = False) -> Iterator[None]:
  """Within the scope, kernel calls with implementation=None run this one.

  'pallas' runs each op's kernel where it can run (interpreted with
  `interpret`, or off GPU for kernels that can be); an op whose kernel
  cannot (the Mosaic GPU GEMMs off Hopper, or with `interpret`) keeps its
  default. 'xla' runs every op's reference; None restores the defaults.
  Calls that name their implementation are not affected. Scopes nest and
  are local to the thread (a `contextvars.ContextVar`).

  The choice is read when a kernel's caller is traced, and jax reuses the
  trace of a function it has traced before: a function first traced inside
  the scope keeps the scope's choice, one traced before keeps its own (to
  switch, trace a new function or call `jax.clear_caches()`).

  Args:
    implementation: None, 'xla' or 'pallas'.
    interpret: with 'pallas', run the kernels interpreted even on a GPU
      (tests of the kernels' logic).

  Raises:
    ValueError: an unknown implementation, or `interpret` without 'pallas'.
  """
  _check_name(implementation)
  if interpret and implementation != 'pallas':
    raise ValueError(
        f'interpret=True is for the Pallas kernels; implementation='
        f'{implementation!r} runs none. Use implementation=\'pallas\'.')
  token = _SCOPED.set((implementation, interpret))
  try:
    yield
  finally:
    _SCOPED.reset(token)
