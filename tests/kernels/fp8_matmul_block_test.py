"""Tests of the block-scaled FP8 GEMM (pallas_kernels/fp8_matmul/
mosaic_gpu_block.py).

CPU: argument and config validation, the scale layout the kernel reads
(checked against a float64 emulation of the kernel's own indexing), and
that every variant lowers to Mosaic GPU for CUDA. GPU (marked `gpu`, skipped
without a Hopper GPU): against a float64 numpy reference written here,
exact on representable inputs with power-of-two per-tile and per-block
scales, bit-identical to the per-tensor kernel with unit scales, as accurate
as the per-tensor kernel and cuBLASLt precise on random quantized inputs,
boundary and tiny shapes, zero tiles, NaN/Inf confined to their rows or
columns, and Llama shapes (sampled rows).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch
from pallas_kernels.fp8_matmul import api
from pallas_kernels.fp8_matmul import mosaic_gpu
from pallas_kernels.fp8_matmul import mosaic_gpu_block

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
PAIRS = [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)]
PAIR_IDS = ['e4m3_e4m3', 'e5m2_e4m3', 'e4m3_e5m2']
# select_config's three-warpgroup tiles (released at the step's end, or
# early below two waves of tiles) and two-warpgroup ones.
CONFIGS = [mosaic_gpu_block.BLOCK_THREE_WG_CONFIG, mosaic_gpu.THREE_WG_CONFIG,
           mosaic_gpu.DEFAULT_CONFIG]
CONFIG_IDS = ['three_wg', 'three_wg_early', 'default']
GRANULARITIES = ['block', 'row']
needs_hopper = pytest.mark.skipif(
    not dispatch.MOSAIC_GPU.compiles_here(),
    reason='needs a Hopper GPU with Mosaic GPU')


def small_ints(key, shape, dtype, lo=-4, hi=4):
  """Integers in [lo, hi): exact in E4M3 and E5M2."""
  return jax.random.randint(key, shape, lo, hi).astype(jnp.float32).astype(
      dtype)


def scale_shapes(m, n, k, granularity):
  nb = n if granularity == 'row' else -(-n // 128)
  return (m, k // 128), (nb, k // 128)


def pow2_scales(key, m, n, k, granularity, lo=-2, hi=2):
  """float32 a_scale and b_scale of random powers of two 2^lo .. 2^hi."""
  ka, kb = jax.random.split(key)
  draw = lambda key, shape: 2.0 ** jax.random.randint(
      key, shape, lo, hi + 1).astype(jnp.float32)
  sa_shape, sb_shape = scale_shapes(m, n, k, granularity)
  return draw(ka, sa_shape), draw(kb, sb_shape)


def f64(x):
  return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def ref_f64(a, b, a_scale, b_scale, granularity, blas=True):
  """float64 sum over K blocks of (a_kb @ b_kb.T) * a_scale * b_scale.

  blas=False sums with einsum loops instead of BLAS, whose kernels need not
  follow IEEE for Inf * 0.
  """
  a, b, sa, sb = f64(a), f64(b), f64(a_scale), f64(b_scale)
  (m, k), n = a.shape, b.shape[0]
  if granularity == 'block':
    sb = np.repeat(sb, 128, axis=0)[:n]
  out = np.zeros((m, n))
  for j in range(k // 128):
    ks = slice(j * 128, (j + 1) * 128)
    if blas:
      part = a[:, ks] @ b[:, ks].T
    else:
      part = np.einsum('mk,nk->mn', a[:, ks], b[:, ks], optimize=False)
    with np.errstate(invalid='ignore'):  # Inf * 0 is NaN on purpose
      out += part * sa[:, j:j + 1] * sb[None, :, j]
  return out


def block_kernel(a, b, sa, sb, granularity, config=None,
                 out_dtype=jnp.float32):
  return mosaic_gpu_block.fp8_matmul_block_scaled_mosaic(
      a, b, sa, sb, b_granularity=granularity, out_dtype=out_dtype,
      config=config)


def abstract_operands(m, n, k, granularity, transposed=False):
  """Shapes of (a, b, a_scale, b_scale) for lowering an (M, K) x (N, K)
  product without arrays; scales K-block first if transposed."""
  sa_shape, sb_shape = mosaic_gpu_block.scale_shapes(
      m, n, k, granularity, a_scale_transposed=transposed,
      b_scale_transposed=transposed)
  return (jax.ShapeDtypeStruct((m, k), E4M3),
          jax.ShapeDtypeStruct((n, k), E4M3),
          jax.ShapeDtypeStruct(sa_shape, jnp.float32),
          jax.ShapeDtypeStruct(sb_shape, jnp.float32))


def lower_for_cuda(f, *shapes):
  """f jitted and lowered for CUDA on this host (no GPU needed)."""
  return jax.jit(f).trace(*shapes).lower(lowering_platforms=('cuda',))


def rel_err(out, ref):
  out = np.asarray(out, np.float64)
  return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


# ---------------------------------------------------------------- CPU tests


def _args(m=64, n=256, k=256, granularity='block', **kw):
  sa_shape, sb_shape = scale_shapes(m, n, k, granularity)
  args = dict(a=jnp.zeros((m, k), E4M3), b=jnp.zeros((n, k), E4M3),
              a_scale=jnp.ones(sa_shape, jnp.float32),
              b_scale=jnp.ones(sb_shape, jnp.float32),
              b_granularity=granularity)
  args.update(kw)
  return args


@pytest.mark.parametrize('kwargs,match', [
    (dict(b_granularity='tile'), "b_granularity must be 'block' or 'row'"),
    (dict(a=jnp.zeros((64, 256), jnp.bfloat16)), 'need float8_e4m3fn'),
    (dict(a=jnp.zeros((64, 256), E5M2), b=jnp.zeros((256, 256), E5M2)),
     'need float8_e4m3fn'),
    (dict(a=jnp.zeros((2, 64, 256), E4M3)), 'a must be 2-D'),
    (dict(b=jnp.zeros((256, 384), E4M3)), 'same K'),
    (dict(a=jnp.zeros((64, 192), E4M3), b=jnp.zeros((256, 192), E4M3)),
     'K a multiple of 128'),
    (dict(a=jnp.zeros((72, 256), E4M3)), 'M, N multiples of 16'),
    (dict(b=jnp.zeros((264, 256), E4M3)), 'M, N multiples of 16'),
    (dict(a_scale=jnp.ones((64, 3), jnp.float32)),
     r'a_scale has shape \(64, 3\); need \(64, 2\)'),
    (dict(b_scale=jnp.ones((256, 2), jnp.float32)),
     r"b_scale has shape \(256, 2\); need \(2, 2\).*'block'"),
    (dict(**_args(granularity='row', b_scale=jnp.ones((2, 2), jnp.float32))),
     r"b_scale has shape \(2, 2\); need \(256, 2\).*'row'"),
    (dict(a_scale=jnp.ones((64, 2), jnp.bfloat16)),
     'a_scale must be float32'),
    (dict(b_scale=jnp.ones((2, 2), jnp.float16)), 'b_scale must be float32'),
    (dict(out_dtype=jnp.float16), 'out_dtype must be bfloat16 or float32'),
])
def test_validation(kwargs, match):
  args = _args()
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    mosaic_gpu_block.fp8_matmul_block_scaled_mosaic(**args)


@pytest.mark.parametrize('granularity,a_t,b_t,match', [
    ('block', True, False,
     r'a_scale has shape \(64, 2\); need \(2, 64\).*a_scale_transposed=True'),
    ('row', False, True, r'b_scale has shape \(256, 2\); need \(2, 256\)'),
])
def test_validation_of_transposed_scales(granularity, a_t, b_t, match):
  """Scales in (M, K / 128) layout passed as transposed ones."""
  args = _args(granularity=granularity, a_scale_transposed=a_t,
               b_scale_transposed=b_t)
  with pytest.raises(ValueError, match=match):
    mosaic_gpu_block.fp8_matmul_block_scaled_mosaic(**args)


def test_validation_of_transposed_block_scales():
  """'block' b scales transposed: (K / 128, cdiv(N, 128))."""
  args = _args(n=400, b_scale=jnp.ones((4, 2), jnp.float32),
               b_scale_transposed=True)
  with pytest.raises(ValueError, match=r'need \(2, 4\)'):
    mosaic_gpu_block.fp8_matmul_block_scaled_mosaic(**args)


@pytest.mark.parametrize('granularity', GRANULARITIES)
@pytest.mark.parametrize('transposed', [False, True])
def test_granularity_read_from_the_b_scale_shape(granularity, transposed):
  """b_granularity=None (how api.py calls the kernel) reads it from
  b_scale's shape: the same kernel as the explicit granularity."""
  shapes = abstract_operands(384, 256, 512, granularity, transposed)
  texts = [lower_for_cuda(lambda a, b, sa, sb, g=g: (
      mosaic_gpu_block.fp8_matmul_block_scaled_mosaic(
          a, b, sa, sb, b_granularity=g, a_scale_transposed=transposed,
          b_scale_transposed=transposed)), *shapes).as_text()
           for g in (None, granularity)]
  assert texts[0] == texts[1]


def test_granularity_of_a_wrong_b_scale_shape():
  args = _args(b_scale=jnp.ones((3, 2), jnp.float32), b_granularity=None)
  with pytest.raises(ValueError, match=r'N = 256.*cdiv\(N, 128\) = 2'):
    mosaic_gpu_block.fp8_matmul_block_scaled_mosaic(**args)


def test_validation_of_odd_n_block_scales():
  """N not a multiple of 128: 'block' b scales cover the last, partial
  block (cdiv(N, 128) rows)."""
  args = _args(n=400, b_scale=jnp.ones((3, 2), jnp.float32))
  with pytest.raises(ValueError, match=r'need \(4, 2\)'):
    mosaic_gpu_block.fp8_matmul_block_scaled_mosaic(**args)


@pytest.mark.parametrize('config,granularity,match', [
    (mosaic_gpu.Config(promote=False, split_k=1), 'block',
     'promote=True and block_k == 128'),
    (mosaic_gpu.Config(block_k=256, split_k=1), 'row',
     'promote=True and block_k == 128'),
    (mosaic_gpu.Config(block_n=144, block_k=128, split_k=1), 'block',
     'block_n == 128'),
    (mosaic_gpu.Config(block_n=144, block_k=128, split_k=1), 'row',
     'multiple of 32'),
    (mosaic_gpu.Config(compute_wgs=3), 'block', 'multiple of 192'),
])
def test_config_validation(config, granularity, match):
  with pytest.raises(ValueError, match=match):
    mosaic_gpu_block.validate_config(config, granularity)
  with pytest.raises(ValueError, match=match):
    mosaic_gpu_block.fp8_matmul_block_scaled_mosaic(
        **_args(granularity=granularity, config=config))


def test_block_scales_prefer_three_warpgroups_at_the_1b_outputs():
  """'block' b scales weigh 192-row tiles 6% faster per tile (measured),
  the per-tensor kernel 3%: at the 1b model's 16384 x 2048 outputs (94%
  against 97% wave efficiency) the block kernel takes 192 x 128 tiles where
  the per-tensor one keeps 128 x 128; few tiles (o wgrad, 2048 x 2048: 1.3
  waves of 192-row tiles) still go to 128 x 128. 'row' scales keep the
  per-tensor weights."""
  three = mosaic_gpu_block.BLOCK_THREE_WG_CONFIG
  default = mosaic_gpu.DEFAULT_CONFIG
  block = lambda m, n, g='block': mosaic_gpu_block.select_config(
      m, n, 132, b_granularity=g)
  for m, n in [(16384, 2048), (16384, 2560), (16384, 5632), (8192, 8192)]:
    assert block(m, n) == three, (m, n)
  for m, n in [(2048, 2048), (4096, 4096), (512, 512)]:
    assert block(m, n) == default, (m, n)
  assert mosaic_gpu.select_config(16384, 2048, num_ctas=132) == default
  assert block(16384, 2048, 'row') == default


def test_three_warpgroup_block_tiles_release_early_only_below_two_waves():
  """192 x 128 tiles with 'block' scales release their stages at the
  step's end (one barrier a stage) from two waves of tiles on, early (a
  barrier per input) below: the 1b qkv wgrad, 2560 x 2048, is 224 tiles,
  1.7 waves of 132."""
  block = lambda m, n, ctas=132: mosaic_gpu_block.select_config(
      m, n, ctas, b_granularity='block')
  early = mosaic_gpu.THREE_WG_CONFIG
  assert early.early_release
  assert not mosaic_gpu_block.BLOCK_THREE_WG_CONFIG.early_release
  assert block(2560, 2048) == early
  assert block(5632, 2048) == mosaic_gpu_block.BLOCK_THREE_WG_CONFIG
  assert dataclasses.replace(block(2560, 2048), early_release=False) == (
      block(5632, 2048))


def test_float32_outputs_of_three_warpgroups_buffer_the_whole_tile():
  """plan_smem: a buffer per epilogue chunk (4 of 32 float32 columns at
  192 x 128, one stage fewer: 3) for float32 outputs of three warpgroups,
  and everything fits shared memory; one buffer otherwise."""
  budget = 226 * 1024
  scale_bytes = lambda cfg, g: 4 * cfg.split_k * (
      cfg.block_m + (cfg.block_n if g == 'row' else 32))
  plans = {}
  for config, cid in zip(CONFIGS, CONFIG_IDS):
    for g in GRANULARITIES:
      for out_dtype in (jnp.bfloat16, jnp.float32):
        stages, epi_n, slots = plans[cid, g, jnp.dtype(out_dtype).name] = (
            mosaic_gpu_block.plan_smem(config, out_dtype,
                                       scale_bytes(config, g)))
        itemsize = jnp.dtype(out_dtype).itemsize
        used = (stages * ((config.block_m + config.block_n)
                          * config.block_k + scale_bytes(config, g))
                + slots * config.block_m * epi_n * itemsize)
        assert used <= budget, (cid, g, out_dtype)
        assert config.block_n % (epi_n * slots) == 0
        assert stages >= 2
  assert plans['three_wg', 'block', 'float32'] == (3, 32, 4)
  assert plans['three_wg', 'row', 'float32'] == (3, 32, 4)
  assert plans['three_wg', 'block', 'bfloat16'] == (4, 64, 1)
  assert plans['default', 'block', 'float32'][2] == 1


def test_candidate_configs_are_valid():
  for config in CONFIGS:
    for granularity in GRANULARITIES:
      mosaic_gpu_block.validate_config(config, granularity)


def emulate_kernel(a, b, a_s, b_s, granularity, cfg):
  """float64 result computed the way the kernel indexes its operands: per
  (M tile, N tile, warpgroup, K step, partial j) with the laid-out scales
  (`scale_layout`), over A and B zero-padded to whole tiles. Scale blocks
  reaching past an array's end read zeros there (TMA's fill)."""
  a, b, a_s, b_s = f64(a), f64(b), np.asarray(a_s), np.asarray(b_s)
  (m, k), n = a.shape, b.shape[0]
  mt, nt = -(-m // cfg.block_m), -(-n // cfg.block_n)
  kp = -(-k // cfg.block_k) * cfg.block_k
  a = np.pad(a, ((0, mt * cfg.block_m - m), (0, kp - k)))
  b = np.pad(b, ((0, nt * cfg.block_n - n), (0, kp - k)))
  pad_to = lambda x, shape: np.pad(
      x, [(0, max(0, t - d)) for d, t in zip(x.shape, shape)])
  a_s = pad_to(a_s, (kp // 128, mt * cfg.compute_wgs, cfg.wg_m))
  if granularity == 'row':
    b_s = pad_to(b_s, (kp // 128, nt * cfg.block_n))
  else:  # the kernel reads TMA blocks of 32 N tiles
    b_s = pad_to(b_s, (kp // 128, -(-nt // 32) * 32))
  out = np.zeros((mt * cfg.block_m, nt * cfg.block_n))
  for mi in range(mt):
    for ni in range(nt):
      for wg in range(cfg.compute_wgs):
        rows = slice(mi * cfg.block_m + wg * cfg.wg_m,
                     mi * cfg.block_m + (wg + 1) * cfg.wg_m)
        cols = slice(ni * cfg.block_n, (ni + 1) * cfg.block_n)
        for step in range(kp // cfg.block_k):
          for j in range(cfg.split_k):
            kb = step * cfg.split_k + j
            ks = slice(kb * 128, (kb + 1) * 128)
            part = a[rows, ks] @ b[cols, ks].T
            # The kernel's TMA block of a_s: [kb, mi * wgs : (mi+1) * wgs].
            s_rows = a_s[kb, mi * cfg.compute_wgs + wg]
            if granularity == 'row':
              s_cols = b_s[kb, cols]
              out[rows, cols] += part * s_rows[:, None] * s_cols[None, :]
            else:
              s_block = b_s[kb, ni]
              out[rows, cols] += part * s_rows[:, None] * s_block
  return out[:m, :n]


@pytest.mark.parametrize('config', CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize('granularity', GRANULARITIES)
@pytest.mark.parametrize('mnk', [(208, 400, 640), (16, 144, 128)])
def test_scale_layout_matches_the_kernels_indexing(config, granularity,
                                                   mnk):
  m, n, k = mnk
  ka, kb, ks = jax.random.split(jax.random.key(m + n + k), 3)
  a = small_ints(ka, (m, k), E4M3)
  b = small_ints(kb, (n, k), E4M3)
  sa, sb = pow2_scales(ks, m, n, k, granularity)
  a_s, b_s = mosaic_gpu_block.scale_layout(sa, sb, granularity, config)
  kbp = -(-k // config.block_k) * config.block_k // 128
  assert a_s.shape == (kbp, -(-m // config.block_m) * config.compute_wgs,
                       config.wg_m)
  if granularity == 'block':  # K-block first, N tiles padded to TMA rows
    n_tiles = -(-n // config.block_n)
    assert b_s.shape == (kbp, -(-n_tiles // 4) * 4)
  assert a_s.dtype == b_s.dtype == jnp.float32
  np.testing.assert_array_equal(
      emulate_kernel(a, b, a_s, b_s, granularity, config),
      ref_f64(a, b, sa, sb, granularity))


# (M, N, K): M a multiple of 64 but of no tile (the last tile's a_s block
# reaches past the array), K / 128 odd (DEFAULT_CONFIG pads it); M not a
# multiple of 64 (padded); tiny.
TRANSPOSED_SHAPES = [(640, 400, 384), (208, 400, 640), (16, 16, 128)]


@pytest.mark.parametrize('config', CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize('granularity', GRANULARITIES)
@pytest.mark.parametrize('mnk', TRANSPOSED_SHAPES)
@pytest.mark.parametrize('a_t,b_t', [(True, True), (True, False),
                                     (False, True)])
def test_transposed_scale_layout_matches_the_kernels_indexing(
    config, granularity, mnk, a_t, b_t):
  """Scales given K-block first are read as given (a reshape), zero-padded
  only where the shape needs it."""
  m, n, k = mnk
  ka, kb, ks = jax.random.split(jax.random.key(m + n + k + 1), 3)
  a = small_ints(ka, (m, k), E4M3)
  b = small_ints(kb, (n, k), E4M3)
  sa, sb = pow2_scales(ks, m, n, k, granularity)
  a_s, b_s = mosaic_gpu_block.scale_layout(
      sa.T if a_t else sa, sb.T if b_t else sb, granularity, config,
      a_scale_transposed=a_t, b_scale_transposed=b_t)
  if a_t and m % config.wg_m == 0:  # no copy: a view of the input
    np.testing.assert_array_equal(
        a_s.reshape(a_s.shape[0], -1)[:k // 128], sa.T)
  np.testing.assert_array_equal(
      emulate_kernel(a, b, a_s, b_s, granularity, config),
      ref_f64(a, b, sa, sb, granularity))


def test_transposed_scales_run_no_layout_ops():
  """K-block-first scales of whole 64-row, split_k-K-block shapes (and N
  tiles a multiple of 4) reach the kernel with no transpose, pad or copy
  before it."""
  m, n, k = 640, 512, 512
  for config in CONFIGS:
    for granularity in GRANULARITIES:
      sa_shape, sb_shape = mosaic_gpu_block.scale_shapes(
          m, n, k, granularity, a_scale_transposed=True,
          b_scale_transposed=True)
      f = lambda a, b, sa, sb, config=config, granularity=granularity: (
          mosaic_gpu_block.fp8_matmul_block_scaled_mosaic(
              a, b, sa, sb, b_granularity=granularity,
              config=dataclasses.replace(config, pad_mn=False),
              a_scale_transposed=True, b_scale_transposed=True))
      jaxpr = jax.make_jaxpr(f)(
          jnp.zeros((m, k), E4M3), jnp.zeros((n, k), E4M3),
          jnp.ones(sa_shape, jnp.float32), jnp.ones(sb_shape, jnp.float32))
      prims = _outer_primitives(jaxpr.jaxpr)
      assert prims - {'jit', 'pjit'}, prims  # the kernel call's own jit
      assert not prims & {'transpose', 'pad', 'concatenate', 'copy',
                          'gather'}, (config, granularity, prims)


def test_equal_calls_share_one_kernel_trace():
  """Equal GEMMs (shapes, dtypes, config) trace and lower the kernel once:
  unrolled layers would otherwise lower it once per call (~0.7 s each)."""
  m, n, k = 256, 256, 512
  sa_shape, sb_shape = scale_shapes(m, n, k, 'block')
  args = (jnp.zeros((m, k), E4M3), jnp.zeros((n, k), E4M3),
          jnp.ones(sa_shape, jnp.float32), jnp.ones(sb_shape, jnp.float32))

  def three_layers(a, b, sa, sb):
    outs = [mosaic_gpu_block.fp8_matmul_block_scaled_mosaic(
        a, b, sa * i, sb, config=CONFIGS[0]) for i in (1, 2, 3)]
    return sum(o.astype(jnp.float32) for o in outs)

  calls = [e for e in jax.make_jaxpr(three_layers)(*args).jaxpr.eqns
           if e.primitive.name in ('jit', 'pjit')
           and e.params['name'] == '_call_kernel']
  assert len(calls) == 3
  assert len({id(e.params['jaxpr']) for e in calls}) == 1


def _outer_primitives(jaxpr) -> set[str]:
  """The primitives of `jaxpr` and of the jits inside it (the kernel call
  is one), not those of the kernel's body."""
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    if eqn.primitive.name in ('jit', 'pjit'):
      names |= _outer_primitives(eqn.params['jaxpr'].jaxpr)
  return names


LOWERING_CASES = [
    (cfg, gran, mnk, out_dtype)
    for cfg in CONFIGS for gran in GRANULARITIES
    for mnk, out_dtype in (((384, 256, 512), jnp.bfloat16),
                           ((656, 400, 640), jnp.float32))]


@pytest.mark.parametrize(
    'config,granularity,mnk,out_dtype', LOWERING_CASES,
    ids=[f'{c}-{g}-{o}' for c in CONFIG_IDS for g in GRANULARITIES
         for o in ('bf16', 'f32')])
def test_lowers_for_cuda(config, granularity, mnk, out_dtype):
  """Pallas lowers each variant to Mosaic GPU here, without a GPU (E4M3 x
  E4M3: jax 0.10's wgmma rejects mixed FP8)."""
  m, n, k = mnk
  lowered = lower_for_cuda(lambda a, b, sa, sb: block_kernel(
      a, b, sa, sb, granularity, config, out_dtype),
                           *abstract_operands(m, n, k, granularity))
  assert 'mosaic_gpu' in lowered.as_text()
  assert 'fp8_matmul_block' in lowered.as_text()  # named for profiles
  assert lowered.out_info.shape == (m, n)
  assert lowered.out_info.dtype == out_dtype


@pytest.mark.parametrize('config', CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize('out_dtype', [jnp.bfloat16, jnp.float32])
def test_c_operand_lowers_for_cuda(config, out_dtype):
  """With c (added in the epilogue, copied by TMA through its buffer)."""
  m, n, k = 656, 400, 640
  lowered = lower_for_cuda(
      lambda a, b, sa, sb, c: mosaic_gpu_block.fp8_matmul_block_scaled_mosaic(
          a, b, sa, sb, c=c, out_dtype=out_dtype, config=config),
      *abstract_operands(m, n, k, 'block'),
      jax.ShapeDtypeStruct((m, n), out_dtype))
  assert 'mosaic_gpu' in lowered.as_text()
  assert lowered.out_info.shape == (m, n)


def test_c_operand_validation():
  with pytest.raises(ValueError, match=r'c has shape \(64, 128\)'):
    mosaic_gpu_block.fp8_matmul_block_scaled_mosaic(
        **_args(), c=jnp.zeros((64, 128), jnp.bfloat16))
  with pytest.raises(ValueError, match='c has shape'):
    mosaic_gpu_block.fp8_matmul_block_scaled_mosaic(
        **_args(), c=jnp.zeros((64, 256), jnp.float32))
  args = _args()
  del args['b_granularity']
  with pytest.raises(ValueError, match="it must be the output's"):
    api.fp8_matmul(**args, c=jnp.zeros((64, 256), jnp.float32),
                   implementation='xla')


@pytest.mark.parametrize('block_scales', [True, False])
@pytest.mark.parametrize('out_dtype', [jnp.bfloat16, jnp.float32])
def test_xla_c_is_added_before_the_one_rounding(block_scales, out_dtype):
  """The 'xla' path (the oracle off the GPU): c joins the float32 result
  before its one rounding; a product that bf16 rounds away alone survives
  with c."""
  m, n, k = 48, 272, 256
  ka, kb, ks, kc = jax.random.split(jax.random.key(3), 4)
  a = small_ints(ka, (m, k), E5M2)
  b = small_ints(kb, (n, k), E4M3)
  if block_scales:
    sa, sb = pow2_scales(ks, m, n, k, 'block')
  else:
    sa, sb = jnp.float32(0.25), jnp.float32(2.0)
  c = (jax.random.normal(kc, (m, n)) * 256 + 1024).astype(out_dtype)
  out = api.fp8_matmul(a, b, sa, sb, out_dtype=out_dtype, c=c,
                       implementation='xla')
  exact = (ref_f64(a, b, sa, sb, 'block') if block_scales else
           f64(a) @ f64(b).T * 0.5)
  want = (exact.astype(np.float32) + np.asarray(c, np.float32)).astype(
      np.float32)
  np.testing.assert_array_equal(np.asarray(out, np.float32),
                                np.asarray(jnp.asarray(want).astype(
                                    out_dtype), np.float32))


ALL_CONFIGS = CONFIGS + [mosaic_gpu_block.ROW_TWO_WG_CONFIG,
                         mosaic_gpu_block.ROW_THREE_WG_CONFIG]
ALL_CONFIG_IDS = CONFIG_IDS + ['row_two_wg', 'row_three_wg']
# (config, b granularity) pairs the kernel runs ('block' needs block_n 128).
RUNNABLE = [pytest.param(c, g, id=f'{i}-{g}')
            for c, i in zip(ALL_CONFIGS, ALL_CONFIG_IDS)
            for g in GRANULARITIES if g == 'row' or c.block_n == 128]


@pytest.mark.parametrize('config,granularity', RUNNABLE)
def test_transposed_scales_lower_for_cuda(config, granularity):
  """K-block-first scales, with a partial M tile and, for DEFAULT_CONFIG,
  an odd number of K blocks; the 'row' candidates."""
  m, n, k = 640, 400, 384
  lowered = lower_for_cuda(lambda a, b, sa, sb: (
      mosaic_gpu_block.fp8_matmul_block_scaled_mosaic(
          a, b, sa, sb, b_granularity=granularity, config=config,
          a_scale_transposed=True, b_scale_transposed=True)),
                           *abstract_operands(m, n, k, granularity, True))
  assert 'mosaic_gpu' in lowered.as_text()
  assert lowered.out_info.shape == (m, n)


def test_row_scales_lower_with_a_wider_tile():
  """'row' b scales take other block_n (here 160 columns: a 640-byte TMA
  row per K block)."""
  config = mosaic_gpu.Config(block_n=160, block_k=128, split_k=1,
                             max_stages=5, pad_mn=False)
  assert 'mosaic_gpu' in lower_for_cuda(
      lambda a, b, sa, sb: block_kernel(a, b, sa, sb, 'row', config),
      *abstract_operands(256, 400, 384, 'row')).as_text()


# ---------------------------------------------------------------- GPU tests


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize('config', CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize('granularity', GRANULARITIES)
@pytest.mark.parametrize('a_dtype,b_dtype,mnk', [
    pytest.param(*pair, mnk, id=f'{pair_id}-{"x".join(map(str, mnk))}')
    for mnk in [(384, 256, 1024), (656, 400, 640)]
    for pair, pair_id in zip(PAIRS, PAIR_IDS)] + [
        pytest.param(E5M2, E4M3, (2688, 2304, 512), id='e5m2_e4m3-many')])
def test_exact_with_pow2_tile_and_block_scales(config, granularity, a_dtype,
                                               b_dtype, mnk):
  """Small integers in [-4, 4) with scales 2^-2 .. 2^2: every partial sum,
  product with its scales and total is exact in float32, so the kernel
  must equal the float64 reference. (656, 400, 640): M, N and K divide no
  tile (THREE_WG_CONFIG leaves the edges to TMA and drains its 5 K steps,
  DEFAULT_CONFIG pads); (2688, 2304, 512): more tiles than SMs, whose K
  steps THREE_WG_CONFIG overlaps across tiles."""
  m, n, k = mnk
  ka, kb, ks = jax.random.split(jax.random.key(m + n + k), 3)
  a = small_ints(ka, (m, k), a_dtype)
  b = small_ints(kb, (n, k), b_dtype)
  sa, sb = pow2_scales(ks, m, n, k, granularity)
  out = block_kernel(a, b, sa, sb, granularity, config)
  assert out.shape == (m, n) and out.dtype == jnp.float32
  np.testing.assert_array_equal(out, ref_f64(a, b, sa, sb, granularity))


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize('config', CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize('granularity', GRANULARITIES)
@pytest.mark.parametrize('out_dtype,mnk', [
    (jnp.bfloat16, (656, 400, 640)), (jnp.float32, (384, 256, 1024)),
    (jnp.bfloat16, (2688, 2304, 512))])
def test_c_is_added_before_the_one_rounding(config, granularity, out_dtype,
                                            mnk):
  """out = round(exact sum + c): the float32 sum is exact, so the kernel
  must equal float32(exact) + float32(c), rounded once, over partial tiles
  (c's copies reach past its end) and more tiles than SMs."""
  m, n, k = mnk
  ka, kb, ks, kc = jax.random.split(jax.random.key(m + k), 4)
  a = small_ints(ka, (m, k), E5M2)
  b = small_ints(kb, (n, k), E4M3)
  sa, sb = pow2_scales(ks, m, n, k, granularity)
  c = (jax.random.normal(kc, (m, n)) * 300).astype(out_dtype)
  out = mosaic_gpu_block.fp8_matmul_block_scaled_mosaic(
      a, b, sa, sb, b_granularity=granularity, out_dtype=out_dtype,
      config=config, c=c)
  want = (ref_f64(a, b, sa, sb, granularity).astype(np.float32)
          + np.asarray(c, np.float32))
  np.testing.assert_array_equal(
      np.asarray(out, np.float32),
      np.asarray(jnp.asarray(want).astype(out_dtype), np.float32))


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize('config', CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize('granularity', GRANULARITIES)
def test_bf16_output_is_the_rounded_f32_result(config, granularity):
  m, n, k = 656, 400, 1024
  ka, kb, ks = jax.random.split(jax.random.key(5), 3)
  a = small_ints(ka, (m, k), E5M2)
  b = small_ints(kb, (n, k), E4M3)
  sa, sb = pow2_scales(ks, m, n, k, granularity)
  out = block_kernel(a, b, sa, sb, granularity, config, jnp.bfloat16)
  assert out.dtype == jnp.bfloat16
  want = jnp.asarray(ref_f64(a, b, sa, sb, granularity).astype(np.float32))
  np.testing.assert_array_equal(out, want.astype(jnp.bfloat16))


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize('config,granularity', RUNNABLE)
@pytest.mark.parametrize('mnk', [(640, 400, 384), (16, 16, 128),
                                 (1040, 528, 2048)])
def test_transposed_scales_exact(config, granularity, mnk):
  """Scales given K-block first: exact over partial tiles (whose scale
  blocks reach past the arrays' ends), in every runnable config."""
  m, n, k = mnk
  ka, kb, ks = jax.random.split(jax.random.key(m + n + k + 2), 3)
  a = small_ints(ka, (m, k), E5M2)
  b = small_ints(kb, (n, k), E4M3)
  sa, sb = pow2_scales(ks, m, n, k, granularity)
  out = mosaic_gpu_block.fp8_matmul_block_scaled_mosaic(
      a, b, sa.T, sb.T, b_granularity=granularity, out_dtype=jnp.float32,
      config=config, a_scale_transposed=True, b_scale_transposed=True)
  np.testing.assert_array_equal(out, ref_f64(a, b, sa, sb, granularity))


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize('config', CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize('granularity', GRANULARITIES)
@pytest.mark.parametrize('mnk', [(16, 16, 128), (16, 144, 256),
                                 (48, 80, 384), (32, 272, 128)])
def test_tiny_shapes_exact(config, granularity, mnk):
  m, n, k = mnk
  ka, kb, ks = jax.random.split(jax.random.key(m * n + k), 3)
  a = small_ints(ka, (m, k), E5M2)
  b = small_ints(kb, (n, k), E4M3)
  sa, sb = pow2_scales(ks, m, n, k, granularity)
  out = block_kernel(a, b, sa, sb, granularity, config)
  np.testing.assert_array_equal(out, ref_f64(a, b, sa, sb, granularity))


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize('config', CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize('granularity', GRANULARITIES)
def test_unit_scales_equal_the_per_tensor_kernel(config, granularity):
  """With a_scale * b_scale == 1 everywhere the block kernel adds the same
  wgmma partials in the same order as the per-tensor kernel: bit-identical
  on random (normal) FP8 inputs; with uniform power-of-two scales (2 x 4) it
  equals the per-tensor kernel at scale 8."""
  m, n, k = 640, 528, 4096
  ka, kb = jax.random.split(jax.random.key(11))
  a = jax.random.normal(ka, (m, k)).astype(E4M3)
  b = jax.random.normal(kb, (n, k)).astype(E4M3)
  sa_shape, sb_shape = scale_shapes(m, n, k, granularity)
  for sa, sb, s in ((1.0, 1.0, 1.0), (2.0, 4.0, 8.0)):
    out = block_kernel(a, b, jnp.full(sa_shape, sa, jnp.float32),
                       jnp.full(sb_shape, sb, jnp.float32), granularity,
                       config)
    want = mosaic_gpu.fp8_matmul_mosaic(a, b, jnp.float32(s),
                                        out_dtype=jnp.float32, config=config)
    np.testing.assert_array_equal(out, want)


def quantize_tiles(x, dtype, rows):
  """x (R, K) float32 -> (FP8 values, float32 scales (R // rows, K // 128)),
  one scale per `rows` x 128 tile: amax / fp8 max (1 for a zero tile)."""
  fmax = float(jnp.finfo(dtype).max)
  r, k = x.shape
  tiles = x.reshape(r // rows, rows, k // 128, 128)
  amax = jnp.max(jnp.abs(tiles), axis=(1, 3))
  scale = jnp.where(amax > 0, amax / fmax, 1.0)
  q = tiles / scale[:, None, :, None]
  q = jnp.clip(q, -fmax, fmax).astype(dtype).reshape(r, k)
  return q, scale


def quantize_tensor(x, dtype):
  """x float32 -> FP8 values of one scale, amax / fp8 max (unreturned)."""
  fmax = float(jnp.finfo(dtype).max)
  return jnp.clip(x / (jnp.max(jnp.abs(x)) / fmax), -fmax, fmax).astype(
      dtype)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize('config', CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize('granularity', GRANULARITIES)
@pytest.mark.parametrize('a_dtype', [E4M3, E5M2])
@pytest.mark.parametrize('dist', ['uniform', 'normal'])
def test_accuracy_no_worse_than_per_tensor(config, granularity, a_dtype,
                                           dist):
  """Random inputs quantized in 1x128 tiles (a) and 128x128 blocks or
  1x128 tiles (b), K = 16384 (uniform positive inputs: the worst case for
  accumulation), M, N not multiples of the tiles. Error: max |out - ref| /
  max |ref| against the float64 product of the dequantized operands. Bound:
  at most 1.25x the larger error of the per-tensor Pallas kernel and of
  cuBLASLt precise on the same data quantized per tensor (each against its
  own float64 reference)."""
  m, n, k = 640, 512 + 16, 16384
  ka, kb = jax.random.split(jax.random.key(3))
  draw = jax.random.uniform if dist == 'uniform' else jax.random.normal
  x = draw(ka, (m, k), jnp.float32)
  w = draw(kb, (n + 112, k), jnp.float32)  # whole 128-row blocks
  a, sa = quantize_tiles(x, a_dtype, 1)
  b, sb = quantize_tiles(w, E4M3, 1 if granularity == 'row' else 128)
  b = b[:n]
  sb = sb[:n] if granularity == 'row' else sb
  err = rel_err(block_kernel(a, b, sa, sb, granularity, config),
                ref_f64(a, b, sa, sb, granularity))
  # The same data, per-tensor scales.
  ta, tb = quantize_tensor(x, a_dtype), quantize_tensor(w[:n], E4M3)
  ref = f64(ta) @ f64(tb).T
  err_pt = rel_err(mosaic_gpu.fp8_matmul_mosaic(
      ta, tb, jnp.float32(1), out_dtype=jnp.float32, config=config), ref)
  err_xla = rel_err(api.fp8_matmul(ta, tb, 1.0, 1.0, out_dtype=jnp.float32,
                                   implementation='xla'), ref)
  print(f'{jnp.dtype(a_dtype).name} {dist} {granularity}: block {err:.2e},'
        f' per-tensor pallas {err_pt:.2e}, cuBLASLt precise {err_xla:.2e}')
  assert np.isfinite(err)
  assert err <= 1.25 * max(err_pt, err_xla) + 1e-7, (err, err_pt, err_xla)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize('config', CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize('granularity', GRANULARITIES)
def test_zero_tiles_and_zero_scales(config, granularity):
  """Zero 1x128 tiles of a, a zero 128x128 block of b, zero scales: exact,
  and rows whose scales are all zero are exactly zero."""
  m, n, k = 384, 256, 512
  ka, kb, ks = jax.random.split(jax.random.key(21), 3)
  a = small_ints(ka, (m, k), E4M3).at[:192, 128:256].set(0)
  b = small_ints(kb, (n, k), E4M3).at[128:256, :128].set(0)
  sa, sb = pow2_scales(ks, m, n, k, granularity)
  sa = sa.at[:192, 1].set(0).at[300].set(0)
  sb = sb.at[1, 0].set(0)
  out = np.asarray(block_kernel(a, b, sa, sb, granularity, config))
  np.testing.assert_array_equal(out, ref_f64(a, b, sa, sb, granularity))
  assert not out[300].any()


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize('config', CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize('granularity', GRANULARITIES)
def test_nan_and_inf_stay_in_their_rows_and_columns(config, granularity):
  """IEEE propagation, compared with a float64 reference (einsum, not
  BLAS): a NaN in a[130, :] or in a_scale[200, :] makes that row NaN; a
  NaN in b_scale makes its block's 128 columns ('block') or its column
  ('row') NaN; an Inf in a (E5M2) or in a_scale gives +-Inf in its row, and
  NaN where it meets a zero partial sum or an opposite Inf. Everything
  else is exact."""
  m, n, k = 384, 400, 512
  ka, kb, ks = jax.random.split(jax.random.key(22), 3)
  a = small_ints(ka, (m, k), E5M2)
  b = small_ints(kb, (n, k), E4M3)
  sa, sb = pow2_scales(ks, m, n, k, granularity)
  a = a.at[130, 7].set(jnp.nan).at[310, 300].set(jnp.inf)
  sa = sa.at[200, 2].set(jnp.nan).at[5, 0].set(jnp.inf)
  nan_cols = slice(256, 384) if granularity == 'block' else 77
  sb = sb.at[2 if granularity == 'block' else 77, 3].set(jnp.nan)
  out = np.asarray(block_kernel(a, b, sa, sb, granularity, config))
  ref = ref_f64(a, b, sa, sb, granularity, blas=False)
  for row in (130, 200):
    assert np.isnan(out[row]).all()
  assert np.isnan(out[:, nan_cols]).all()
  assert np.isinf(out[5]).any() and np.isinf(out[310]).any()
  np.testing.assert_array_equal(out, ref)  # NaN where ref is NaN
  clean = np.ones((m, n), bool)
  clean[[5, 130, 200, 310]] = False
  clean[:, nan_cols] = False
  assert np.isfinite(out[clean]).all()


# (name, M, N, K, a dtype, b granularity): Llama-2-7B and 1b GEMMs.
LLAMA = [
    ('1b q fwd', 16384, 2048, 2048, E4M3, 'block'),
    ('1b k/v fwd', 16384, 256, 2048, E4M3, 'block'),
    ('1b k/v wgrad', 256, 2048, 16384, E5M2, 'row'),
    ('7b down fwd', 16384, 4096, 11008, E4M3, 'block'),
    ('7b down dgrad', 16384, 11008, 4096, E5M2, 'block'),
    ('7b o wgrad', 4096, 4096, 16384, E5M2, 'row'),
]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize('name,m,n,k,a_dtype,granularity', LLAMA,
                         ids=[x[0] for x in LLAMA])
def test_llama_shapes_exact_on_sampled_rows(name, m, n, k, a_dtype,
                                            granularity):
  """select_config's tiling at full size; integers in [-2, 2) and scales
  2^-1 .. 2^1 keep every sum exact up to K = 16384. Rows from the first,
  a middle and the last M tile are checked against float64; the whole
  output must be finite, and a second jitted call bit-identical."""
  del name
  ka, kb, ks = jax.random.split(jax.random.key(m + n + k), 3)
  a = small_ints(ka, (m, k), a_dtype, -2, 2)
  b = small_ints(kb, (n, k), E4M3, -2, 2)
  sa, sb = pow2_scales(ks, m, n, k, granularity, -1, 1)
  f = jax.jit(lambda *x: block_kernel(*x, granularity))
  out = f(a, b, sa, sb)
  assert bool(jnp.isfinite(out).all())
  rows = np.unique(np.r_[0:64, m // 2 - 32:m // 2 + 32, m - 64:m])
  want = ref_f64(a[rows], b, sa[rows], sb, granularity)
  np.testing.assert_array_equal(np.asarray(out)[rows], want)
  assert bool((f(a, b, sa, sb) == out).all())


def test_reference_is_the_dequantized_product():
  """The float64 reference agrees with the kernel emulation and with a plain
  dequantize-and-multiply for 'block' and 'row' scales."""
  m, n, k = 48, 272, 384
  ka, kb, ks = jax.random.split(jax.random.key(9), 3)
  a = small_ints(ka, (m, k), E4M3)
  b = small_ints(kb, (n, k), E5M2)
  for granularity in GRANULARITIES:
    sa, sb = pow2_scales(ks, m, n, k, granularity)
    sb_full = (np.repeat(f64(sb), 128, axis=0)[:n]
               if granularity == 'block' else f64(sb))
    a_deq = f64(a) * np.repeat(f64(sa), 128, axis=1)
    b_deq = f64(b) * np.repeat(sb_full, 128, axis=1)
    np.testing.assert_array_equal(ref_f64(a, b, sa, sb, granularity),
                                  a_deq @ b_deq.T)
    np.testing.assert_array_equal(
        ref_f64(a, b, sa, sb, granularity, blas=False), a_deq @ b_deq.T)

