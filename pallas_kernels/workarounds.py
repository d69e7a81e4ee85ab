"""Opt-in workarounds for jax internals: nothing here runs at import.

Each is a context manager that patches one jax or jaxlib function for its
scope only and restores it on exit.
"""

from collections.abc import Iterator
import contextlib
import functools
from typing import Any


def _mosaic_gpu_extension() -> Any:
  """jaxlib's Mosaic GPU extension module, or None (CPU-only jaxlibs)."""
  try:
    from jax._src.lib import mosaic_gpu
  except ImportError:
    return None
  return getattr(mosaic_gpu, '_mosaic_gpu_ext', None)


@contextlib.contextmanager
def ask_ptxas_once(extension: Any = None) -> Iterator[bool]:
  """Within the scope, jaxlib asks ptxas for its PTX ISA version once.

  jax 0.10 and 0.11 (0.11.2 included) lower Mosaic GPU kernels asking
  `_mosaic_gpu_ext._get_ptxas_isa_version()` on every register cast that
  involves a type of 8 bits or fewer, booleans included, and each call runs
  ptxas; the FP8 GEMMs make many such casts, so their lowering is dominated
  by it. The answer cannot change within a process: inside this scope the
  function is cached (through `jax._src`, hence opt-in). Wrap the first
  call (the compilation) of a jitted function that lowers the Mosaic GPU
  kernels:

    with pallas_kernels.ask_ptxas_once():
      compiled = jax.jit(train_step).lower(*args).compile()

  Scopes nest (an inner one changes nothing) and the original function is
  restored on exit. Where jaxlib has no such function (CPU-only jaxlibs,
  later versions) nothing is patched.

  Args:
    extension: the module holding `_get_ptxas_isa_version`; None for
      jaxlib's Mosaic GPU extension.

  Yields:
    Whether the function is cached in the scope.
  """
  if extension is None:
    extension = _mosaic_gpu_extension()
  ask = getattr(extension, '_get_ptxas_isa_version', None)
  if ask is None:
    yield False
    return
  if hasattr(ask, 'cache_info'):  # an enclosing scope cached it
    yield True
    return
  extension._get_ptxas_isa_version = functools.cache(ask)
  try:
    yield True
  finally:
    extension._get_ptxas_isa_version = ask
