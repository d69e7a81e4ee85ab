"""benchmarks/matmul.py's lists of GEMMs (the GPU timings run on the GPU)."""

import collections

import jax.numpy as jnp

from benchmarks import matmul
from coat_jax import training


def test_in_step_gemms_are_the_1b_steps():
  """--in-step times each FP8 GEMM of a 1b layer (configs/llama_1b.py) as
  the block step runs it: forward and dgrad to bf16, wgrad (X^T dY, the
  gradient as b) to float32, the fused Q/K/V, gate and up apart."""
  config = training.load_config('configs/llama_1b.py')
  cfg = training.architecture(config.model)
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


def test_ratios_are_taken_per_round():
  # Entry 0's speed against entry 1, round by round: 1.1, 1.0, 0.9.
  times = [[1.0, 2.0, 1.0], [1.1, 2.0, 0.9]]
  median, lo, hi = matmul.per_round(times, 0, 1)
  assert (round(median, 6), round(lo, 6), round(hi, 6)) == (1.0, 0.9, 1.1)


def test_paired_table_gives_each_ratio_and_the_geomeans():
  ratio = lambda x: (x, x - 0.01, x + 0.01)
  rows = [dict(name=name, m=m, n=n, k=k, a='float8_e4m3fn',
               pallas_tflops=1000.0, cublaslt_tflops=1000.0 / x,
               pallas_vs_cublaslt=ratio(x), block_tflops=950.0,
               block_vs_pallas=ratio(0.95), block_vs_cublaslt=ratio(0.95 * x))
          for (name, m, n, k, _), x in zip(
              matmul.SHAPES, [1.2] + [1.0] * 6 + [1.1] * 6)]
  text = matmul.paired_table(rows, with_block=True, control=False)
  assert ('| 8192^3 | 8192x8192x8192 | float8_e4m3fn | 1000 | 833 |'
          ' 1.200 (1.190..1.210) | 950 | 0.950 (0.940..0.960) |'
          ' 1.140 (1.130..1.150) |') in text
  # The 12 layer GEMMs: six at 1.0, six at 1.1; with 8192^3 thirteen.
  assert ('geomean over 7B layers (12): Pallas / cuBLASLt 1.049, block /'
          ' Pallas 0.950, block / cuBLASLt 0.996') in text
  assert 'geomean over 8192^3 and 7B (13): Pallas / cuBLASLt 1.060' in text
  assert 'over 1b' not in text and 'over all' not in text
