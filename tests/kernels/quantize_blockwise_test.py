"""Tests of pallas_kernels.quantize_blockwise (1x128 tiles, 128x128 blocks).

CPU: the reference against quantize_per_group and hand rules (padding, zero
tiles, NaN/Inf confinement, power-of-two scales), the interpreted Triton
kernel against the reference bit for bit, and the Mosaic GPU x, x^T kernel's
cases, errors and lowering for CUDA. GPU (marked `gpu`): both compiled
kernels against the reference bit for bit, and which one the API runs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.quantize_blockwise import api
from pallas_kernels.quantize_blockwise import mosaic_gpu
from pallas_kernels.quantize_blockwise import pallas_triton
from pallas_kernels.quantize_blockwise import reference
from pallas_kernels.quantize_per_group import reference as group_reference

FORMATS = ['e4m3', 'e5m2']
FMAX = {'e4m3': 448.0, 'e5m2': 57344.0}


def f32(x):
  return np.asarray(jnp.asarray(x).astype(jnp.float32))


def assert_same(outs, wants):
  """Bitwise equality of (values, scales, ...) tuples (NaN == NaN)."""
  assert len(outs) == len(wants)
  for out, want in zip(outs, wants):
    if want is None:
      assert out is None
      continue
    assert out.shape == want.shape and out.dtype == want.dtype
    np.testing.assert_array_equal(f32(out), f32(want))


def normal(seed, shape, scale=1.0):
  return jax.random.normal(jax.random.key(seed), shape) * scale


@pytest.mark.parametrize('fmt', FORMATS)
@pytest.mark.parametrize('shape', [(4, 384), (3, 5, 200), (7,), (130, 1)])
def test_tiles_are_per_group_128(fmt, shape):
  x = normal(0, shape, 3.0)
  values, scales, _, _ = reference.quantize_blockwise(x, (1, 128), fmt)
  want_v, want_s, _ = group_reference.quantize_per_group(x, 128, fmt)
  assert_same((values, scales), (want_v, want_s))


@pytest.mark.parametrize('pow2', [False, True])
def test_transposed_copy_is_the_tiles_of_x_t(pow2):
  x = normal(1, (200, 300))
  _, _, values_t, scales_t = reference.quantize_blockwise(
      x, (1, 128), 'e5m2', transpose=True, pow2=pow2)
  want = reference.quantize_blockwise(x.T, (1, 128), 'e5m2', pow2=pow2)
  assert values_t.shape == (300, 200) and scales_t.shape == (300, 2)
  assert_same((values_t, scales_t), want[:2])


@pytest.mark.parametrize('pow2', [False, True])
def test_transposed_copy_in_blocks_is_the_blocks_of_x_t(pow2):
  # wgrad's B operand: g^T with one scale per 128x128 block.
  x = np.array(normal(1, (200, 300)))
  x[130:, 200:] *= 300.0
  x = jnp.asarray(x)
  values, scales, values_t, scales_t = reference.quantize_blockwise(
      x, (1, 128), 'e5m2', transpose=True, pow2=pow2,
      transpose_block=(128, 128))
  assert_same((values, scales),
              reference.quantize_blockwise(x, (1, 128), 'e5m2', pow2=pow2)[:2])
  want = reference.quantize_blockwise(x.T, (128, 128), 'e5m2', pow2=pow2)
  assert values_t.shape == (300, 200) and scales_t.shape == (3, 2)
  assert_same((values_t, scales_t), want[:2])


@pytest.mark.parametrize('pow2', [False, True])
@pytest.mark.parametrize('fmt', FORMATS)
def test_blocks_match_a_hand_computation(fmt, pow2):
  x = np.array(normal(2, (200, 300)), np.float64)
  x[130:, :128] *= 1000.0  # blocks with different scales
  values, scales, _, _ = reference.quantize_blockwise(
      jnp.asarray(x, jnp.float32), (128, 128), fmt, pow2=pow2)
  assert scales.shape == (2, 3) and values.shape == (200, 300)
  x32 = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  for i in range(2):
    for j in range(3):
      tile = x32[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
      amax = np.abs(tile).max()
      s = float(scales[i, j])
      if pow2:
        assert s == 2.0 ** np.ceil(np.log2(amax / FMAX[fmt]))
      else:
        assert s == np.float32(np.float32(amax) * (np.float32(1)
                                                   / np.float32(FMAX[fmt])))
      v = f32(values[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128])
      want = jnp.clip(jnp.asarray(tile / s, jnp.float32), -FMAX[fmt],
                      FMAX[fmt]).astype(jnp.dtype(jnp.float8_e4m3fn
                                                  if fmt == 'e4m3'
                                                  else jnp.float8_e5m2))
      if pow2:  # x / 2^e is exact: the only rounding is the cast
        np.testing.assert_array_equal(v, f32(want))


def test_partial_tiles_are_zero_padded():
  """Shapes not multiples of 128: the result is the padded array's, cut."""
  x = normal(3, (150, 260))
  xp = jnp.pad(x, ((0, 106), (0, 124)))
  for block in [(1, 128), (128, 128)]:
    quantize = jax.jit(lambda v, b=block: reference.quantize_blockwise(
        v, b, transpose=b[0] == 1))
    got, want = quantize(x), quantize(xp)
    np.testing.assert_array_equal(f32(got[0]), f32(want[0])[:150, :260])
    if block[0] == 1:
      np.testing.assert_array_equal(f32(got[1]), f32(want[1])[:150])
      np.testing.assert_array_equal(f32(got[2]), f32(want[2])[:260, :150])
      np.testing.assert_array_equal(f32(got[3]), f32(want[3])[:260])
    else:
      np.testing.assert_array_equal(f32(got[1]), f32(want[1]))


@pytest.mark.parametrize('block', [(1, 128), (128, 128)])
def test_zero_tile_has_scale_one_and_nan_inf_stay_in_their_tile(block):
  x = np.array(normal(4, (256, 256)))
  x[:128, 128:] = 0.0  # a zero tile / block
  clean = reference.quantize_blockwise(jnp.asarray(x), block,
                                       transpose=block[0] == 1)
  assert float(f32(clean[1]).min()) > 0
  if block[0] == 1:
    assert (f32(clean[1])[:128, 1] == 1).all()
    assert (f32(clean[0])[:128, 128:] == 0).all()
  else:
    assert f32(clean[1])[0, 1] == 1
  x[5, 7] = np.nan
  x[200, 130] = np.inf
  got = reference.quantize_blockwise(jnp.asarray(x), block,
                                     transpose=block[0] == 1)
  s, s0 = f32(got[1]), f32(clean[1])
  if block[0] == 1:
    bad = np.zeros_like(s, bool)
    bad[5, 0] = bad[200, 1] = True
    bad_t = np.zeros_like(f32(got[3]), bool)
    bad_t[7, 0] = bad_t[130, 1] = True
    assert np.isnan(f32(got[3])[bad_t]).all()
    np.testing.assert_array_equal(f32(got[3])[~bad_t], f32(clean[3])[~bad_t])
  else:
    bad = np.array([[True, False], [False, True]])
  assert np.isnan(s[bad]).all()
  np.testing.assert_array_equal(s[~bad], s0[~bad])
  rows_ok = np.ones(256, bool)
  rows_ok[[5, 200]] = False
  if block[0] == 1:  # untouched rows keep their codes
    np.testing.assert_array_equal(f32(got[0])[rows_ok], f32(clean[0])[rows_ok])
  else:  # untouched blocks keep their codes
    np.testing.assert_array_equal(f32(got[0])[:128, 128:],
                                  f32(clean[0])[:128, 128:])
    np.testing.assert_array_equal(f32(got[0])[128:, :128],
                                  f32(clean[0])[128:, :128])


@pytest.mark.parametrize('fmt', FORMATS)
def test_pow2_scale_rule(fmt):
  fmax = FMAX[fmt]
  amax = np.array([0.0, fmax, fmax * 1.0000001, 1.0, 1.75 * 2**-4,
                   1.7500001 * 2**-4, 3e38, 1e-30, np.nan, np.inf],
                  np.float32)
  got = f32(reference.pow2_scale(jnp.asarray(amax), fmt))
  with np.errstate(divide='ignore', invalid='ignore'):
    want = 2.0 ** np.ceil(np.log2(amax.astype(np.float64) / fmax))
  want[0] = 1.0
  want[-2:] = np.nan
  want = np.maximum(want, 2.0**-126)
  np.testing.assert_array_equal(got, want.astype(np.float32))


def test_pow2_rescaling_is_exact_and_never_saturates():
  x = normal(5, (64, 256), 7.0)
  values, scales, _, _ = reference.quantize_blockwise(
      x, (1, 128), 'e4m3', pow2=True)
  s = f32(scales)
  assert (s == 2.0 ** np.round(np.log2(s))).all()
  amax = np.abs(np.asarray(x)).reshape(64, 2, 128).max(-1)
  assert (amax <= s * 448).all() and (amax > s * 224).all()
  # Representable x (codes times a power of two) come back exactly.
  deq = (f32(values).reshape(64, 2, 128) * s[..., None]).reshape(64, 256)
  again = reference.quantize_blockwise(
      jnp.asarray(deq), (1, 128), 'e4m3', pow2=True)
  deq2 = f32(again[0]).reshape(64, 2, 128) * f32(again[1])[..., None]
  np.testing.assert_array_equal(deq2.reshape(64, 256), deq)


def test_accuracy_float32_vs_pow2_scales_against_float64():
  """Both below half an E4M3 step; power-of-two scales use less of the
  range, so their mean relative error is a little higher (printed)."""
  x = np.array(normal(6, (256, 512))) * np.exp(
      np.array(normal(7, (256, 1))))
  errs = {}
  for pow2 in (False, True):
    v, s, _, _ = reference.quantize_blockwise(
        jnp.asarray(x), (1, 128), 'e4m3', pow2=pow2)
    deq = f32(v).astype(np.float64).reshape(256, 4, 128) * f32(s)[..., None]
    err = np.abs(deq.reshape(256, 512) - x) / np.abs(x).max(-1, keepdims=True)
    errs[pow2] = (err.mean(), err.max())
  print(f'1x128 E4M3 error vs float64 (mean, max / row amax): float32 scales'
        f' {errs[False]}, pow2 scales {errs[True]}')
  assert errs[False][1] <= 2**-4 and errs[True][1] <= 2**-4
  assert errs[False][0] <= errs[True][0]


# ------------------------------------------------ the kernel (interpreted)

KERNEL_CASES = [
    ((128, 128), pallas_triton.BlockSizes()),
    ((200, 300), pallas_triton.BlockSizes()),
    ((256, 512), pallas_triton.BlockSizes(256, 256)),
    ((384, 640), pallas_triton.BlockSizes(128, 256)),
    ((3, 5, 40), pallas_triton.BlockSizes()),
    ((1, 1), pallas_triton.BlockSizes()),
]


@pytest.mark.parametrize('shape,sizes', KERNEL_CASES)
@pytest.mark.parametrize('fmt,pow2', [('e4m3', False), ('e5m2', True)])
def test_kernel_tiles_match_reference(shape, sizes, fmt, pow2):
  x = np.array(normal(8, shape, 5.0))
  if x.size > 1000:
    x.reshape(-1)[17] = np.nan
    x.reshape(-1)[-3] = -np.inf
    x.reshape(x.shape[0] if x.ndim == 2 else -1, -1)[:, :128][:64] = 0.0
  x = jnp.asarray(x, jnp.bfloat16)
  transpose = x.ndim == 2
  got = pallas_triton.quantize_blockwise(
      x, (1, 128), fmt, transpose=transpose, pow2=pow2, block_sizes=sizes,
      interpret=True)
  want = reference.quantize_blockwise(x, (1, 128), fmt, transpose=transpose,
                                      pow2=pow2)
  assert_same(got, want)


@pytest.mark.parametrize('shape,sizes', [
    ((256, 384), pallas_triton.BlockSizes()),
    ((200, 300), pallas_triton.BlockSizes()),
    ((1, 16), pallas_triton.BlockSizes()),
    ((256, 640), pallas_triton.BlockSizes(128, 256)),  # a partial band
    ((200, 300), pallas_triton.BlockSizes(128, 512)),
])
@pytest.mark.parametrize('fmt,pow2', [('e5m2', False), ('e4m3', True)])
def test_kernel_transposed_blocks_match_reference(shape, sizes, fmt, pow2):
  x = np.array(normal(10, shape, 2.0))
  if x.size > 1000:
    x[150, 7] = np.nan  # confined to block (0, 1) of x^T
    x[:128, 256:] = 0.0
  x = jnp.asarray(x, jnp.bfloat16)
  kw = dict(transpose=True, pow2=pow2, transpose_block=(128, 128))
  got = pallas_triton.quantize_blockwise(x, (1, 128), fmt, interpret=True,
                                         block_sizes=sizes, **kw)
  want = reference.quantize_blockwise(x, (1, 128), fmt, **kw)
  assert_same(got, want)


def test_skewed_tile_order_visits_every_tile_once():
  # The 128x128-block path's programs visit the bands in order, each band's
  # column tiles rotated (`T_BLOCKS_SKEW`): still each tile exactly once.
  for ncb in range(1, 25):
    for skew in (0, 1, pallas_triton.T_BLOCKS_SKEW):
      tiles = [tuple(int(v) for v in pallas_triton._tile_of(jnp.int32(p), ncb,
                                                             skew))
               for p in range(5 * ncb)]
      assert sorted(tiles) == [(i, j) for i in range(5) for j in range(ncb)]
      assert [i for i, _ in tiles] == sorted(i for i, _ in tiles)


@pytest.mark.parametrize('in_dtype', [jnp.bfloat16, jnp.float16,
                                      jnp.float32])
@pytest.mark.parametrize('transpose_block', [(1, 128), (128, 128)])
def test_kernel_widens_every_input_dtype_exactly(in_dtype, transpose_block):
  """x^T is encoded from the tile widened a second time (`_widen`: a bit
  shift for bf16): -0, subnormals, +-max, NaN and Inf keep their bits."""
  x = np.array(normal(12, (256, 384), 4.0))
  tiny = float(jnp.finfo(in_dtype).smallest_subnormal)
  big = float(jnp.finfo(in_dtype).max)
  x[0, :4] = [-0.0, tiny, -tiny, 3 * tiny]
  x[130, 200:203] = [big, -big, np.nan]
  x[5, 300] = -np.inf
  x = jnp.asarray(x).astype(in_dtype)
  kw = dict(transpose=True, transpose_block=transpose_block)
  got = pallas_triton.quantize_blockwise(x, (1, 128), 'e5m2', interpret=True,
                                         **kw)
  want = reference.quantize_blockwise(x, (1, 128), 'e5m2', **kw)
  assert_same(got, want)
  np.testing.assert_array_equal(np.signbit(f32(got[2][0, 0])), True)


@pytest.mark.parametrize('shape', [(256, 128), (144, 272)])
@pytest.mark.parametrize('fmt,pow2', [('e4m3', True), ('e5m2', False)])
def test_kernel_blocks_match_reference(shape, fmt, pow2):
  x = np.array(normal(9, shape, 0.02))
  x[130, 3] = np.nan
  got = pallas_triton.quantize_blockwise(
      jnp.asarray(x), (128, 128), fmt, pow2=pow2, interpret=True)
  want = reference.quantize_blockwise(jnp.asarray(x), (128, 128), fmt,
                                      pow2=pow2)
  assert_same(got, want)


# Parts (rows, widths): each tile read from its own part. 256-wide tiles
# where every part but the last is a multiple of 256, else 128; the last
# part may end mid-tile; rows may end mid-band.
PARTS_CASES = [
    (256, (256, 128, 128)),  # the 1b Q/K/V shape, scaled down: 128-wide tiles
    (256, (512, 256, 256)),  # 256-wide tiles
    (200, (256, 256, 300)),  # partial last tile and partial last band
    (130, (128, 384, 40)),
    (128, (384,)),  # one part
]


@pytest.mark.parametrize('rows,widths', PARTS_CASES)
@pytest.mark.parametrize('fmt,transpose_block', [('e5m2', (128, 128)),
                                                 ('e4m3', (1, 128))])
def test_kernel_parts_match_the_concatenation(rows, widths, fmt,
                                              transpose_block):
  x = np.array(normal(12, (rows, sum(widths)), 4.0))
  x[5, 130] = np.nan  # confined to its tiles, in the first part
  x[-1, -1] = np.inf
  x[:128, sum(widths[:-1]):] = 0.0  # a zero band of the last part
  x = jnp.asarray(x, jnp.bfloat16)
  parts = tuple(jnp.split(x, np.cumsum(widths)[:-1], axis=1))
  kw = dict(transpose=True, transpose_block=transpose_block)
  got = pallas_triton.quantize_blockwise_parts(parts, fmt, interpret=True,
                                               **kw)
  want = reference.quantize_blockwise(x, (1, 128), fmt, **kw)
  assert_same(got, want)
  assert_same(api.quantize_blockwise_parts(parts, fmt, implementation='xla',
                                           **kw), want)


def test_parts_tile_width_and_fallback():
  assert pallas_triton.parts_tile_cols((512, 256, 100)) == 256
  assert pallas_triton.parts_tile_cols((2048, 128, 128)) == 128
  assert pallas_triton.parts_tile_cols((200, 128)) is None
  # A part that is not a whole number of tiles wide: the parts are joined.
  parts = (normal(13, (64, 200)), normal(14, (64, 128)))
  want = reference.quantize_blockwise(jnp.concatenate(parts, axis=1),
                                      (1, 128), transpose=True)
  assert_same(api.quantize_blockwise_parts(parts, transpose=True,
                                           implementation='pallas'), want)
  with pytest.raises(ValueError, match='multiple of 128'):
    pallas_triton.quantize_blockwise_parts(parts, interpret=True)
  with pytest.raises(ValueError, match='same rows'):
    api.quantize_blockwise_parts((normal(0, (4, 128)), normal(0, (5, 128))))
  with pytest.raises(TypeError, match='floating'):
    api.quantize_blockwise_parts((jnp.arange(128).reshape(1, 128),))


def test_api_dispatch_and_errors():
  x = normal(10, (16, 256))
  a = api.quantize_blockwise(x, (1, 128), transpose=True,
                             implementation='pallas')
  b = api.quantize_blockwise(x, (1, 128), transpose=True,
                             implementation='xla')
  assert_same(a, b)
  c = api.quantize_blockwise(jnp.zeros((0, 128)), (1, 128),
                             implementation='pallas')
  assert c[0].shape == (0, 128) and c[1].shape == (0, 1)
  with pytest.raises(ValueError, match='block'):
    api.quantize_blockwise(x, (1, 64))
  with pytest.raises(ValueError, match='2-D'):
    api.quantize_blockwise(jnp.ones((2, 3, 4)), (128, 128))
  with pytest.raises(ValueError, match='transpose'):
    api.quantize_blockwise(x, (128, 128), transpose=True)
  with pytest.raises(TypeError, match='floating'):
    api.quantize_blockwise(jnp.arange(16), (1, 128))
  with pytest.raises(ValueError, match='dtype'):
    api.quantize_blockwise(x, (1, 128), 'e3m4')
  with pytest.raises(ValueError, match='block_rows'):
    pallas_triton.BlockSizes(64, 128)


# ------------------------------------ the Mosaic GPU kernel (CPU: lowering)

# (parts' widths, rows, input dtype, format, pow2, transpose_block)
MOSAIC_CASES = [
    ((128,), 128, jnp.bfloat16, 'e4m3', False, (1, 128)),
    ((384,), 256, jnp.float16, 'e5m2', True, (1, 128)),
    ((256,), 384, jnp.bfloat16, 'e5m2', False, (128, 128)),
    ((2048, 256, 256), 256, jnp.bfloat16, 'e5m2', False, (128, 128)),
    ((256, 128), 128, jnp.bfloat16, 'e4m3', True, (1, 128)),
]
MOSAIC_IDS = ['one_tile', 'f16_e5m2_pow2', 'blocks', 'qkv_parts_blocks',
              'parts_pow2']


def test_mosaic_kernel_cases():
  """Rows and widths in whole tiles, a 16-bit input, x^T asked for: the
  rest is the Triton kernel's (the API never hands the Mosaic kernel a case
  it does not run)."""
  assert mosaic_gpu.supports((2048, 256, 256), 16384, jnp.bfloat16, True)
  assert mosaic_gpu.supports((5632,), 128, jnp.float16, True)
  assert not mosaic_gpu.supports((2048,), 16384, jnp.bfloat16, False)
  assert not mosaic_gpu.supports((2048,), 16384, jnp.float32, True)
  assert not mosaic_gpu.supports((2048,), 200, jnp.bfloat16, True)
  assert not mosaic_gpu.supports((200, 128), 256, jnp.bfloat16, True)
  assert not mosaic_gpu.supports((2048,), 0, jnp.bfloat16, True)
  assert not api._runs_mosaic((256,), 256, jnp.bfloat16, True, True)
  with pytest.raises(ValueError, match='multiples of 128'):
    mosaic_gpu.quantize_blockwise(jnp.zeros((200, 256), jnp.bfloat16))
  with pytest.raises(ValueError, match='16-bit'):
    mosaic_gpu.quantize_blockwise(jnp.zeros((256, 256), jnp.float32))


@pytest.mark.parametrize('widths,rows,in_dtype,fmt,pow2,tb', MOSAIC_CASES,
                         ids=MOSAIC_IDS)
def test_mosaic_kernel_lowers_for_cuda(widths, rows, in_dtype, fmt, pow2,
                                       tb):
  """Each case lowers to one Mosaic GPU kernel here, without a GPU, with
  the reference's output shapes and dtypes."""
  parts = [jax.ShapeDtypeStruct((rows, w), in_dtype) for w in widths]
  fn = lambda *p: mosaic_gpu.quantize_blockwise_parts(
      p, fmt, pow2=pow2, transpose_block=tb)
  lowered = jax.jit(fn).trace(*parts).lower(lowering_platforms=('cuda',))
  assert 'mosaic_gpu' in lowered.as_text()
  assert 'quantize_tiles_t' in lowered.as_text()  # named for profiles
  want = jax.eval_shape(lambda *p: reference.quantize_blockwise_parts(
      p, fmt, transpose=True, pow2=pow2, transpose_block=tb), *parts)
  got = [(o.shape, o.dtype) for o in lowered.out_info]
  assert got == [(o.shape, o.dtype) for o in want]


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize('shape', [(4096, 2048), (2000, 5632), (300, 200)])
@pytest.mark.parametrize('pow2', [False, True])
def test_gpu_kernel_matches_reference(shape, pow2):
  x = normal(11, shape, 3.0).astype(jnp.bfloat16)
  for fmt in FORMATS:
    got = pallas_triton.quantize_blockwise(x, (1, 128), fmt, transpose=True,
                                           pow2=pow2)
    want = jax.jit(lambda v, f=fmt: reference.quantize_blockwise(
        v, (1, 128), f, transpose=True, pow2=pow2))(x)
    assert_same(got, want)
    got = pallas_triton.quantize_blockwise(x, (128, 128), fmt, pow2=pow2)
    want = jax.jit(lambda v, f=fmt: reference.quantize_blockwise(
        v, (128, 128), f, pow2=pow2))(x)
    assert_same(got, want)
    kw = dict(transpose=True, pow2=pow2, transpose_block=(128, 128))
    got = pallas_triton.quantize_blockwise(x, (1, 128), fmt, **kw)
    want = jax.jit(lambda v, f=fmt: reference.quantize_blockwise(
        v, (1, 128), f, **kw))(x)
    assert_same(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize('widths', [(2048, 256, 256), (4096, 4096, 4096),
                                    (256, 128, 200)])
def test_gpu_parts_match_the_concatenation(widths):
  x = normal(15, (2000, sum(widths)), 3.0).astype(jnp.bfloat16)
  parts = tuple(jnp.split(x, np.cumsum(widths)[:-1], axis=1))
  for fmt, tb in (('e5m2', (128, 128)), ('e4m3', (1, 128))):
    kw = dict(transpose=True, transpose_block=tb)
    got = pallas_triton.quantize_blockwise_parts(parts, fmt, **kw)
    want = jax.jit(lambda v, f=fmt: reference.quantize_blockwise(
        v, (1, 128), f, **kw))(x)
    assert_same(got, want)


def _edge_input(shape, in_dtype=jnp.bfloat16):
  """Normal values with a zero tile, NaN and Inf in their own tiles,
  values near the input format's max, subnormals and a constant tile."""
  x = np.array(normal(16, shape, 3.0))
  big = float(jnp.finfo(in_dtype).max)
  tiny = float(jnp.finfo(in_dtype).smallest_subnormal)
  x[:128, :128] = 0.0
  x[5, 300] = np.nan
  x[200, 7] = np.inf
  x[300:310, 130:140] = big
  x[130, 140:] = -big / 2
  x[400:420, 400:500] = 3 * tiny
  x[256:384, 384:512] = 7.0
  return jnp.asarray(x).astype(in_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize('widths,rows,in_dtype,fmt,pow2,tb', MOSAIC_CASES
                         + [((2048,), 4096, jnp.bfloat16, 'e4m3', False,
                             (1, 128)),
                            ((5632,), 512, jnp.bfloat16, 'e4m3', True,
                             (1, 128)),
                            ((512,), 512, jnp.bfloat16, 'e5m2', False,
                             (128, 128))],
                         ids=MOSAIC_IDS + ['1b_x', '1b_down_pow2', 'edges'])
def test_gpu_mosaic_kernel_matches_reference(widths, rows, in_dtype, fmt,
                                             pow2, tb):
  if sum(widths) >= 512 and rows >= 512:
    x = _edge_input((rows, sum(widths)), in_dtype)
  else:
    x = normal(17, (rows, sum(widths)), 3.0).astype(in_dtype)
  parts = tuple(jnp.split(x, np.cumsum(widths)[:-1], axis=1))
  kw = dict(pow2=pow2, transpose_block=tb)
  got = mosaic_gpu.quantize_blockwise_parts(parts, fmt, **kw)
  want = jax.jit(lambda v: reference.quantize_blockwise(
      v, (1, 128), fmt, transpose=True, **kw))(x)
  assert_same(got, want)
  if len(parts) == 1:
    assert_same(mosaic_gpu.quantize_blockwise(x, fmt, **kw), want)


@pytest.mark.gpu
def test_gpu_api_runs_mosaic_where_it_can():
  """The default path takes the Mosaic kernel for whole tiles of a 16-bit
  x with x^T, the Triton kernel otherwise; both give the reference's bits."""
  def kernels(fn, x):
    hlo = jax.jit(fn).lower(x).as_text()
    return 'mosaic_gpu' in hlo, 'triton' in hlo
  x = normal(18, (2, 256, 384), 2.0).astype(jnp.bfloat16)
  fn = lambda v: api.quantize_blockwise(v, (1, 128), transpose=True)
  assert kernels(fn, x) == (True, False)
  assert_same(fn(x), reference.quantize_blockwise(x, (1, 128),
                                                  transpose=True))
  for y in (x[:, :100], x.astype(jnp.float32)):
    assert kernels(fn, y) == (False, True)
    assert_same(fn(y), reference.quantize_blockwise(y, (1, 128),
                                                    transpose=True))
  parts = (x[0, :, :256], x[0, :, 256:])
  fn = lambda p: api.quantize_blockwise_parts(
      p, 'e5m2', transpose=True, transpose_block=(128, 128))
  assert kernels(fn, parts) == (True, False)
  assert_same(fn(parts), reference.quantize_blockwise(
      x[0], (1, 128), 'e5m2', transpose=True, transpose_block=(128, 128)))
