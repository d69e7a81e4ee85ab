"""coat_jax.nn.fp8_matmul: the seam to pallas_kernels, exact on CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import coat_jax.nn as cnn
from pallas_kernels.fp8_matmul import api


def test_is_the_pallas_kernels_function():
  assert cnn.fp8_matmul is api.fp8_matmul


@pytest.mark.parametrize('a_dtype', [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_xla_cpu_path_is_exact_on_small_integers(a_dtype, seed):
  rng = np.random.default_rng(seed)
  # Integers |v| <= 8 are exact in both formats; sums < 2^24 stay exact.
  a = rng.integers(-8, 9, (48, 256)).astype(np.float32)
  b = rng.integers(-8, 9, (32, 256)).astype(np.float32)
  out = cnn.fp8_matmul(
      jnp.asarray(a, a_dtype), jnp.asarray(b, jnp.float8_e4m3fn),
      jnp.float32(0.25), jnp.float32(8.0), out_dtype=jnp.float32,
      implementation='xla')
  np.testing.assert_array_equal(np.asarray(out), (a @ b.T) * 2.0)


def test_xla_cpu_path_matches_float64_on_random_fp8(seed):
  ka, kb = jax.random.split(jax.random.key(seed))
  a = (jax.random.normal(ka, (64, 512)) * 40).astype(jnp.float8_e4m3fn)
  b = (jax.random.normal(kb, (16, 512)) * 1e3).astype(jnp.float8_e5m2)
  out = cnn.fp8_matmul(b, a, jnp.float32(1.0), jnp.float32(1.0),
                       out_dtype=jnp.float32, implementation='xla')
  ref = (np.asarray(b, np.float64) @ np.asarray(a, np.float64).T)
  scale = np.abs(np.asarray(b, np.float64)) @ np.abs(
      np.asarray(a, np.float64)).T
  assert np.all(np.isfinite(out))
  assert np.all(np.abs(np.asarray(out) - ref) <= 512 * 2**-24 * scale + 1e-30)


@pytest.mark.gpu
def test_fp8_dense_lowers_to_cublaslt_fp8_on_gpu():
  x = jnp.ones((256, 512), jnp.bfloat16)
  w = jnp.ones((512, 256), jnp.float32)

  def fwd_bwd(x, w):
    y, vjp = jax.vjp(lambda x, w: cnn.fp8_dense(
        x, [w], implementation='xla')[0], x, w)
    return y, vjp(y)

  hlo = jax.jit(fwd_bwd).lower(x, w).compile().as_text()
  # forward, dgrad and wgrad: three FP8 GEMMs, no BF16 fallback.
  assert hlo.count('custom_call_target="__cublas$lt$matmul$f8"') == 3, hlo
