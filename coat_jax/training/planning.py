"""Planning a run's memory before it starts: `estimate` compiles a config's
train step ahead of time and reads how its memory divides
(`coat_jax.training.memory`); `find_max_batch` searches the largest
`train.batch_size` that fits by compiling, never by running out of memory.
"""

from collections.abc import Callable
import math
import time

import jax

from coat_jax.models import remat as remat_lib
from coat_jax.training import config as config_lib
from coat_jax.training import memory
from coat_jax.training import trainer
import pallas_kernels


def estimate(config: config_lib.Config, devices=None,
             limit: int | None = None) -> memory.MemoryBreakdown:
  """Compiles `config`'s train step ahead of time; its MemoryBreakdown.
  Raises ValueError before compiling where the train state alone cannot
  fit in `limit` (`memory.check_state_fits`)."""
  setup = trainer.build(config, devices)
  memory.check_state_fits(setup, limit)
  with pallas_kernels.ask_ptxas_once():  # see `trainer.train`
    return memory.breakdown(setup, memory.compile_train_step(setup), limit)


def batch_unit(config: config_lib.Config, num_devices: int) -> int:
  """train.batch_size must be a multiple of this (microbatches x data
  shards of the mesh)."""
  data, fsdp, _ = config_lib.mesh_shape(config.mesh, num_devices)
  return config.train.microbatches * data * fsdp


def find_max_batch(
    config: config_lib.Config, limit: int, devices=None,
    max_batch: int = 1 << 14,
    progress: Callable[[int, memory.MemoryBreakdown | None, float], None]
    | None = None) -> int:
  """The largest train.batch_size of `config` whose step fits in `limit`.

  Compiles the step at batch sizes that are multiples of `batch_unit`: one
  and two units, then where the line through the two largest sizes compiled
  meets `limit` (a step's memory grows about linearly with the batch), then
  the size next to it, so a search usually compiles four times; where the
  line misses, doubling and bisection take over. Assumes the total grows
  with the batch.

  Args:
    config: the run (its train.batch_size is ignored; `config` is not
      changed).
    limit: bytes per device.
    devices: the devices of the mesh (default: all).
    max_batch: the largest batch size tried.
    progress: called after each compile with (batch size, its
      MemoryBreakdown or None where the compiler ran out of memory,
      seconds the compile took).

  Returns:
    The batch size, or 0 if even one unit does not fit.
  """
  devices = jax.devices() if devices is None else devices
  unit = batch_unit(config, len(devices))
  most = max_batch // unit
  totals = {}  # units -> total bytes, of those compiled

  def fits(units: int) -> bool:
    c = config_lib.apply_overrides(config, [])
    c.train.batch_size = units * unit
    start = time.perf_counter()
    try:
      mem = estimate(c, devices, limit)
    except jax.errors.JaxRuntimeError as e:  # compile-time out of memory
      if 'RESOURCE_EXHAUSTED' not in str(e):
        raise
      mem = None
    if progress is not None:
      progress(units * unit, mem, time.perf_counter() - start)
    totals[units] = math.inf if mem is None else mem.total
    return mem is not None and mem.fits

  if most < 1 or not fits(1):
    return 0
  low, high = 1, None  # low fits; high, once known, does not
  sides = []  # whether each line guess since the last bisection fitted
  while low < most and (high is None or high - low > 1):
    guess = _where_the_line_meets(totals, limit)
    # Two line guesses in a row on one side of a bracket: the total is not
    # linear there, so bisect (or double, before a size that does not fit).
    bisect = guess is None or (high is not None and len(sides) >= 2
                               and sides[-1] == sides[-2])
    if bisect:
      guess = 2 * low if high is None else (low + high) // 2
    guess = min(max(guess, low + 1), most if high is None else high - 1)
    ok = fits(guess)
    sides = [] if bisect else [*sides, ok]
    low, high = (guess, high) if ok else (low, guess)
  return low * unit


def _where_the_line_meets(totals: dict, limit: int) -> int | None:
  """The most units within `limit` on the line through the two largest
  finite measurements of `totals` (units -> bytes); None with fewer than
  two or a line that does not rise."""
  points = sorted((u, t) for u, t in totals.items() if math.isfinite(t))[-2:]
  if len(points) < 2:
    return None
  (u0, t0), (u1, t1) = points
  slope = (t1 - t0) / (u1 - u0)
  if slope <= 0:
    return None
  return u1 + math.floor((limit - t1) / slope)


def usable_policies() -> tuple[str, ...]:
  """The remat policies this backend can compile."""
  if jax.default_backend() == 'gpu':
    return remat_lib.POLICIES
  return tuple(p for p in remat_lib.POLICIES if 'offloaded' not in p)
