"""Hugging Face checkpoints at size: load_hf / save_hf time and host memory.

Writes a random Llama of --preset as a BF16 HF checkpoint (sharded at
--shard_gb), then in a fresh process loads it with `load_hf` onto an fsdp
mesh over all devices (train.py's shardings) and reports the seconds, the
host peak RSS growth during the load (load_hf assembles each param from
per-device shards, one HF tensor at a time, so this should stay near one
tensor, far below the checkpoint size), the device memory in use, and
whether each param's position-weighted checksum matches the written one;
then times `save_hf` back.
One-shot timings, not a performance claim.

  PYTHONPATH=. python benchmarks/hf_load.py --preset llama2_7b --dir /tmp/hf_7b
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from coat_jax import models
from coat_jax import training
from coat_jax.training import trainer

SUMS = 'param_sums.json'


def _rss_bytes() -> int:
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith('VmRSS:'):
        return int(line.split()[1]) * 1024
  return 0


@jax.jit
def _checksum(x):
  """A position-weighted sum: a transposed or shuffled param changes it."""
  w = jnp.cos(0.618 * jnp.arange(x.size, dtype=jnp.float32)).reshape(x.shape)
  return jnp.sum(x * w)


def _sums(params) -> dict:
  return {jax.tree_util.keystr(p): float(_checksum(x))
          for p, x in jax.tree_util.tree_leaves_with_path(params)}


def write(preset: str, path: str, shard_gb: float) -> dict:
  """A random `preset` Llama saved as a BF16 HF checkpoint at `path`."""
  config = models.LlamaConfig.preset(preset)
  abstract = nnx.eval_shape(lambda: models.Llama(
      config, precision='bf16', rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  keys = iter(jax.random.split(jax.random.key(0), 1000))
  # BF16 values (eagerly rounded: XLA may drop a convert pair under jit).
  params = jax.tree.map(
      lambda x: (0.02 * jax.random.normal(next(keys), x.shape, x.dtype)
                 ).astype(jnp.bfloat16).astype(x.dtype),
      nnx.to_pure_dict(state))
  nnx.replace_by_pure_dict(state, params)
  model = nnx.merge(graphdef, state)
  start = time.perf_counter()
  models.save_hf(model, path, dtype='bfloat16',
                 max_shard_size=int(shard_gb * 2**30))
  seconds = time.perf_counter() - start
  with open(os.path.join(path, SUMS), 'w') as f:
    json.dump(_sums(params), f)
  size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
             if f.endswith('.safetensors'))
  return {'preset': preset, 'checkpoint_bytes': size,
          'save_hf_seconds': seconds}


def load(path: str, save_to: str | None = None) -> dict:
  """Loads `path` onto an fsdp mesh of all devices; optionally saves it."""
  jax.block_until_ready(jnp.ones(()) + 1)  # backend up: the baseline
  baseline = _rss_bytes()
  config = training.Config()
  config.model.init_from = path
  config.mesh = training.MeshConfig(data=1, fsdp=len(jax.devices()),
                                    tensor=1)
  config.train.batch_size = len(jax.devices())
  setup = trainer.build(config)
  shardings = setup.state_shardings['params']
  rss_before = _rss_bytes()
  maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  start = time.perf_counter()
  model = models.load_hf(path, 'coat', shardings=shardings)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  jax.block_until_ready(params)
  seconds = time.perf_counter() - start
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  with open(os.path.join(path, SUMS)) as f:
    want = json.load(f)
  got = _sums(params)
  bad = [k for k in want if not np.isclose(got[k], want[k], rtol=1e-4,
                                          atol=1e-3)]
  largest = max(x.addressable_shards[0].data.nbytes
                for x in jax.tree.leaves(params))
  stats = jax.local_devices()[0].memory_stats() or {}
  out = {'devices': len(jax.devices()), 'load_hf_seconds': seconds,
         'host_rss_at_start_bytes': baseline,
         'host_rss_before_load_bytes': rss_before,
         'host_peak_before_load_bytes': maxrss_before,
         'host_peak_after_load_bytes': peak,
         'host_peak_growth_in_load_bytes': peak - rss_before,
         'largest_param_shard_bytes': largest,
         'device0_bytes_in_use': stats.get('bytes_in_use'),
         'sums_match': not bad, 'mismatched': bad[:5]}
  if save_to:
    start = time.perf_counter()
    models.save_hf(model, save_to, dtype='bfloat16')
    out['save_hf_seconds_from_mesh'] = time.perf_counter() - start
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--preset', default='llama2_7b')
  parser.add_argument('--dir', default='/tmp/hf_load_bench')
  parser.add_argument('--shard_gb', type=float, default=2.0)
  parser.add_argument('--phase', choices=('all', 'load'), default='all')
  args = parser.parse_args(argv)
  if args.phase == 'load':
    print(json.dumps(load(args.dir, args.dir + '_saved')))
    return 0
  print(json.dumps(write(args.preset, args.dir, args.shard_gb)), flush=True)
  # A fresh process: its peak RSS is the load's, not the writer's.
  result = subprocess.run(
      [sys.executable, __file__, '--dir', args.dir, '--phase', 'load'],
      check=False, capture_output=True, text=True)
  sys.stderr.write(result.stderr[-4000:])
  print(result.stdout.strip().splitlines()[-1] if result.stdout else '')
  return result.returncode


if __name__ == '__main__':
  sys.exit(main())
