"""Tests of pallas_kernels.fp8_matmul.

CPU: the reference, the 'xla' path, dispatch, input validation and the
Mosaic GPU kernels' lowering for CUDA. GPU (marked `gpu`, skipped without a
Hopper GPU): the Mosaic GPU kernels, exact on small-integer inputs, as
accurate as cuBLASLt's precise FP8 path on random inputs, on boundary shapes
and with scales != 1.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch
from pallas_kernels.fp8_matmul import api
from pallas_kernels.fp8_matmul import fp8_matmul
from pallas_kernels.fp8_matmul import fp8_matmul_reference
from pallas_kernels.fp8_matmul import mosaic_gpu
from pallas_kernels.fp8_matmul import mosaic_gpu_block
from pallas_kernels.quantize_per_group import reference as group_reference

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
MIXES = [(E4M3, E4M3), (E5M2, E4M3)]
HOPPER = dispatch.MOSAIC_GPU.compiles_here()
needs_hopper = pytest.mark.skipif(
    not HOPPER, reason='needs a Hopper GPU with Mosaic GPU')


def small_ints(key, shape, dtype):
  """Integers in [-8, 8): exact in E4M3 and E5M2, so f32 sums are exact."""
  x = jax.random.randint(key, shape, -8, 8).astype(jnp.float32)
  return x.astype(dtype)


def f64_ref(a, b, a_scale=1.0, b_scale=1.0):
  a64 = np.asarray(a.astype(jnp.float32), np.float64)
  b64 = np.asarray(b.astype(jnp.float32), np.float64)
  return (a64 @ b64.T) * (float(a_scale) * float(b_scale))


def rel_err(out, ref):
  out = np.asarray(out, np.float64)
  return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


# ---------------------------------------------------------------- CPU tests


@pytest.mark.parametrize('a_dtype,b_dtype', MIXES)
@pytest.mark.parametrize('out_dtype', [jnp.float32, jnp.bfloat16])
def test_reference_exact_small_ints(a_dtype, b_dtype, out_dtype):
  ka, kb = jax.random.split(jax.random.key(0))
  a = small_ints(ka, (48, 96), a_dtype)
  b = small_ints(kb, (32, 96), b_dtype)
  out = fp8_matmul_reference(a, b, 1.0, 1.0, out_dtype=out_dtype)
  assert out.dtype == out_dtype and out.shape == (48, 32)
  want = f64_ref(a, b).astype(np.float32)
  np.testing.assert_array_equal(
      np.asarray(out, np.float32), want.astype(out_dtype).astype(np.float32))


@pytest.mark.parametrize('a_dtype,b_dtype', MIXES)
def test_xla_path_matches_reference(a_dtype, b_dtype):
  ka, kb = jax.random.split(jax.random.key(1))
  a = small_ints(ka, (64, 128), a_dtype)
  b = small_ints(kb, (48, 128), b_dtype)
  sa, sb = jnp.float32(0.5), jnp.float32(4.0)  # powers of 2: still exact
  out = fp8_matmul(a, b, sa, sb, out_dtype=jnp.float32, implementation='xla')
  np.testing.assert_array_equal(out, f64_ref(a, b, 0.5, 4.0))
  ref = fp8_matmul_reference(a, b, sa, sb, out_dtype=jnp.bfloat16)
  out = jax.jit(lambda a, b: fp8_matmul(a, b, sa, sb, implementation='xla'))(
      a, b)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize('out_dtype', [jnp.bfloat16, jnp.float32])
def test_xla_result_is_scaled_then_rounded_once(out_dtype):
  """(a @ b.T) * scale rounded once to out_dtype, on CPU and (cuBLASLt's
  epilogue applying the scale) on GPU; a path that rounded the product to
  BF16 before scaling, or rounded the scale, would differ."""
  ka, kb = jax.random.split(jax.random.key(4))
  a = small_ints(ka, (64, 128), E4M3)  # f32 sums exact in any order
  b = small_ints(kb, (48, 128), E4M3)
  sa, sb = np.float32(0.37), np.float32(1.9)
  out = jax.jit(lambda a, b: fp8_matmul(
      a, b, sa, sb, out_dtype=out_dtype, implementation='xla'))(a, b)
  acc = f64_ref(a, b).astype(np.float32)
  want = jnp.asarray(acc * (sa * sb)).astype(out_dtype)
  np.testing.assert_array_equal(out, want)
  if out_dtype == jnp.bfloat16:
    twice = jnp.asarray(acc).astype(out_dtype).astype(jnp.float32) * (sa * sb)
    assert np.any(np.asarray(twice.astype(out_dtype) != want))


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != 'gpu', reason='needs a GPU')
@pytest.mark.parametrize('out_dtype', [jnp.bfloat16, jnp.float32])
def test_xla_gpu_folds_the_scale_into_cublaslt(out_dtype):
  """One cuBLASLt FP8 GEMM with the scale as its operand, no pass over its
  result after it."""
  # Shapes that XLA does not split along K (small ones it may).
  a = jax.ShapeDtypeStruct((2048, 512), E4M3)
  b = jax.ShapeDtypeStruct((1024, 512), E4M3)
  s = jax.ShapeDtypeStruct((), jnp.float32)
  text = jax.jit(lambda a, b, sa, sb: fp8_matmul(
      a, b, sa, sb, out_dtype=out_dtype, implementation='xla')).lower(
          a, b, s, s).compile().as_text()
  entry = text[text.index('ENTRY'):]
  gemms = [line for line in entry.splitlines() if 'custom-call(' in line]
  assert len(gemms) == 1 and '__cublas$lt$matmul$f8' in gemms[0], gemms
  operands = gemms[0].split('custom-call(')[1].split(')')[0].split(', ')
  assert 'constant' not in operands[2], operands  # a_scale: sa * sb
  big = [line for line in entry.splitlines() if ' fusion(' in line
         and '[2048,1024]' in line.split('=')[1].split(' ')[1]]
  assert not big, big


def test_scales_not_one():
  ka, kb = jax.random.split(jax.random.key(2))
  a = (jax.random.normal(ka, (32, 64)) * 3).astype(E4M3)
  b = (jax.random.normal(kb, (16, 64)) * 3).astype(E4M3)
  out = fp8_matmul(a, b, 0.37, 1.9, out_dtype=jnp.float32,
                   implementation='xla')
  np.testing.assert_allclose(out, f64_ref(a, b, 0.37, 1.9), rtol=1e-5,
                             atol=1e-5)


def test_dispatch():
  a = small_ints(jax.random.key(3), (16, 32), E4M3)
  resolve = lambda impl: dispatch.resolve_implementation('fp8_matmul', impl)
  assert resolve(None) == ('xla', False)  # the measured default everywhere
  assert resolve('xla') == ('xla', False)
  if not HOPPER:
    with pytest.raises(ValueError, match='needs a Hopper GPU'):
      fp8_matmul(a, a, 1.0, 1.0, implementation='pallas')
  with pytest.raises(ValueError, match='implementation'):
    fp8_matmul(a, a, 1.0, 1.0, implementation='triton')
  np.testing.assert_array_equal(
      fp8_matmul(a, a, 1.0, 1.0),
      fp8_matmul(a, a, 1.0, 1.0, implementation='xla'))


@pytest.mark.parametrize('kwargs,match', [
    (dict(a=jnp.zeros((16, 32), jnp.bfloat16)), 'a must be float8'),
    (dict(b=jnp.zeros((16, 32), jnp.float32)), 'b must be float8'),
    (dict(a=jnp.zeros((16, 32), E5M2), b=jnp.zeros((16, 32), E5M2)),
     'E5M2 x E5M2'),
    (dict(a=jnp.zeros((24, 32), E4M3)), r'a\.shape.*rows = 24'),
    (dict(b=jnp.zeros((16, 40), E4M3)), r'b\.shape.*K = 40'),
    (dict(b=jnp.zeros((16, 48), E4M3)), 'same K'),
    (dict(a=jnp.zeros((2, 16, 32), E4M3)), 'a must be 2-D'),
    (dict(a_scale=jnp.ones((1,), jnp.float32)), 'block scales are 2-D'),
    (dict(b_scale=jnp.ones((), jnp.float16)), 'b_scale must be float32'),
    (dict(a_scale='1'), 'a_scale'),
    (dict(out_dtype=jnp.float16), 'out_dtype'),
    (dict(implementation='cublas'), 'implementation'),
])
def test_validation(kwargs, match):
  args = dict(a=jnp.zeros((16, 32), E4M3), b=jnp.zeros((32, 32), E4M3),
              a_scale=1.0, b_scale=jnp.float32(1.0))
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    fp8_matmul(args.pop('a'), args.pop('b'), args.pop('a_scale'),
               args.pop('b_scale'), **args)


# Mosaic GPU kernel variants: the default, cuBLASLt's tile shapes with the
# edges left to TMA, three compute warpgroups, stage release and tile overlap.
MOSAIC_CONFIGS = [
    mosaic_gpu.Config(),
    mosaic_gpu.Config(block_n=144, block_k=128, split_k=1, max_stages=6,
                      pad_mn=False),
    mosaic_gpu.Config(block_n=160, block_k=128, split_k=1, max_stages=5,
                      pad_mn=False),
    mosaic_gpu.THREE_WG_CONFIG,
    mosaic_gpu.Config(block_m=192, block_k=128, split_k=1, compute_wgs=3),
    mosaic_gpu.Config(early_release=True),
    dataclasses.replace(mosaic_gpu.THREE_WG_CONFIG, early_release=False),
    dataclasses.replace(mosaic_gpu.THREE_WG_CONFIG, overlap_tiles=False),
]
MOSAIC_IDS = ['default', 'n144_tma_edges', 'n160_tma_edges',
              'three_wg_tma_edges', 'three_wg_padded', 'early_release',
              'three_wg_late_release', 'three_wg_drained']


# The grouped epilogue's: two and three compute warpgroups.
GROUPS_CONFIGS = [mosaic_gpu.DEFAULT_CONFIG, mosaic_gpu.THREE_WG_CONFIG]
GROUPS_IDS = ['default', 'three_wg']


@pytest.mark.parametrize('config', MOSAIC_CONFIGS, ids=MOSAIC_IDS)
def test_mosaic_kernel_lowers_for_cuda(config):
  """Pallas lowers each variant to Mosaic GPU here, without a GPU (E4M3 x
  E4M3: jax 0.10's wgmma rejects mixed FP8, whose fallback is one f16
  config)."""
  a = jax.ShapeDtypeStruct((384, 512), E4M3)
  b = jax.ShapeDtypeStruct((256, 512), E4M3)
  s = jax.ShapeDtypeStruct((), jnp.float32)
  f = jax.jit(lambda a, b, s: mosaic_gpu.fp8_matmul_mosaic(
      a, b, s, config=config))
  text = f.trace(a, b, s).lower(lowering_platforms=('cuda',)).as_text()
  assert 'mosaic_gpu' in text


@pytest.mark.parametrize('out_dtype', [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize('n', [48, 80, 400])
def test_mosaic_tma_edges_lower_for_any_n(out_dtype, n):
  """pad_mn=False: an N that is no multiple of the output's SMEM tiling
  (32 float32 or 64 bfloat16 columns) is padded to one, not rejected by
  the TMA descriptor."""
  a = jax.ShapeDtypeStruct((656, 512), E4M3)
  b = jax.ShapeDtypeStruct((n, 512), E4M3)
  s = jax.ShapeDtypeStruct((), jnp.float32)
  f = jax.jit(lambda a, b, s: mosaic_gpu.fp8_matmul_mosaic(
      a, b, s, out_dtype=out_dtype, config=mosaic_gpu.THREE_WG_CONFIG))
  out = f.trace(a, b, s).lower(lowering_platforms=('cuda',)).out_info
  assert out.shape == (656, n) and out.dtype == out_dtype


def test_mosaic_epilogue_chunks_and_register_bound():
  """Epilogue chunks: the widest divisor of block_n within the SMEM limit
  whose rows span a multiple of 32 B; accumulators: at most 216 registers."""
  chunk = lambda bn, itemsize: mosaic_gpu._epilogue_n(  # pylint: disable=protected-access
      mosaic_gpu.Config(block_n=bn), itemsize, 32 * 1024)
  assert [chunk(bn, 2) for bn in (128, 144, 160, 192, 256)] == [
      128, 48, 80, 96, 128]
  assert [chunk(bn, 4) for bn in (128, 144)] == [64, 48]
  mosaic_gpu.Config(block_n=144).validate(1)  # 72 x 3 = 216 registers
  with pytest.raises(ValueError, match='240 accumulator registers'):
    mosaic_gpu.Config(block_n=160).validate(1)


def test_mosaic_config_errors():
  with pytest.raises(ValueError, match='compute_wgs=4 must be 2 or 3'):
    mosaic_gpu.Config(compute_wgs=4).validate(1)
  with pytest.raises(ValueError, match='multiple of 192'):
    mosaic_gpu.Config(compute_wgs=3).validate(1)
  with pytest.raises(ValueError, match='192 accumulator registers'):
    mosaic_gpu.Config(block_m=192, compute_wgs=3).validate(1)  # split_k 2
  with pytest.raises(ValueError, match='early_release needs promote'):
    mosaic_gpu.Config(promote=False, split_k=1, early_release=True).validate(1)
  with pytest.raises(ValueError, match='overlap_tiles needs promote'):
    mosaic_gpu.Config(promote=False, split_k=1, overlap_tiles=True).validate(1)


def test_overlapped_tiles_need_whole_rounds_of_stages():
  """jax's pipeline of pipelines refills the stages in rounds, so only K
  steps that divide by the stages (or fewer steps than stages) overlap."""
  three = mosaic_gpu.THREE_WG_CONFIG
  assert three.overlap_tiles
  overlaps = lambda k_iters: mosaic_gpu.overlaps_tiles(three, k_iters, 4)
  assert [k for k in range(1, 13) if overlaps(k)] == [1, 2, 3, 4, 8, 12]
  assert overlaps(8192 // 128) and not overlaps(11008 // 128)
  assert not mosaic_gpu.overlaps_tiles(
      dataclasses.replace(three, overlap_tiles=False), 64, 4)


def test_select_config_by_wave_efficiency():
  """192-row tiles wherever their ~3% speed is not lost to a worse last
  wave on 132 SMs: everywhere among the Llama-2-7B shapes but the wgrads
  with M = 4096 (22 x 32 tiles = 5.3 waves); 128-row tiles for small
  problems (one partial wave either way, less of it idle)."""
  select = lambda m, n: mosaic_gpu.select_config(m, n, num_ctas=132)
  three, default = mosaic_gpu.THREE_WG_CONFIG, mosaic_gpu.DEFAULT_CONFIG
  t = 16384
  for m, n in [(8192, 8192), (t, 12288), (t, 4096), (12288, 4096),
               (t, 22016), (22016, 4096), (t, 11008)]:
    assert select(m, n) == three, (m, n)
  for m, n in [(4096, 4096), (4096, 11008), (512, 512), (1024, 768)]:
    assert select(m, n) == default, (m, n)


# ---------------------------------------------------------------- GPU tests


def kernel(a, b, sa=1.0, sb=1.0, out_dtype=jnp.float32):
  """The compiled Mosaic GPU kernel through the public function."""
  return fp8_matmul(a, b, jnp.float32(sa), jnp.float32(sb),
                    out_dtype=out_dtype, implementation='pallas')


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize('a_dtype,b_dtype', MIXES)
@pytest.mark.parametrize('out_dtype', [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize('mnk', [(256, 256, 512), (512, 384, 1024)])
def test_kernel_exact_small_ints(a_dtype, b_dtype, out_dtype, mnk):
  m, n, k = mnk
  ka, kb = jax.random.split(jax.random.key(m + n + k))
  a = small_ints(ka, (m, k), a_dtype)
  b = small_ints(kb, (n, k), b_dtype)
  out = kernel(a, b, out_dtype=out_dtype)
  want = f64_ref(a, b).astype(np.float32)  # |sums| < 2^24: exact in f32
  np.testing.assert_array_equal(
      np.asarray(out, np.float32), want.astype(out_dtype).astype(np.float32))


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize('mnk', [(16, 16, 16), (48, 80, 112), (272, 400, 208),
                                 (1040, 144, 4112)])
@pytest.mark.parametrize('a_dtype,b_dtype', MIXES)
def test_kernel_boundary_shapes_and_scales(mnk, a_dtype, b_dtype):
  m, n, k = mnk
  ka, kb = jax.random.split(jax.random.key(7))
  a = small_ints(ka, (m, k), a_dtype)
  b = small_ints(kb, (n, k), b_dtype)
  out = kernel(a, b, 0.25, 8.0)  # powers of 2: exact
  assert out.shape == (m, n)
  np.testing.assert_array_equal(out, f64_ref(a, b, 0.25, 8.0))
  out = kernel(a, b, 0.3, 1.7, out_dtype=jnp.bfloat16)
  np.testing.assert_allclose(
      np.asarray(out, np.float32), f64_ref(a, b, 0.3, 1.7), rtol=8e-3,
      atol=1e-6)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize('a_dtype,b_dtype', MIXES)
@pytest.mark.parametrize('k', [4096, 16384])
@pytest.mark.parametrize('dist', ['uniform', 'normal'])
def test_kernel_accuracy_vs_cublaslt_precise(a_dtype, b_dtype, k, dist):
  ka, kb = jax.random.split(jax.random.key(k))
  if dist == 'uniform':  # all positive: the worst case for accumulation
    a = jax.random.uniform(ka, (512, k)).astype(a_dtype)
    b = jax.random.uniform(kb, (512, k)).astype(b_dtype)
  else:
    a = jax.random.normal(ka, (512, k)).astype(a_dtype)
    b = jax.random.normal(kb, (512, k)).astype(b_dtype)
  ref = f64_ref(a, b)
  err = rel_err(kernel(a, b), ref)
  xla = fp8_matmul(a, b, 1.0, 1.0, out_dtype=jnp.float32,
                   implementation='xla')
  xla_err = rel_err(xla, ref)
  print(f'{a_dtype.__name__} K={k} {dist}: pallas {err:.2e}'
        f' xla {xla_err:.2e}')
  assert np.isfinite(err)
  # Both promote the tensor cores' partial sums every 128 of K, as cuBLASLt
  # precise does (without promotion the error is far larger).
  assert err <= xla_err + 1e-6, (err, xla_err)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize('config', MOSAIC_CONFIGS, ids=MOSAIC_IDS)
@pytest.mark.parametrize('mnk', [(256, 256, 512), (2048, 1152, 1024),
                                 (2688, 2304, 512), (4224, 2176, 768),
                                 (4224, 2176, 2048), (656, 400, 272)])
def test_mosaic_configs_exact_and_nan_stays_in_its_tile(config, mnk):
  """Exact on small integers with fewer, a few more and many more tiles than
  CTAs (overlapped pipelines then carry their stages across tiles;
  THREE_WG_CONFIG's 4, 8, 4, 16 and 3 K steps
  overlap, its 6 drain) and with M, N, K that divide no tile; a NaN in one
  row of A poisons that row only."""
  m, n, k = mnk
  ka, kb = jax.random.split(jax.random.key(m + k))
  a = small_ints(ka, (m, k), E5M2)
  b = small_ints(kb, (n, k), E4M3)
  out = mosaic_gpu.fp8_matmul_mosaic(a, b, jnp.float32(0.5),
                                     out_dtype=jnp.float32, config=config)
  np.testing.assert_array_equal(out, f64_ref(a, b) * 0.5)
  a = a.at[130, 7].set(jnp.nan)
  out = np.asarray(mosaic_gpu.fp8_matmul_mosaic(
      a, b, jnp.float32(0.5), out_dtype=jnp.float32, config=config))
  assert np.isnan(out[130]).all()
  rows = np.arange(m) != 130
  np.testing.assert_array_equal(out[rows], (f64_ref(a, b) * 0.5)[rows])


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize('config', [c for c, _ in mosaic_gpu.CANDIDATES],
                         ids=['default', 'three_wg'])
@pytest.mark.parametrize('a_dtype', [E4M3, E5M2])
@pytest.mark.parametrize('dist', ['uniform', 'normal'])
def test_candidate_configs_as_accurate_as_cublaslt_precise(config, a_dtype,
                                                          dist):
  """Each config `select_config` can pick, at K = 16384 with partial tiles
  (M = 640, N = 528), against a float64 reference."""
  ka, kb = jax.random.split(jax.random.key(3))
  draw = jax.random.uniform if dist == 'uniform' else jax.random.normal
  a = draw(ka, (640, 16384)).astype(a_dtype)
  b = draw(kb, (528, 16384)).astype(E4M3)
  ref = f64_ref(a, b)
  err = rel_err(mosaic_gpu.fp8_matmul_mosaic(
      a, b, jnp.float32(1), out_dtype=jnp.float32, config=config), ref)
  xla_err = rel_err(fp8_matmul(a, b, 1.0, 1.0, out_dtype=jnp.float32,
                               implementation='xla'), ref)
  assert np.isfinite(err) and err <= xla_err + 1e-6, (err, xla_err)


@pytest.mark.gpu
@needs_hopper
def test_pallas_deterministic_and_default_dispatch():
  ka, kb = jax.random.split(jax.random.key(9))
  a = jax.random.normal(ka, (1024, 2048)).astype(E4M3)
  b = jax.random.normal(kb, (768, 2048)).astype(E4M3)
  # None is the measured-fastest path: cuBLASLt through XLA (RESULTS.md).
  assert dispatch.resolve_implementation('fp8_matmul', None) == ('xla', False)
  f = jax.jit(lambda a, b: fp8_matmul(a, b, 1.0, 1.0, implementation='pallas'))
  out1, out2 = f(a, b), f(a, b)
  assert bool(jnp.all(jnp.isfinite(out1.astype(jnp.float32))))
  np.testing.assert_array_equal(out1, out2)


# ------------------------------------------------- FP8 1x16 grouped output


def grouped_operands(m, n, k, seed, a_dtype=E4M3):
  """Normal operands whose rows span 2^-8..2^4 (group scales vary), with
  row 1 of a all zero and a NaN in row 3 of a (m >= 4)."""
  ka, kb, kr = jax.random.split(jax.random.key(seed), 3)
  rows = 2.0 ** jax.random.randint(kr, (m, 1), -8, 5).astype(jnp.float32)
  a = jnp.clip(jax.random.normal(ka, (m, k)) * rows, -448, 448).astype(a_dtype)
  a = a.at[1].set(0).at[3, 5].set(jnp.nan)
  b = jax.random.normal(kb, (n, k)).astype(E4M3)
  return a, b


def quantized_f32(y, dtype):
  """`quantize_per_group(y, 16, dtype)`, the grouped output's definition."""
  values, scales, _ = group_reference.quantize_per_group(
      y, 16, dtype, False, scale_dtype=jnp.float32)
  return values, scales


def assert_same_groups(got, want):
  for g, w in zip(got, want):
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(np.asarray(g, np.float32),
                                  np.asarray(w, np.float32))


def test_groups_validation():
  a = jnp.zeros((32, 64), E4M3)
  b = jnp.zeros((48, 64), E4M3)
  with pytest.raises(ValueError, match='dtype must be float8'):
    mosaic_gpu.fp8_matmul_mosaic_groups(a, b, jnp.float32(1),
                                        dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match='multiple of 64'):
    mosaic_gpu.fp8_matmul_mosaic_groups(
        a, b, jnp.float32(1), config=mosaic_gpu.Config(block_n=96))


@pytest.mark.parametrize('config', GROUPS_CONFIGS, ids=GROUPS_IDS)
@pytest.mark.parametrize('dtype', [E4M3, E5M2])
def test_mosaic_groups_lower_for_cuda(config, dtype):
  # E4M3 x E4M3, as in test_mosaic_kernel_lowers_for_cuda.
  a = jax.ShapeDtypeStruct((384, 512), E4M3)
  b = jax.ShapeDtypeStruct((208, 512), E4M3)
  s = jax.ShapeDtypeStruct((), jnp.float32)
  f = jax.jit(lambda a, b, s: mosaic_gpu.fp8_matmul_mosaic_groups(
      a, b, s, dtype=dtype, config=config))
  lowered = f.trace(a, b, s).lower(lowering_platforms=('cuda',))
  assert 'mosaic_gpu' in lowered.as_text()
  values, scales = lowered.out_info
  assert values.shape == (384, 208) and values.dtype == dtype
  assert scales.shape == (384, 13) and scales.dtype == jnp.float32


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize('config', GROUPS_CONFIGS, ids=GROUPS_IDS)
@pytest.mark.parametrize('dtype', [E4M3, E5M2])
@pytest.mark.parametrize('mnk', [(256, 256, 512), (208, 208, 512),
                                 (2048, 1152, 1024)])
def test_mosaic_groups_are_its_f32_output_quantized(config, dtype, mnk):
  """Bit for bit `quantize_per_group(y, 16)` of the kernel's own float32
  result y (XLA's rounding on the GPU), zero and NaN rows included."""
  m, n, k = mnk
  a, b = grouped_operands(m, n, k, seed=m + n, a_dtype=E5M2)
  s = jnp.float32(0.75)
  got = jax.jit(lambda a, b: mosaic_gpu.fp8_matmul_mosaic_groups(
      a, b, s, dtype=dtype, config=config))(a, b)
  y = mosaic_gpu.fp8_matmul_mosaic(a, b, s, out_dtype=jnp.float32,
                                   config=config)
  assert_same_groups(got, jax.jit(quantized_f32, static_argnums=1)(y, dtype))
  assert np.isnan(got[1][3]).all() and (got[1][1] == 1).all()


# ------------------------------------------------------------ block scales
# a_scale per (row of a, 128 of K); b_scale per 128x128 block of b or per
# (row of b, 128 of K). 'xla' is an exact emulation: the checks below are
# bit-exact wherever float32 sums are.

BLOCK_PAIRS = [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)]


def pow2_scales(key, shape):
  """Different powers of two in [2^-3, 2^3] (exact products)."""
  return 2.0 ** jax.random.randint(key, shape, -3, 4).astype(jnp.float32)


def block_f64_ref(a, b, a_scale, b_scale):
  """sum_kb (a_kb . b_kb^T) a_scale[:, kb] b_scale[., kb] in float64."""
  a64 = np.asarray(a.astype(jnp.float32), np.float64)
  b64 = np.asarray(b.astype(jnp.float32), np.float64)
  m, k = a64.shape
  n = b64.shape[0]
  sa = np.asarray(a_scale, np.float64)
  sb = np.asarray(b_scale, np.float64)
  if sb.shape[0] != n:
    sb = np.repeat(sb, 128, axis=0)[:n]
  out = np.zeros((m, n))
  for j in range(sa.shape[1]):
    ks = slice(j * 128, min(k, (j + 1) * 128))
    out += (a64[:, ks] @ b64[:, ks].T) * sa[:, j:j + 1] * sb[None, :, j]
  return out


def block_operands(seed, m, n, k, a_dtype, b_dtype, b_per_block):
  keys = jax.random.split(jax.random.key(seed), 4)
  kb, nb = -(-k // 128), -(-n // 128)
  a = small_ints(keys[0], (m, k), a_dtype)
  b = small_ints(keys[1], (n, k), b_dtype)
  a_scale = pow2_scales(keys[2], (m, kb))
  b_scale = pow2_scales(keys[3], (nb if b_per_block else n, kb))
  return a, b, a_scale, b_scale


@pytest.mark.parametrize('a_dtype,b_dtype', BLOCK_PAIRS)
@pytest.mark.parametrize('b_per_block', [True, False])
@pytest.mark.parametrize('mnk', [(48, 160, 384), (16, 16, 16),
                                 (144, 272, 208)])
def test_block_xla_exact_on_representable(a_dtype, b_dtype, b_per_block,
                                          mnk):
  m, n, k = mnk
  a, b, sa, sb = block_operands(m + n + k, m, n, k, a_dtype, b_dtype,
                                b_per_block)
  want = block_f64_ref(a, b, sa, sb)
  assert len(np.unique(np.asarray(sa))) > 1 or sa.size == 1
  out = fp8_matmul(a, b, sa, sb, out_dtype=jnp.float32, implementation='xla')
  assert out.shape == (m, n) and out.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(out), want)
  out = fp8_matmul(a, b, sa, sb, implementation=None)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_array_equal(
      np.asarray(out, np.float32),
      want.astype(np.float32).astype(jnp.bfloat16).astype(np.float32))
  ref = api.reference.fp8_matmul_block_reference(a, b, sa, sb,
                                                 out_dtype=jnp.float32)
  np.testing.assert_array_equal(np.asarray(ref), want)


def test_block_random_inputs_against_float64():
  from coat_jax import quant
  keys = jax.random.split(jax.random.key(20), 2)
  x = jax.random.normal(keys[0], (64, 1024))
  w = jax.random.normal(keys[1], (96, 1024)) * 0.02
  qa = quant.quantize_blockwise(x, (1, 128), 'e4m3')
  qb = quant.quantize_blockwise(w, (128, 128), 'e4m3')
  out = fp8_matmul(qa.values, qb.values, qa.scale, qb.scale,
                   out_dtype=jnp.float32, implementation='xla')
  want = block_f64_ref(qa.values, qb.values, qa.scale, qb.scale)
  # float32 sums of exact products: within a few ulps of float64
  assert rel_err(out, want) < 1e-6


@pytest.mark.parametrize('factor,ratio', [(1e2, 1.05), (1e4, 0.85)])
def test_block_scaling_beats_tensor_scaling_on_outliers(factor, ratio):
  """A few rows of x (tokens) and of W^T (output channels) `factor` larger,
  the rest with lognormal row magnitudes; error away from the outliers.

  Measured: at 100x both errors are E4M3's rounding (~3.7%: E4M3's normal
  range, 448 / 2^-6, absorbs a 100x outlier), block scaling no worse; at
  10^4x per-tensor scales push the rest into E4M3's subnormals
  (5.7%) while tiles and blocks stay at 4.3% (the outlier channels' weight
  blocks crush their 126 neighbours).
  """
  from coat_jax import quant
  keys = jax.random.split(jax.random.key(21), 3)
  x = np.array(jax.random.normal(keys[0], (256, 512)))
  x *= np.exp(np.array(jax.random.normal(keys[2], (256, 1))))
  w = np.array(jax.random.normal(keys[1], (384, 512)) * 0.02)
  x[[3, 77, 200]] *= factor
  w[[5, 300]] *= factor
  exact = x.astype(np.float64) @ w.astype(np.float64).T
  qa = quant.quantize_blockwise(jnp.asarray(x), (1, 128), 'e4m3')
  qb = quant.quantize_blockwise(jnp.asarray(w), (128, 128), 'e4m3')
  block = fp8_matmul(qa.values, qb.values, qa.scale, qb.scale,
                     out_dtype=jnp.float32, implementation='xla')
  ta = quant.quantize_per_tensor(jnp.asarray(x), 'e4m3')
  tb = quant.quantize_per_tensor(jnp.asarray(w), 'e4m3')
  tensor = fp8_matmul(ta.values, tb.values, ta.scale, tb.scale,
                      out_dtype=jnp.float32, implementation='xla')
  rows = np.setdiff1d(np.arange(256), [3, 77, 200])[:, None]
  cols = np.setdiff1d(np.arange(384), [5, 300])[None, :]

  def err(out):  # relative Frobenius error away from the outliers
    d = np.asarray(out, np.float64)[rows, cols] - exact[rows, cols]
    return np.linalg.norm(d) / np.linalg.norm(exact[rows, cols])

  e_block, e_tensor = err(block), err(tensor)
  print(f'outliers {factor:g}x: block-scaled error {e_block:.3e}, per-tensor'
        f' {e_tensor:.3e}')
  assert e_block < ratio * e_tensor


def test_block_zero_tile_and_nan_confined():
  from coat_jax import quant
  keys = jax.random.split(jax.random.key(22), 2)
  x = np.array(jax.random.normal(keys[0], (48, 272)))
  w = jax.random.normal(keys[1], (160, 272))
  x[:, 128:256] = 0.0  # zero tiles (scale 1, codes 0)
  qb = quant.quantize_blockwise(w, (128, 128))
  qa = quant.quantize_blockwise(jnp.asarray(x), (1, 128))
  clean = fp8_matmul(qa.values, qb.values, qa.scale, qb.scale,
                     out_dtype=jnp.float32, implementation='xla')
  assert rel_err(clean, block_f64_ref(qa.values, qb.values, qa.scale,
                                      qb.scale)) < 1e-6
  x[7, 3] = np.nan
  x[9, 260] = np.inf
  qa = quant.quantize_blockwise(jnp.asarray(x), (1, 128))
  out = np.asarray(fp8_matmul(qa.values, qb.values, qa.scale, qb.scale,
                              out_dtype=jnp.float32, implementation='xla'))
  assert np.isnan(out[[7, 9]]).all()
  rest = np.setdiff1d(np.arange(48), [7, 9])
  np.testing.assert_array_equal(out[rest], np.asarray(clean)[rest])
  # A NaN weight block poisons only the output columns of that block.
  wn = np.array(w)
  wn[140, 5] = np.nan
  qn = quant.quantize_blockwise(jnp.asarray(wn), (128, 128))
  x[7, 3] = x[9, 260] = 1.0
  qa = quant.quantize_blockwise(jnp.asarray(x), (1, 128))
  out = np.asarray(fp8_matmul(qa.values, qn.values, qa.scale, qn.scale,
                              out_dtype=jnp.float32, implementation='xla'))
  assert np.isnan(out[:, 128:]).all() and np.isfinite(out[:, :128]).all()


def test_block_scale_validation():
  a, b, sa, sb = block_operands(1, 32, 144, 256, E4M3, E4M3, True)
  with pytest.raises(ValueError,
                     match=r'a_scale has shape \(32, 1\).*\(32, 2\)'):
    fp8_matmul(a, b, sa[:, :1], sb, implementation='xla')
  with pytest.raises(ValueError,
                     match=r'b_scale has shape.*\(2, 2\).*\(144, 2\)'):
    fp8_matmul(a, b, sa, sb[:1], implementation='xla')
  with pytest.raises(ValueError, match='b_scale must be float32'):
    fp8_matmul(a, b, sa, sb.astype(jnp.bfloat16), implementation='xla')
  with pytest.raises(ValueError, match='both a_scale and b_scale'):
    fp8_matmul(a, b, sa, 1.0, implementation='xla')
  with pytest.raises(ValueError, match='both a_scale and b_scale'):
    fp8_matmul(a, b, jnp.float32(1), sb, implementation='xla')
  with pytest.raises(ValueError, match='implementation'):
    fp8_matmul(a, b, sa, sb, implementation='triton')
  with pytest.raises(ValueError, match='E5M2 x E5M2'):
    fp8_matmul(a.astype(E5M2), b.astype(E5M2), sa, sb, implementation='xla')
  if not HOPPER:
    with pytest.raises(ValueError, match='Hopper'):
      fp8_matmul(a, b, sa, sb, implementation='pallas')


@pytest.mark.parametrize('n,b_per_block', [(256, True), (144, True),
                                           (144, False)])
def test_block_pallas_glue_pads_k_and_expands_scales(monkeypatch, n,
                                                     b_per_block):
  """The call into the Mosaic kernel: K padded to 128 with zero codes and
  scale 1, b's scales per row unless N is a multiple of 128 (a stand-in
  for the kernel, with its contract, checks the arguments)."""
  calls = []

  def stand_in(a, b, a_scale, b_scale, *, out_dtype=jnp.bfloat16,
               config=None, c=None):
    del config
    m, k = a.shape
    assert k % 128 == 0 and b.shape[1] == k
    assert a_scale.shape == (m, k // 128)
    rows = b.shape[0] if b_scale.shape[0] == b.shape[0] else b.shape[0] // 128
    assert b_scale.shape == (rows, k // 128)
    calls.append(b_scale.shape)
    return api.reference.fp8_matmul_block_reference(
        a, b, a_scale, b_scale, out_dtype=out_dtype, c=c)

  monkeypatch.setattr(mosaic_gpu_block, 'fp8_matmul_block_scaled_mosaic',
                      stand_in)
  a, b, sa, sb = block_operands(2, 32, n, 208, E5M2, E4M3, b_per_block)
  out = api._pallas_block_matmul(a, b, sa, sb, jnp.float32)  # pylint: disable=protected-access
  np.testing.assert_array_equal(np.asarray(out), block_f64_ref(a, b, sa, sb))
  want_rows = n // 128 if (b_per_block and n % 128 == 0) else n
  assert calls == [(want_rows, 2)]


@pytest.mark.gpu
@pytest.mark.parametrize('implementation', ['xla', 'pallas'])
@pytest.mark.parametrize('a_dtype,b_dtype', BLOCK_PAIRS)
@pytest.mark.parametrize('b_per_block', [True, False])
@pytest.mark.parametrize('mnk', [(256, 384, 1024), (144, 272, 208),
                                 (2048, 5632, 2048)])
def test_gpu_block_exact_on_representable(implementation, a_dtype, b_dtype,
                                          b_per_block, mnk):
  m, n, k = mnk
  a, b, sa, sb = block_operands(3, m, n, k, a_dtype, b_dtype, b_per_block)
  out = fp8_matmul(a, b, sa, sb, out_dtype=jnp.float32,
                   implementation=implementation)
  np.testing.assert_array_equal(np.asarray(out), block_f64_ref(a, b, sa, sb))


@pytest.mark.gpu
@pytest.mark.parametrize('implementation', ['xla', 'pallas'])
@pytest.mark.parametrize('k', [4096, 16384])
def test_gpu_block_accuracy_vs_cublaslt_precise(implementation, k):
  """Random operands: the block-scaled GEMM's error against float64 is no
  worse than cuBLASLt precise on the same FP8 codes (per-tensor)."""
  keys = jax.random.split(jax.random.key(k), 2)
  a = jax.random.uniform(keys[0], (512, k), minval=0, maxval=4).astype(E4M3)
  b = jax.random.uniform(keys[1], (256, k), minval=0, maxval=4).astype(E4M3)
  kb = k // 128
  sa = jnp.ones((512, kb), jnp.float32)
  sb = jnp.ones((2, kb), jnp.float32)
  want = f64_ref(a, b)
  block = fp8_matmul(a, b, sa, sb, out_dtype=jnp.float32,
                     implementation=implementation)
  precise = fp8_matmul(a, b, 1.0, 1.0, out_dtype=jnp.float32,
                       implementation='xla')
  e_block, e_precise = rel_err(block, want), rel_err(precise, want)
  print(f'K={k}: block {implementation} {e_block:.2e}, cuBLASLt precise'
        f' {e_precise:.2e}')
  assert e_block <= max(1.5 * e_precise, 1e-6)
