"""Planning a run's memory before it starts: `estimate` compiles a config's
train step ahead of time and reads how its memory divides
(`coat_jax.training.memory`); `find_max_batch` searches the largest
`train.batch_size` that fits by compiling, never by running out of memory.
"""

import jax

from coat_jax.models import remat as remat_lib
from coat_jax.training import config as config_lib
from coat_jax.training import memory
from coat_jax.training import trainer
import pallas_kernels


def estimate(config: config_lib.Config, devices=None,
             limit: int | None = None) -> memory.MemoryBreakdown:
  """Compiles `config`'s train step ahead of time; its MemoryBreakdown."""
  setup = trainer.build(config, devices)
  with pallas_kernels.ask_ptxas_once():  # see `trainer.train`
    return memory.breakdown(setup, memory.compile_train_step(setup), limit)


def batch_unit(config: config_lib.Config, num_devices: int) -> int:
  """train.batch_size must be a multiple of this (microbatches x data
  shards of the mesh)."""
  data, fsdp, _ = config_lib.mesh_shape(config.mesh, num_devices)
  return config.train.microbatches * data * fsdp


def find_max_batch(config: config_lib.Config, limit: int, devices=None,
                   max_batch: int = 1 << 14) -> int:
  """The largest train.batch_size of `config` whose step fits in `limit`.

  Compiles the step (doubling, then bisection) over multiples of
  `batch_unit`; returns 0 if even one unit does not fit.
  """
  devices = jax.devices() if devices is None else devices
  unit = batch_unit(config, len(devices))

  def fits(units: int) -> bool:
    c = config_lib.apply_overrides(config, [])
    c.train.batch_size = units * unit
    try:
      return estimate(c, devices, limit).fits
    except jax.errors.JaxRuntimeError as e:  # compile-time out of memory
      if 'RESOURCE_EXHAUSTED' in str(e):
        return False
      raise

  if not fits(1):
    return 0
  low, high = 1, 2  # low fits; high is untested or does not fit
  while high * unit <= max_batch and fits(high):
    low, high = high, high * 2
  high = min(high, max_batch // unit + 1)
  while high - low > 1:
    mid = (low + high) // 2
    low, high = (mid, high) if fits(mid) else (low, mid)
  return low * unit


def usable_policies() -> tuple[str, ...]:
  """The remat policies this backend can compile."""
  if jax.default_backend() == 'gpu':
    return remat_lib.POLICIES
  return tuple(p for p in remat_lib.POLICIES if 'offloaded' not in p)
