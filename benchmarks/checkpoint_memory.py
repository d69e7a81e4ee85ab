"""Host memory a train checkpoint's save takes (RESULTS.md "one-gpu").

  PYTHONPATH=. python benchmarks/checkpoint_memory.py DIR [--layers 40]
      [--ordinary-memory]

Builds a state of 13B-shaped per-layer leaves on the default device (per
layer a 5120 x 13824 and a 5120 x 5120 float32 kernel, a 5120 x 13824 FP8
moment and its float32 scales; one 32000 x 5120 embedding), saves it to
DIR with the train checkpointer (`coat_jax.training.checkpoints`), samples
this process's resident memory (the pinned pool's pages included) every
0.1 s, then restores it and compares the embedding, the last MLP kernel
and the first moment bit for bit. Prints the
state's size, whether the save streamed, the part size, the seconds and
GB/s of the save, and the growth of resident memory (all of it, and the
shared pages that hold XLA's pinned host pool). --ordinary-memory copies
through ordinary host memory instead of the pinned pool. Run one process
per point: the pinned pool keeps what it grew to. DIR on a RAM disk keeps
the disk out of the timing.
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
  state = {'embed': jax.random.normal(jax.random.key(0), (32000, 5120))}
  for i in range(layers):
    key = jax.random.key(i + 1)
    state[f'mlp{i}'] = jax.random.normal(key, (5120, 13824))
    state[f'attn{i}'] = jax.random.normal(key, (5120, 5120))
    state[f'moment{i}'] = jax.random.normal(key, (5120, 13824)).astype(
        jnp.float8_e4m3fn)
    state[f'scales{i}'] = jnp.ones((5120, 108))
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


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('dir')
  parser.add_argument('--layers', type=int, default=40)
  parser.add_argument('--ordinary-memory', action='store_true')
  args = parser.parse_args()
  if args.ordinary_memory:
    checkpoints.fits_pinned_host = lambda gb: False
  state = _state(args.layers)
  template = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  gb = sum(x.nbytes for x in jax.tree.leaves(state)) / 1e9

  peak, done = dict(_resident_mb()), threading.Event()
  before = dict(peak)

  def sample():
    while not done.wait(0.1):
      for k, v in _resident_mb().items():
        peak[k] = max(peak[k], v)

  part = checkpoints.stream_part_gb(template)
  sampler = threading.Thread(target=sample)
  sampler.start()
  saver = checkpoints.Checkpointer(args.dir, training.Config(),
                                   template=template)
  start = time.perf_counter()
  saver.save(1, state, wait=True)
  seconds = time.perf_counter() - start
  done.set()
  sampler.join()
  got = saver.restore(1, template)
  exact = all(
      np.array_equal(np.asarray(state[k]).view(np.uint8),
                     np.asarray(got[k]).view(np.uint8))
      for k in {'embed', f'mlp{args.layers - 1}', 'moment0'} & set(state))
  print(f'state {gb:.1f} GB, streams {saver.blocking_saves}, part'
        f' {part:.2f} GB, pinned pool {not args.ordinary_memory}: save'
        f' {seconds:.1f} s ({gb / seconds:.2f} GB/s), resident memory'
        f' +{(peak["VmRSS"] - before["VmRSS"]) / 1e3:.1f} GB (shared'
        f' +{(peak["RssShmem"] - before["RssShmem"]) / 1e3:.1f} GB),'
        f' restore {"bit-exact" if exact else "WRONG"}')


if __name__ == '__main__':
  main()
