"""FP8 linear layer: numerics against float32, residuals, module, errors."""

import dataclasses

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import coat_jax
import coat_jax.nn as cnn
from coat_jax.nn import linear
from coat_jax.quant import fp8_max
from coat_jax.training import sharding
from pallas_kernels.fp8_matmul import fp8_matmul
from pallas_kernels.quantize_blockwise import reference as block_reference


def _exact(key, shape, fmt, exponent):
  """Array whose per-tensor quantization in `fmt` is exact: FP8 codes with
  max |code| = fp8_max, times 2**exponent."""
  dtype = {'e4m3': jnp.float8_e4m3fn, 'e5m2': jnp.float8_e5m2}[fmt]
  m = fp8_max(fmt)
  codes = jnp.clip(jax.random.normal(key, shape) * m / 4, -m, m).astype(dtype)
  codes = codes.reshape(-1).at[0].set(m).reshape(shape)
  return codes.astype(jnp.float32) * 2.0**exponent


def _rel(a, b):
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def _ref(x, w):
  return jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32),
                 precision=jax.lax.Precision.HIGHEST)


def _fp8(x, w):
  return cnn.fp8_dense(x, [w])[0]


@jax.jit
def _fwd_bwd(x, w, dy):
  """Forward and gradients of the FP8 layer and of the float32 reference."""
  y, vjp = jax.vjp(_fp8, x, w)
  y_ref, vjp_ref = jax.vjp(_ref, x, w)
  return (y, *vjp(dy)), (y_ref, *vjp_ref(dy.astype(jnp.float32)))


def test_exact_on_fp8_representable_inputs(seed):
  k = jax.random.split(jax.random.key(seed), 3)
  x = _exact(k[0], (3, 32, 128), 'e4m3', -6).astype(jnp.bfloat16)
  w = _exact(k[1], (128, 64), 'e4m3', -10)
  dy = _exact(k[2], (3, 32, 64), 'e5m2', -14).astype(jnp.bfloat16)
  (y, dx, dw), (y_ref, dx_ref, dw_ref) = _fwd_bwd(x, w, dy)
  assert y.dtype == jnp.bfloat16 and dx.dtype == jnp.bfloat16
  assert dw.dtype == jnp.float32
  # Only the bf16 rounding of outputs (and f32 summation order) remains.
  np.testing.assert_allclose(y.astype(jnp.float32), y_ref, rtol=2**-8,
                             atol=1e-6 * np.abs(y_ref).max())
  np.testing.assert_allclose(dx.astype(jnp.float32), dx_ref, rtol=2**-8,
                             atol=1e-6 * np.abs(dx_ref).max())
  np.testing.assert_allclose(dw, dw_ref, rtol=1e-5,
                             atol=1e-6 * np.abs(dw_ref).max())


@pytest.mark.parametrize('shape', [(4, 37, 128), (1, 1, 128), (23, 128)])
def test_random_inputs_within_fp8_error(shape, seed):
  k = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(k[0], shape, jnp.bfloat16)
  w = jax.random.normal(k[1], (128, 96)) * 0.05
  dy = jax.random.normal(k[2], shape[:-1] + (96,), jnp.bfloat16)
  (y, dx, dw), (y_ref, dx_ref, dw_ref) = _fwd_bwd(x, w, dy)
  assert y.shape == y_ref.shape and dx.shape == x.shape
  assert _rel(y, y_ref) < 0.06   # E4M3 x E4M3: ~0.036 typical
  assert _rel(dx, dx_ref) < 0.09  # E5M2 x E4M3: ~0.057 typical
  assert _rel(dw, dw_ref) < 0.09


def test_fanout_shares_the_input_and_sums_dgrad(seed):
  k = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(k[0], (2, 16, 64), jnp.bfloat16)
  w1 = jax.random.normal(k[1], (64, 32)) * 0.1
  w2 = jax.random.normal(k[2], (64, 48)) * 0.1
  def loss(fn, x, w1, w2):
    a, b = fn(x, [w1, w2])
    return jnp.sum(a.astype(jnp.float32) ** 2) + jnp.sum(
        jnp.sin(b.astype(jnp.float32)))
  ref_fn = lambda x, ws: tuple(_ref(x, w) for w in ws)
  grad = lambda fn: jax.jit(jax.grad(
      lambda *a: loss(fn, *a), argnums=(0, 1, 2)))(x, w1, w2)
  g, g_ref = grad(cnn.fp8_dense), grad(ref_fn)
  for a, b in zip(g, g_ref):
    assert _rel(a, b) < 0.1
  res = cnn.saved_residuals(cnn.fp8_dense, x, [w1, w2])
  # x^T saved once, then each weight's E4M3 codes (K, N) and scale.
  assert [(r.shape, str(r.dtype)) for r in res] == [
      ((64, 32), 'float8_e4m3fn'), ((), 'float32'),
      ((64, 32), 'float8_e4m3fn'), ((), 'float32'),
      ((64, 48), 'float8_e4m3fn'), ((), 'float32')]


@pytest.mark.parametrize('reuse_input', [False, True])
def test_fused_is_one_concatenated_kernel_bit_for_bit(reuse_input, seed):
  """fused=True runs the kernels as one (K, sum N_i) projection: the same
  bits as fp8_dense with the concatenated kernel (one weight scale, one
  gradient scale, one GEMM each way), its outputs and wgrad split."""
  k = jax.random.split(jax.random.key(seed), 6)
  x = jax.random.normal(k[0], (2, 40, 64), jnp.bfloat16) * 3
  # Magnitudes apart, so that per-kernel scales would give other codes.
  ws = [jax.random.normal(k[1], (64, 32)),
        jax.random.normal(k[2], (64, 16)) * 1e-2,
        jax.random.normal(k[3], (64, 48)) * 0.3]
  dys = [jax.random.normal(k[4], (2, 40, 32), jnp.bfloat16) * 1e-3,
         jax.random.normal(k[5], (2, 40, 16), jnp.bfloat16),
         jax.random.normal(k[5], (2, 40, 48), jnp.bfloat16) * 30]

  @jax.jit
  def run():
    fused = lambda x, ws: cnn.fp8_dense(x, ws, fused=True,
                                        reuse_input=reuse_input)
    ys, vjp = jax.vjp(fused, x, ws)
    dx, dws = vjp(tuple(dys))
    one = lambda x, w: cnn.fp8_dense(x, [w], reuse_input=reuse_input)[0]
    y1, vjp1 = jax.vjp(one, x, jnp.concatenate(ws, axis=1))
    dx1, dw1 = vjp1(jnp.concatenate(dys, axis=-1))
    sep = jax.vjp(lambda x, ws: cnn.fp8_dense(x, ws), x, ws)[1](tuple(dys))
    return (ys, dx, dws), (y1, dx1, dw1), sep

  (ys, dx, dws), (y1, dx1, dw1), (dx_sep, dws_sep) = run()
  got = [np.concatenate([np.asarray(a, np.float32) for a in ys], -1), dx,
         np.concatenate(dws, 1)]
  for a, b in zip(got, (y1, dx1, dw1)):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.isfinite(a).all()
    np.testing.assert_array_equal(a, b)
  assert [w.shape for w in dws] == [w.shape for w in ws]
  # Per-kernel scales (the default) are other numbers, as close to float32.
  assert not np.array_equal(np.asarray(dws[1]), np.asarray(dws_sep[1]))
  ref = jax.vjp(lambda x, ws: tuple(_ref(x, w) for w in ws), x, ws)[1](
      tuple(d.astype(jnp.float32) for d in dys))
  for a, b, r in zip((dx, *dws), (dx_sep, *dws_sep), (ref[0], *ref[1])):
    assert _rel(a, r) < 0.1 and _rel(b, r) < 0.1
  # Saved: x's codes (or x), then each weight's codes with the shared scale
  # (FSDP's FP8 gathers take each kernel's codes with its own axes).
  res = cnn.saved_residuals(
      lambda x, ws: cnn.fp8_dense(x, ws, fused=True,
                                  reuse_input=reuse_input), x, ws)
  kept = ([((80, 64), 'bfloat16'), ((), 'float32')] if reuse_input else
          [((64, 80), 'float8_e4m3fn'), ((), 'float32')])
  assert [(r.shape, str(r.dtype)) for r in res] == kept + [
      ((64, 32), 'float8_e4m3fn'), ((), 'float32'),
      ((64, 16), 'float8_e4m3fn'), ((), 'float32'),
      ((64, 48), 'float8_e4m3fn'), ((), 'float32')]


def test_fused_needs_one_dtype_with_tensor_scaling(seed):
  x = jax.random.normal(jax.random.key(seed), (2, 16, 64), jnp.bfloat16)
  w1, w2 = jnp.ones((64, 32)), jnp.ones((64, 16), jnp.bfloat16)
  with pytest.raises(ValueError, match='fused=True needs kernels of one'):
    cnn.fp8_dense(x, [w1, w2], fused=True)


def _count_gemms(monkeypatch):
  """A list that collects the shapes of every `fp8_matmul` the layers run."""
  calls = []
  linear = cnn.linear

  def counted(a, b, *args, **kwargs):
    calls.append((a.shape, b.shape))
    return fp8_matmul(a, b, *args, **kwargs)
  monkeypatch.setattr(linear, 'fp8_matmul', counted)
  return calls


def test_block_fused_is_one_gemm_each_way_with_the_parts_own_codes(
    monkeypatch, seed):
  """With 'block' scaling a fused projection keeps each part's tiles and
  blocks: the same outputs and weight gradients as the parts apart, bit for
  bit, and dx (summed in float32 inside one GEMM rather than in bf16 across
  three) as close to float32; one GEMM each way instead of one per part."""
  k = jax.random.split(jax.random.key(seed), 5)
  x = jax.random.normal(k[0], (2, 40, 256), jnp.bfloat16)
  x = x.at[1, 3, 200].set(90.0)  # an outlier in one tile
  # Parts of other magnitudes (other block scales); widths as Q/K/V's.
  ws = [jax.random.normal(k[1], (256, 256)) * 0.1,
        jax.random.normal(k[2], (256, 128)) * 3.0,
        jax.random.normal(k[3], (256, 128)) * 1e-3]
  dys = tuple(jax.random.normal(k[4], (2, 40, w.shape[1]), jnp.bfloat16)
              * s for w, s in zip(ws, (1.0, 1e-2, 30.0)))
  calls = _count_gemms(monkeypatch)

  def run(fused, ws=ws):
    fn = lambda x, ws: cnn.fp8_dense(x, ws, scaling='block', fused=fused)
    ys, vjp = jax.vjp(fn, x, ws)
    return ys, vjp(tuple(d[..., :y.shape[-1]] for d, y in zip(dys, ys)))

  ys, (dx, dws) = run(True)
  assert len(calls) == 3  # forward, dgrad, wgrad
  ys_apart, (dx_apart, dws_apart) = run(False)
  assert len(calls) == 3 + 9
  for a, b in zip(ys + tuple(dws), ys_apart + tuple(dws_apart)):
    np.testing.assert_array_equal(np.asarray(a, np.float32),
                                  np.asarray(b, np.float32))
  ref = jax.vjp(lambda x, ws: tuple(_ref(x, w) for w in ws), x, ws)[1](
      tuple(d.astype(jnp.float32) for d in dys))[0]
  err, err_apart = _rel(dx, ref), _rel(dx_apart, ref)
  print(f'block dx vs float32: fused {err:.2e}, apart {err_apart:.2e}')
  assert np.isfinite(np.asarray(dx, np.float32)).all()
  assert err < 0.1 and err <= err_apart * 1.05
  # Saved: as apart (x^T's codes and scales, each weight's blocks).
  saved = [[(r.shape, str(r.dtype)) for r in cnn.saved_residuals(
      lambda x, ws: cnn.fp8_dense(x, ws, scaling='block', fused=f), x, ws)]
           for f in (True, False)]
  assert saved[0] == saved[1]
  # A first part that is not whole 128-wide blocks: the parts run apart.
  del calls[:]
  odd = [jax.random.normal(k[1], (256, 64)), ws[1]]
  assert not cnn.linear.block_fusable(odd)
  ys_odd, _ = run(True, odd)
  assert len(calls) == 2 + 4
  for a, w in zip(ys_odd, odd):
    assert _rel(a, _ref(x, w)) < 0.06


@pytest.mark.parametrize('recipe', ['bf16', 'coat', 'coat_block'])
def test_residual_joins_the_output_and_takes_its_gradient(recipe, seed):
  """residual + x @ w (a skip connection): the output plus the residual,
  rounded once ('block': in the GEMM, so within one bf16 step of the
  separately rounded sum; elsewhere XLA's add, the same bits); the
  residual's gradient is the output's, and x and w get the same gradients
  as without it."""
  k = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(k[0], (2, 40, 128), jnp.bfloat16)
  w = jax.random.normal(k[1], (128, 256)) * 0.1
  r = jax.random.normal(k[2], (2, 40, 256), jnp.bfloat16) * 4
  dy = jax.random.normal(k[3], (2, 40, 256), jnp.bfloat16)
  run = lambda x, w, r=None: linear.dense(
      x, [w], recipe=recipe, residual=r)[0]
  y, vjp = jax.vjp(run, x, w, r)
  dx, dw, dr = vjp(dy)
  y0, vjp0 = jax.vjp(run, x, w)
  dx0, dw0 = vjp0(dy)
  want = np.asarray(r, np.float32) + np.asarray(y0, np.float32)
  got = np.asarray(y, np.float32)
  if recipe == 'coat_block':
    # Half a bf16 step of y0 (2^-8 |y0|) and of the sum (2^-8 |r + y0|).
    bound = (np.abs(np.asarray(r, np.float32))
             + np.abs(np.asarray(y0, np.float32))) * 2.0**-7
    assert np.all(np.abs(got - want) <= bound)
    assert not np.array_equal(got, np.asarray(
        jnp.asarray(r) + jnp.asarray(y0), np.float32))  # rounded once
  else:
    np.testing.assert_array_equal(got, np.asarray(
        jnp.asarray(r) + jnp.asarray(y0), np.float32))
  np.testing.assert_array_equal(np.asarray(dr), np.asarray(dy))
  for a, b in ((dx, dx0), (dw, dw0)):
    np.testing.assert_array_equal(np.asarray(a, np.float32),
                                  np.asarray(b, np.float32))


@pytest.mark.parametrize('shape', [(2, 40, 128), (37, 128)])
def test_grad_amax_slot_takes_max_abs_g_from_its_cotangent(shape, seed):
  """grad_amax_slot: the same output and a float32 zero, the slot; backward
  quantizes the output gradient g with the slot's cotangent as max |g|.
  Given max |g| (what the FP8 norm's backward or `fill_grad_amax_slot`
  returns), the gradients are those without a slot, bit for bit; given
  another value, they change (it is read). 37 tokens: padded to 48."""
  k = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(k[0], shape, jnp.bfloat16)
  w = jax.random.normal(k[1], (128, 256)) * 0.1
  r = jax.random.normal(k[2], shape[:-1] + (256,), jnp.bfloat16)
  dy = jax.random.normal(k[3], shape[:-1] + (256,), jnp.bfloat16)
  run = lambda x, w, r: cnn.fp8_dense(x, [w], residual=r,
                                      grad_amax_slot=True)
  plain = lambda x, w, r: cnn.fp8_dense(x, [w], residual=r)[0]
  (y, slot), vjp = jax.vjp(run, x, w, r)
  y0, vjp0 = jax.vjp(plain, x, w, r)
  assert slot.shape == () and slot.dtype == jnp.float32 and float(slot) == 0
  np.testing.assert_array_equal(np.asarray(y, np.float32),
                                np.asarray(y0, np.float32))
  amax = jnp.abs(dy.astype(jnp.float32)).max()
  want = vjp0(dy)
  # Jitted against jitted: under one jit XLA computes a few elements of
  # dx otherwise than op by op, with or without the slot (np.random seed
  # 47: 29 of 4736, up to 5 bf16 ulps).
  grad = lambda f: jax.jit(jax.grad(
      lambda x, w, r: jnp.vdot(f(x, w, r), dy).astype(jnp.float32),
      argnums=(0, 1, 2)))(x, w, r)
  for got, expected in (
      (vjp((dy, amax)), want),
      (grad(lambda *a: linear.fill_grad_amax_slot(*run(*a))), grad(plain))):
    for a, b in zip(got, expected, strict=True):
      np.testing.assert_array_equal(np.asarray(a, np.float32),
                                    np.asarray(b, np.float32))
  dx, dw, _ = vjp((dy, 3 * amax))  # another scale: other E5M2 codes
  assert not np.array_equal(np.asarray(dx, np.float32),
                            np.asarray(want[0], np.float32))
  assert not np.array_equal(np.asarray(dw), np.asarray(want[1]))
  # A NaN in g: max |g| is NaN and so are the gradients (NaN never passes).
  nan_dy = dy.reshape(-1, 256).at[5, 7].set(jnp.nan).reshape(dy.shape)
  _, fill_vjp = jax.vjp(linear.fill_grad_amax_slot, y, slot)
  assert np.isnan(float(fill_vjp(nan_dy)[1]))


def test_grad_amax_slot_errors_name_the_setting():
  x = jnp.ones((2, 16, 128), jnp.bfloat16)
  ws = [jnp.ones((128, 128)), jnp.ones((128, 128))]
  with pytest.raises(ValueError, match='grad_amax_slot needs one kernel'):
    cnn.fp8_dense(x, ws, grad_amax_slot=True)
  with pytest.raises(ValueError, match='grad_amax_slot needs one kernel'):
    cnn.fp8_dense(x, ws[:1], scaling='block', grad_amax_slot=True)
  with pytest.raises(ValueError, match='grad_amax_slot needs FP8 matmuls'):
    linear.dense(x, ws[:1], recipe='bf16', grad_amax_slot=True)
  layer = cnn.CoatLinear(128, 128, rngs=nnx.Rngs(0))
  y, slot = layer(x, grad_amax_slot=True)
  assert y.shape == (2, 16, 128) and slot.shape == ()


def test_residual_errors_name_the_argument():
  x = jnp.ones((2, 16, 128), jnp.bfloat16)
  ws = [jnp.ones((128, 128)), jnp.ones((128, 128))]
  with pytest.raises(ValueError, match='residual: 2 kernels given'):
    cnn.fp8_dense(x, ws, residual=jnp.ones((2, 16, 128), jnp.bfloat16))
  with pytest.raises(ValueError, match='residual has shape'):
    cnn.fp8_dense(x, ws[:1], scaling='block',
                  residual=jnp.ones((2, 16, 128), jnp.float32))
  with pytest.raises(ValueError, match='residual has shape'):
    linear.dense(x, ws[:1], recipe='bf16',
              residual=jnp.ones((16, 128), jnp.bfloat16))


def test_saves_only_fp8_codes_and_scales(seed):
  x = jax.random.normal(jax.random.key(seed), (2, 40, 64), jnp.bfloat16)
  w = jnp.ones((64, 32))
  res = cnn.saved_residuals(_fp8, x, w)
  # The input is saved transposed (K, M): the K-major operand of wgrad; the
  # weight as the E4M3 codes (K, N) that dgrad multiplies (quantized once:
  # no float32 copy of the weight lives until backward).
  assert [(r.shape, str(r.dtype)) for r in res] == [
      ((64, 80), 'float8_e4m3fn'), ((), 'float32'),
      ((64, 32), 'float8_e4m3fn'), ((), 'float32')]


def test_nan_input_gives_nan_output():
  x = jnp.ones((16, 32), jnp.bfloat16).at[3, 5].set(jnp.nan)
  y = jax.jit(_fp8)(x, jnp.ones((32, 16)))
  assert np.isnan(np.asarray(y, np.float32)).all()
  dw = jax.jit(jax.grad(lambda w: jnp.sum(
      _fp8(jnp.ones((16, 32), jnp.bfloat16), w) * jnp.nan)))(jnp.ones((32, 16)))
  assert np.isnan(np.asarray(dw)).all()


@pytest.mark.parametrize('precision', ['bf16', 'fp8_linear', 'coat'])
def test_module_mirrors_nnx_linear(precision, seed):
  layer = cnn.CoatLinear(64, 32, recipe=precision, rngs=nnx.Rngs(0))
  ref = nnx.Linear(64, 32, rngs=nnx.Rngs(0))
  assert layer.kernel.shape == (64, 32) and layer.kernel.dtype == jnp.float32
  assert layer.bias.shape == (32,)
  np.testing.assert_array_equal(layer.kernel[...], ref.kernel[...])
  k = jax.random.split(jax.random.key(seed))
  layer.bias[...] = jax.random.normal(k[0], (32,))
  ref.bias[...] = layer.bias[...]
  x = jax.random.normal(k[1], (5, 64), jnp.bfloat16)
  y = nnx.jit(lambda m, x: m(x))(layer, x)
  assert y.dtype == jnp.bfloat16 and y.shape == (5, 32)
  assert _rel(y, ref(x.astype(jnp.float32))) < 0.06


def test_module_records_logical_axes():
  layer = cnn.CoatLinear(64, 32, kernel_axes=('embed', 'mlp'),
                         rngs=nnx.Rngs(0))
  assert layer.kernel.get_metadata()['out_sharding'] == ('embed', 'mlp')
  assert layer.bias.get_metadata()['out_sharding'] == ('mlp',)


def test_errors_name_the_argument():
  with pytest.raises(ValueError, match='in_features=40 must be a multiple'):
    cnn.CoatLinear(40, 32, recipe='coat', rngs=nnx.Rngs(0))
  cnn.CoatLinear(40, 30, recipe='bf16', rngs=nnx.Rngs(0))  # fine in bf16
  with pytest.raises(ValueError, match='precision='):
    cnn.CoatLinear(32, 32, precision='fp8', rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match='recipe='):
    cnn.CoatLinear(32, 32, recipe='fp8', rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match='both given'):
    cnn.CoatLinear(32, 32, recipe='coat', precision='coat',
                   rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match='floating'):
    cnn.fp8_dense(jnp.ones((16, 32), jnp.int32), [jnp.ones((32, 16))])
  with pytest.raises(ValueError, match=r'kernels\[0\] has shape'):
    cnn.fp8_dense(jnp.ones((16, 32)), [jnp.ones((16, 32))])


# ------------------------------------------------------ scaling='block'


def _block(x, w):
  return cnn.fp8_dense(x, [w], scaling='block')[0]


def test_block_is_the_composition_of_its_quantizers_and_gemms(seed):
  """Forward, dgrad and wgrad equal fp8_matmul on the reference quantizers'
  tiles and blocks, bit for bit (the layouts and scales are wired right),
  tokens padded to 128."""
  k = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(k[0], (3, 50, 256), jnp.bfloat16)
  w = jax.random.normal(k[1], (256, 160)) * 0.05
  dy = jax.random.normal(k[2], (3, 50, 160), jnp.bfloat16)
  y, vjp = jax.vjp(_block, x, w)
  dx, dw = vjp(dy)

  def tiles(a, fmt, transpose_block=(1, 128)):
    a = jnp.pad(a.reshape(150, -1), ((0, 106), (0, 0)))
    return block_reference.quantize_blockwise(
        a, (1, 128), fmt, transpose=True, transpose_block=transpose_block)

  xv, xs, xt, xts = tiles(x, 'e4m3')
  gv, gs, gt, gts = tiles(dy, 'e5m2', (128, 128))  # wgrad's B: blocks
  assert gts.shape == (2, 2)
  wv, ws, _, _ = block_reference.quantize_blockwise(w, (128, 128), 'e4m3')
  mm = fp8_matmul
  y_want = mm(xv, wv.T, xs, ws.T, out_dtype=jnp.bfloat16)[:150]
  dx_want = mm(gv, wv, gs, ws, out_dtype=jnp.bfloat16)[:150]
  dw_want = mm(xt, gt, xts, gts, out_dtype=jnp.float32)
  np.testing.assert_array_equal(np.asarray(y, np.float32).reshape(150, -1),
                                np.asarray(y_want, np.float32))
  np.testing.assert_array_equal(np.asarray(dx, np.float32).reshape(150, -1),
                                np.asarray(dx_want, np.float32))
  np.testing.assert_array_equal(np.asarray(dw), np.asarray(dw_want))


@pytest.mark.parametrize('shape', [(4, 37, 128), (1, 1, 128), (23, 256)])
def test_block_vs_tensor_vs_bf16_against_float32(shape, seed):
  k = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(k[0], shape, jnp.bfloat16)
  w = jax.random.normal(k[1], (shape[-1], 96)) * 0.05
  dy = jax.random.normal(k[2], shape[:-1] + (96,), jnp.bfloat16)

  def fwd_bwd(fn):
    y, vjp = jax.vjp(fn, x, w)
    return (y, *vjp(dy.astype(y.dtype)))

  ref = fwd_bwd(_ref)
  errs = {}
  for name, fn in (('block', _block), ('tensor', _fp8),
                   ('bf16', lambda a, b: linear.bf16_dense(a, [b])[0])):
    out = jax.jit(lambda f=fn: fwd_bwd(f))()
    assert out[0].shape == ref[0].shape and out[1].shape == x.shape
    errs[name] = [_rel(a, b) for a, b in zip(out, ref)]
  print(f'{shape}: rel. error (y, dx, dw) vs float32: {errs}')
  assert errs['block'][0] < 0.06   # E4M3 x E4M3
  assert errs['block'][1] < 0.09   # E5M2 x E4M3
  assert errs['block'][2] < 0.09
  for i in range(3):
    assert errs['block'][i] < 1.2 * errs['tensor'][i] + 1e-3
    if np.prod(shape[:-1]) > 1:  # one token: every tile is exact in FP8
      assert errs['bf16'][i] < errs['block'][i]


def test_block_fanout_saves_only_fp8_and_scales(seed):
  k = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(k[0], (2, 40, 64), jnp.bfloat16)
  w1 = jax.random.normal(k[1], (64, 32)) * 0.1
  w2 = jax.random.normal(k[2], (64, 48)) * 0.1
  fn = lambda x, ws: cnn.fp8_dense(x, ws, scaling='block')
  res = cnn.saved_residuals(fn, x, [w1, w2])
  # x^T (K, M padded to 128) in E4M3 tiles along tokens, one scale per
  # tile; each weight's codes with one scale per 128x128 block.
  assert [(r.shape, str(r.dtype)) for r in res] == [
      ((64, 128), 'float8_e4m3fn'), ((64, 1), 'float32'),
      ((64, 32), 'float8_e4m3fn'), ((1, 1), 'float32'),
      ((64, 48), 'float8_e4m3fn'), ((1, 1), 'float32')]
  grads = jax.jit(jax.grad(lambda x, a, b: sum(
      jnp.sum(jnp.sin(y.astype(jnp.float32))) for y in fn(x, [a, b])),
                           argnums=(0, 1, 2)))(x, w1, w2)
  grads_ref = jax.grad(lambda x, a, b: sum(
      jnp.sum(jnp.sin(_ref(x, w))) for w in (a, b)), argnums=(0, 1, 2))(
          x, w1, w2)
  for a, b in zip(grads, grads_ref):
    assert _rel(a, b) < 0.1


@pytest.mark.parametrize('scaling', ['tensor', 'block'])
def test_reuse_input_saves_x_and_gives_the_same_bits(scaling, seed):
  """reuse_input saves x itself (no FP8 copy) and quantizes x^T again in
  backward: the same outputs and dgrads bit for bit, the same wgrads up to
  float32 summation order."""
  k = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(k[0], (2, 40, 64), jnp.bfloat16) * 3
  x = x.at[1, 7, 9].set(200.0)  # an outlier sets the scale
  ws = [jax.random.normal(k[1], (64, 32)) * 0.1,
        jax.random.normal(k[2], (64, 48)) * 0.1]
  dys = [jax.random.normal(k[3], (2, 40, 32), jnp.bfloat16),
         jax.random.normal(k[3], (2, 40, 48), jnp.bfloat16) * 1e-3]

  def run(reuse):
    fn = lambda x, ws: cnn.fp8_dense(x, ws, scaling=scaling,
                                     reuse_input=reuse)
    ys, vjp = jax.vjp(fn, x, ws)
    dx, dws = vjp(tuple(dys))
    return ys, dx, dws

  (ys, dx, dws), (ys0, dx0, dws0) = (jax.jit(lambda: run(True))(),
                                      jax.jit(lambda: run(False))())
  for a, b in zip(jax.tree.leaves((ys, dx)), jax.tree.leaves((ys0, dx0))):
    assert np.isfinite(np.asarray(a, np.float32)).all()
    np.testing.assert_array_equal(np.asarray(a, np.float32),
                                  np.asarray(b, np.float32))
  # The wgrads multiply the same codes, but XLA:CPU may sum a float32 dot in
  # another order in the other program (one ulp seen on CI); a code off by
  # one E4M3 step would move them by ~1e-3 (that the codes are the same is
  # quantize_test.py's test_tensor_amax_given_back_gives_the_same_codes).
  for a, b in zip(dws, dws0):
    assert np.isfinite(np.asarray(a)).all()
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6,
                               atol=0)
  res = cnn.saved_residuals(
      lambda x, ws: cnn.fp8_dense(x, ws, scaling=scaling, reuse_input=True),
      x, ws)
  amax = [((), 'float32')] if scaling == 'tensor' else []  # block: tiles'
  w_scale = ((), 'float32') if scaling == 'tensor' else ((1, 1), 'float32')
  assert [(r.shape, str(r.dtype)) for r in res] == [
      ((80, 64), 'bfloat16')] + amax + [
          ((64, 32), 'float8_e4m3fn'), w_scale,
          ((64, 48), 'float8_e4m3fn'), w_scale]


def test_reuse_input_is_ignored_where_tokens_are_padded(seed):
  k = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(k[0], (3, 5, 64), jnp.bfloat16)  # 15 tokens
  w = jax.random.normal(k[1], (64, 32)) * 0.1
  saved = lambda reuse: cnn.saved_residuals(
      lambda x, w: cnn.fp8_dense(x, [w], reuse_input=reuse), x, w)
  assert saved(True) == saved(False)
  assert (64, 16) in [r.shape for r in saved(True)]  # FP8 x^T, padded


def test_block_nan_stays_in_its_token():
  """Per-tile scales: a NaN input poisons its own token's outputs only."""
  x = jnp.ones((16, 32), jnp.bfloat16).at[3, 5].set(jnp.nan)
  y = np.asarray(jax.jit(_block)(x, jnp.ones((32, 16))), np.float32)
  assert np.isnan(y[3]).all()
  assert np.isfinite(np.delete(y, 3, axis=0)).all()


def test_block_module_and_errors(seed):
  layer = cnn.CoatLinear(128, 64, recipe='coat_block', rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(seed), (2, 5, 128), jnp.bfloat16)
  y = nnx.jit(lambda m, v: m(v))(layer, x)
  want = cnn.fp8_dense(x, [layer.kernel[...]], scaling='block')[0]
  np.testing.assert_array_equal(np.asarray(y, np.float32),
                                np.asarray(want + layer.bias[...], np.float32))
  with pytest.raises(ValueError, match="scaling='row'"):
    cnn.CoatLinear(128, 64, recipe=dataclasses.replace(
        coat_jax.recipes.COAT, scaling='row'), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match='scaling'):
    cnn.fp8_dense(x, [layer.kernel[...]], scaling='rows')
  other = cnn.CoatLinear(128, 64, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match='must share recipe'):
    linear.fanout(x, [layer, other])


@pytest.mark.gpu
@pytest.mark.parametrize('widths', [(5632,), (2048, 256, 256)])
def test_gpu_block_layer_default_path_matches_xla(widths, seed):
  """On one Hopper GPU the block layer's default path (Pallas quantizers,
  the Mosaic block GEMM when present) against the all-XLA path: one kernel,
  and Q/K/V of the 1b model as one fused projection."""
  k = jax.random.split(jax.random.key(seed), 2 + len(widths))
  x = jax.random.normal(k[0], (8, 512, 2048), jnp.bfloat16)
  ws = [jax.random.normal(kw, (2048, n)) * 0.02
        for kw, n in zip(k[2:], widths)]
  dys = tuple(jax.random.normal(k[1], (8, 512, n), jnp.bfloat16)
              for n in widths)

  def run(implementation):
    fn = lambda a, bs: cnn.fp8_dense(a, bs, scaling='block', fused=True,
                                     implementation=implementation)
    ys, vjp = jax.vjp(fn, x, ws)
    return (*ys, *jax.tree.leaves(vjp(dys)))

  fast = jax.jit(lambda: run(None))()
  slow = jax.jit(lambda: run('xla'))()
  ref_fn = lambda a, bs: tuple(_ref(a, b) for b in bs)
  ref = jax.jit(lambda: (lambda ys, vjp: (*ys, *jax.tree.leaves(vjp(
      tuple(d.astype(jnp.float32) for d in dys)))))(*jax.vjp(ref_fn, x, ws)))()
  assert len(fast) == 2 * len(widths) + 1
  for a, b, r in zip(fast, slow, ref):
    assert _rel(a, b) < 1e-2
    assert _rel(a, r) < 0.09


def test_weight_grads_summed_across_devices_leave_their_gemm_in_bf16():
  """Under a mesh whose batch spans several devices the FP8 weight gradient
  is written in bf16 (so XLA sums it over the devices in bf16) and cast to
  the weight's float32; on one device it stays float32 throughout."""
  kx, kw, kg = jax.random.split(jax.random.key(3), 3)
  x = jax.random.normal(kx, (64, 32), jnp.bfloat16)
  w = jax.random.normal(kw, (32, 48), jnp.float32)
  dy = jax.random.normal(kg, (64, 48), jnp.float32)
  loss = lambda w, x: (linear.fp8_dense(x, [w])[0].astype(jnp.float32)
                       * dy).sum()
  grad = jax.jit(jax.grad(loss))
  in_bf16 = lambda g: np.array_equal(
      np.asarray(g), np.asarray(g.astype(jnp.bfloat16).astype(jnp.float32)))
  one = grad(w, x)
  assert one.dtype == jnp.float32 and not in_bf16(one)
  for shape in ((1, 8, 1), (8, 1, 1), (1, 4, 2)):
    with jax.set_mesh(sharding.make_mesh(shape)):
      summed = grad(w, x)
    assert summed.dtype == jnp.float32 and in_bf16(summed), shape
    assert np.all(np.isfinite(np.asarray(summed)))
    np.testing.assert_allclose(summed, one, rtol=2**-8, atol=1e-6)


@pytest.mark.parametrize('scaling', ['tensor', 'block'])
def test_grad_dtype_e4m3_quantizes_gradients_more_finely(scaling, seed):
  """grad_dtype='e4m3' (one more mantissa bit than E5M2) takes the output
  gradients to E4M3: dx and dw land closer to float32's on Gaussian data."""
  k = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(k[0], (4, 64, 256), jnp.bfloat16)
  w = jax.random.normal(k[1], (256, 128)) * 0.05
  dy = jax.random.normal(k[2], (4, 64, 128), jnp.bfloat16)
  _, vjp = jax.vjp(lambda x, w: jnp.dot(x.astype(jnp.float32), w), x, w)
  want = vjp(dy.astype(jnp.float32))
  errors = {}
  for grad_dtype in ('e5m2', 'e4m3'):
    _, vjp = jax.vjp(lambda x, w, g=grad_dtype: cnn.fp8_dense(
        x, [w], scaling=scaling, grad_dtype=g)[0], x, w)
    errors[grad_dtype] = [_rel(got, ref) for got, ref in zip(vjp(dy), want)]
  for e4m3, e5m2 in zip(errors['e4m3'], errors['e5m2']):
    assert e4m3 < 0.75 * e5m2, errors
  with pytest.raises(ValueError, match='grad_dtype'):
    cnn.fp8_dense(x, [w], grad_dtype='e3m4')
