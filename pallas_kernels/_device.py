"""What the local devices can run: the one place that asks.

The kernels need GPUs with FP8: the Triton kernels compile for compute
capability 9.0 and newer, the Mosaic GPU kernels (wgmma) for Hopper, 9.x,
only. Everything here describes the default backend's devices, the ones a
jitted function runs on.
"""

import functools

import jax


def on_gpu() -> bool:
  """Whether the default backend is a GPU."""
  return jax.default_backend() == 'gpu'


@functools.cache
def compute_capability() -> tuple[int, int] | None:
  """(major, minor) compute capability of the default backend's devices.

  None unless the default backend is a GPU whose devices all share one
  capability (CPU, TPU, mixed or unknown GPUs).
  """
  if not on_gpu():
    return None
  found = {str(getattr(d, 'compute_capability', '')) for d in jax.devices()}
  if len(found) != 1:
    return None
  try:
    major, minor = (int(v) for v in found.pop().split('.'))
  except ValueError:
    return None
  return major, minor


def is_hopper() -> bool:
  """Whether the default backend's devices are Hopper GPUs (sm_90)."""
  capability = compute_capability()
  return capability is not None and capability[0] == 9


def has_fp8_gpus() -> bool:
  """Whether the default backend's devices are GPUs of compute capability
  9.0 or newer: Hopper and later, which Triton compiles FP8 code for."""
  capability = compute_capability()
  return capability is not None and capability >= (9, 0)


def single_device() -> bool:
  """Whether the default backend has one device. A pallas_call has no
  partitioning rule: under a jit over several devices it would be
  replicated, so the kernels run there only inside `jax.shard_map`."""
  return len(jax.devices()) == 1
