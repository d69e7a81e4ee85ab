"""Host memory of train checkpoint saves and restores (RESULTS.md "one-gpu").

  PYTHONPATH=. python benchmarks/checkpoint_memory.py DIR [--layers 40]

Builds a state of 13B-shaped leaves stacked over the layers, as the train
state holds them, on the default device (a layers x 5120 x 13824 and a
layers x 5120 x 5120 float32 kernel, a layers x 5120 x 13824 FP8 moment and
its float32 scales; one 32000 x 5120 embedding), saves it to DIR with the
train checkpointer (`coat_jax.training.checkpoints`), samples this
process's resident memory (XLA's pinned pool's pages included) every 0.1 s,
then restores it and compares every leaf bit for bit. Prints the state's
size and largest leaf, whether the save streamed, the part size, the
seconds and GB/s of the save and the growth of resident memory while it
runs (all of it, and the shared pages that hold XLA's pinned host pool),
then the restore's seconds and growth. Run one
process per point: the pinned pool keeps what it grew to. DIR on a RAM
disk keeps the disk out of the timing.
"""

import argparse
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from coat_jax import training
from coat_jax.training import checkpoints


def _state(layers: int) -> dict:
  keys = jax.random.split(jax.random.key(0), 4)
  state = {'embed': jax.random.normal(keys[0], (32000, 5120))}
  if layers:
    state['mlp'] = jax.random.normal(keys[1], (layers, 5120, 13824))
    state['attn'] = jax.random.normal(keys[2], (layers, 5120, 5120))
    state['moment'] = jax.random.normal(
        keys[3], (layers, 5120, 13824), jnp.bfloat16).astype(
            jnp.float8_e4m3fn)
    state['scales'] = jnp.ones((layers, 5120, 108))
  return jax.block_until_ready(state)


def _resident_mb() -> dict[str, int]:
  """VmRSS and RssShmem of this process, in MB."""
  out = {}
  with open('/proc/self/status') as f:
    for line in f:
      key, value = line.split(':', 1)
      if key in ('VmRSS', 'RssShmem'):
        out[key] = int(value.split()[0]) // 1024
  return out


def _measured(fn):
  """(fn(), seconds, growth of this process's resident memory at its peak
  while fn ran, in GB: {'VmRSS': all of it, 'RssShmem': shared pages})."""
  peak, done = dict(_resident_mb()), threading.Event()
  before = dict(peak)

  def sample():
    while not done.wait(0.1):
      for k, v in _resident_mb().items():
        peak[k] = max(peak[k], v)

  sampler = threading.Thread(target=sample)
  sampler.start()
  start = time.perf_counter()
  try:
    out = fn()
  finally:
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
  return out, seconds, {k: (peak[k] - before[k]) / 1e3 for k in peak}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('dir')
  parser.add_argument('--layers', type=int, default=40)
  args = parser.parse_args()
  state = _state(args.layers)
  template = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  gb = sum(x.nbytes for x in jax.tree.leaves(state)) / 1e9
  largest = max(x.nbytes for x in jax.tree.leaves(state)) / 1e9
  part = checkpoints.stream_part_gb(template)
  saver = checkpoints.Checkpointer(args.dir, training.Config(),
                                   template=template)
  _, save_s, save_mem = _measured(lambda: saver.save(1, state, wait=True))
  got, restore_s, restore_mem = _measured(lambda: jax.block_until_ready(
      saver.restore(1, template)))
  exact = all(
      np.array_equal(np.asarray(state[k]).view(np.uint8),
                     np.asarray(got[k]).view(np.uint8))
      for k in state)
  print(f'state {gb:.1f} GB (largest leaf {largest:.1f} GB), streams'
        f' {saver.blocking_saves}, part {part:.2f} GB: save'
        f' {save_s:.1f} s ({gb / save_s:.2f} GB/s), resident memory'
        f' +{save_mem["VmRSS"]:.1f} GB (shared +{save_mem["RssShmem"]:.1f}'
        f' GB); restore {restore_s:.1f} s, resident memory'
        f' +{restore_mem["VmRSS"]:.1f} GB,'
        f' {"bit-exact" if exact else "WRONG"}')


if __name__ == '__main__':
  main()
