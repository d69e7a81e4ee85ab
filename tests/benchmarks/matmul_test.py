"""benchmarks/matmul.py's lists of GEMMs (the GPU timings run on the GPU)."""

import collections

import jax.numpy as jnp

from benchmarks import matmul
from coat_jax import training
from coat_jax.training import trainer


def test_in_step_gemms_are_the_1b_steps():
  """--in-step times each FP8 GEMM of a 1b layer (configs/llama_1b.py) as
  the block step runs it: forward and dgrad to bf16, wgrad (X^T dY, the
  gradient as b) to float32, the fused Q/K/V, gate and up apart."""
  config = training.load_config('configs/llama_1b.py')
  cfg = trainer.llama_config(config.model)
  h, f = cfg.hidden_size, cfg.intermediate_size
  kv = h // cfg.num_heads * cfg.num_kv_heads
  t = config.train.batch_size * config.data.seq_len
  e4, e5 = jnp.float8_e4m3fn, jnp.float8_e5m2
  want = collections.Counter()
  for out, inp, calls in ((h + 2 * kv, h, 1), (h, h, 1), (f, h, 2),
                          (h, f, 1)):
    want[(t, out, inp, e4, e4, jnp.bfloat16)] += calls
    want[(t, inp, out, e5, e4, jnp.bfloat16)] += calls
    want[(inp, out, t, e4, e5, jnp.float32)] += calls
  got = collections.Counter()
  for _, *dims, calls in matmul.STEP_GEMMS_1B:
    got[tuple(dims)] += calls
  assert got == want
  assert sum(got.values()) == 15  # GEMM calls per layer
  assert cfg.num_layers == matmul.NUM_LAYERS_1B
