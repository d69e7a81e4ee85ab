"""FP8 LayerNorm: nnx.LayerNorm's forward, FP8-tolerance gradients, what it
saves, edge cases and errors."""

import itertools

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coat_jax import recipes
import coat_jax.nn as cnn
from coat_jax.nn import residuals


def _params(seed, h, dtype=jnp.float32):
  k = jax.random.split(jax.random.key(seed), 2)
  return ((1 + 0.2 * jax.random.normal(k[0], (h,))).astype(dtype),
          (0.1 * jax.random.normal(k[1], (h,))).astype(dtype))


def _f32_layer_norm(x, scale, bias, eps=1e-6):
  """LayerNorm in float32 (two-pass variance), differentiated by autodiff:
  the reference of the gradients."""
  x = x.astype(jnp.float32)
  mean = x.mean(-1, keepdims=True)
  var = jnp.square(x - mean).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + eps) * scale + bias


@jax.jit
def _grads(x, scale, bias, g):
  """(y, dx, dscale, dbias) of fp8_layer_norm, then of the float32
  reference."""
  y, vjp = jax.vjp(cnn.fp8_layer_norm, x, scale, bias)
  y_ref, vjp_ref = jax.vjp(_f32_layer_norm, x, scale, bias)
  return (y, *vjp(g)), (y_ref, *vjp_ref(g.astype(jnp.float32)))


def _rel(a, b):
  a, b = (np.asarray(t, np.float64).ravel() for t in (a, b))
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def _cos(a, b):
  a, b = (np.asarray(t, np.float64).ravel() for t in (a, b))
  return a @ b / (np.linalg.norm(a) * np.linalg.norm(b))


def _group_exact(seed, shape, exponent=-5):
  """bf16 x whose E4M3 1x16 groups with power-of-two scales are exact."""
  codes = jnp.clip(jax.random.normal(jax.random.key(seed), shape) * 100,
                   -448, 448)
  codes = codes.astype(jnp.float8_e4m3fn).astype(jnp.float32)
  groups = codes.reshape(shape[:-1] + (shape[-1] // 16, 16))
  groups = groups.at[..., 0].set(448.0)  # each group's max: the scale 2^e
  return (groups.reshape(shape) * 2.0**exponent).astype(jnp.bfloat16)


@pytest.mark.parametrize(
    'dtype,x_dtype,fast,use_scale,use_bias',
    [(d, xd, f, True, True) for d, xd, f in itertools.product(
        [None, jnp.bfloat16, jnp.float32], [jnp.bfloat16, jnp.float32],
        [True, False])]
    + [(None, jnp.bfloat16, True, False, True),
       (jnp.bfloat16, jnp.bfloat16, True, True, False),
       (None, jnp.float32, False, False, False)])
@pytest.mark.parametrize('recipe', ['coat', 'bf16'])
def test_module_forward_equals_nnx_layer_norm(dtype, x_dtype, fast,
                                              use_scale, use_bias, recipe):
  """Forward equal to nnx.LayerNorm's with the same params and settings (its
  arithmetic, in float32): within 1e-6 relative in float32 and one bfloat16
  step in bfloat16 (bit-identical on this CPU)."""
  kw = dict(epsilon=1e-5, dtype=dtype, use_fast_variance=fast,
            use_scale=use_scale, use_bias=use_bias, rngs=nnx.Rngs(0))
  ref = nnx.LayerNorm(128, **kw)
  norm = cnn.CoatLayerNorm(128, recipe=recipe, **kw)
  scale, bias = _params(5101, 128)
  for layer in (ref, norm):
    if use_scale:
      layer.scale[...] = scale
    if use_bias:
      layer.bias[...] = bias
  # A large mean (3) against the spread: fast and exact variance differ.
  x = (3 + 2 * jax.random.normal(jax.random.key(5102), (4, 24, 128))
       ).astype(x_dtype)
  y = nnx.jit(lambda m, x: m(x))(norm, x)
  y_ref = nnx.jit(lambda m, x: m(x))(ref, x)
  assert y.dtype == y_ref.dtype
  y, y_ref = (np.asarray(a, np.float32) for a in (y, y_ref))
  step = 2.0**-7 if y_ref.dtype == jnp.bfloat16 else 1e-6
  assert (np.abs(y - y_ref) <= step * np.abs(y_ref) + 1e-6).all()


def test_random_input_gradients_within_fp8_tolerance():
  """dx and dscale read the E4M3 copy of x: cosine > 0.999 and relative
  error < 5% against float32 autodiff (measured: dx 0.3%, dscale 2.7-2.8%,
  cosines >= 0.9996); dbias reads only g (float32 rounding)."""
  k = jax.random.split(jax.random.key(5103), 2)
  for x_dtype in (jnp.bfloat16, jnp.float32):
    x = (1 + 3 * jax.random.normal(k[0], (2, 37, 256))).astype(x_dtype)
    scale, bias = _params(5104, 256)
    g = jax.random.normal(k[1], x.shape, x_dtype)
    (y, dx, ds, db), (y_ref, dx_ref, ds_ref, db_ref) = _grads(x, scale, bias,
                                                              g)
    assert y.dtype == dx.dtype == x_dtype
    assert ds.dtype == db.dtype == jnp.float32
    # The forward pass reads the exact x: float32 (then x.dtype) rounding.
    assert _rel(y, y_ref) < (2**-8 if x_dtype == jnp.bfloat16 else 1e-5)
    for got, want in ((dx, dx_ref), (ds, ds_ref)):
      print(f'{jnp.dtype(x_dtype).name}: rel {_rel(got, want):.4f}'
            f' cos {_cos(got, want):.6f}')
      assert _rel(got, want) < 0.05 and _cos(got, want) > 0.999
    np.testing.assert_allclose(db, db_ref, rtol=1e-5, atol=1e-4)


def test_group_exact_input_gradients_equal_float32():
  """Where E4M3 1x16 groups hold x exactly, backward is float32 LayerNorm's:
  the quantization is the only approximation."""
  x = _group_exact(5105, (3, 24, 128))
  scale, bias = _params(5106, 128)
  g = jax.random.normal(jax.random.key(5107), x.shape, jnp.bfloat16)
  (_, dx, ds, db), (_, dx_ref, ds_ref, db_ref) = _grads(x, scale, bias, g)
  np.testing.assert_allclose(np.asarray(dx, np.float32), dx_ref, rtol=2**-8,
                             atol=1e-5 * np.abs(dx_ref).max())
  np.testing.assert_allclose(ds, ds_ref, rtol=1e-4,
                             atol=1e-5 * np.abs(ds_ref).max())
  np.testing.assert_allclose(db, db_ref, rtol=1e-5, atol=1e-5)


def test_saves_fp8_groups_e8m0_scales_and_row_statistics():
  x = jnp.ones((2, 40, 128), jnp.bfloat16)
  scale, bias = _params(5108, 128)
  res = cnn.saved_residuals(cnn.fp8_layer_norm, x, scale, bias)
  assert [(r.shape, str(r.dtype)) for r in res] == [
      ((2, 40, 128), 'float8_e4m3fn'), ((2, 40, 8), 'float8_e8m0fnu'),
      ((2, 40, 1), 'float32'), ((2, 40, 1), 'float32')]
  per_element = residuals.nbytes(res) / x.size
  plain = residuals.nbytes(cnn.saved_residuals(cnn.layer_norm, x, scale,
                                               bias)) / x.size
  print(f'fp8_layer_norm saves {per_element:.4f} bytes/element, plain'
        f' LayerNorm (autodiff) {plain:.4f}')
  assert per_element == pytest.approx(1 + 1 / 16 + 8 / 128)
  assert plain >= 2 * per_element


def test_module_saves_only_fp8_activations():
  """A bfloat16 CoatLayerNorm with float32 params: the activation residuals
  are the FP8 groups and the row statistics (the bf16 copy of the scale is
  a param's, not an activation's)."""
  norm = cnn.CoatLayerNorm(64, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  graph, state = nnx.split(norm)
  fn = lambda s, x: nnx.merge(graph, s)(x)
  x = lambda b: jax.ShapeDtypeStruct((b, 16, 64), jnp.float32)
  res = cnn.activation_residuals(fn, (state, x(2)), (state, x(4)))
  assert sorted(str(r.dtype) for r in res) == [
      'float32', 'float32', 'float8_e4m3fn', 'float8_e8m0fnu']


def test_zero_rows_and_partial_groups():
  """A zero row normalizes to the bias (its gradient stays finite); H that
  is no multiple of 16 gets a zero-padded partial group."""
  for h in (40, 7):
    x = jax.random.normal(jax.random.key(5109), (3, 5, h)).at[1, 2].set(0.0)
    scale, bias = _params(5110, h)
    g = jax.random.normal(jax.random.key(5111), x.shape)
    (y, dx, ds, db), (y_ref, dx_ref, ds_ref, db_ref) = _grads(x, scale, bias,
                                                              g)
    np.testing.assert_allclose(y[1, 2], bias, rtol=1e-6)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    assert np.isfinite(np.asarray(dx)).all()
    # The zero row's dx is exact: its x_hat is 0 with or without FP8.
    np.testing.assert_allclose(dx[1, 2], dx_ref[1, 2], rtol=1e-5)
    assert _cos(dx, dx_ref) > 0.999 and _cos(ds, ds_ref) > 0.999
    np.testing.assert_allclose(db, db_ref, rtol=1e-5, atol=1e-5)
    res = cnn.saved_residuals(cnn.fp8_layer_norm, x, scale, bias)
    assert res[1].shape == (3, 5, -(-h // 16))


def test_without_scale_or_bias():
  x = jax.random.normal(jax.random.key(5112), (6, 32), jnp.bfloat16)
  g = jax.random.normal(jax.random.key(5113), x.shape, jnp.bfloat16)
  for scale, bias in ((None, None), (jnp.full((32,), 2.0), None),
                      (None, jnp.ones((32,)))):
    y, vjp = jax.vjp(cnn.fp8_layer_norm, x, scale, bias)
    dx, ds, db = vjp(g)
    assert (ds is None) == (scale is None) and (db is None) == (bias is None)
    ref = lambda x: _f32_layer_norm(
        x, 1.0 if scale is None else scale, 0.0 if bias is None else bias)
    y_ref, vjp_ref = jax.vjp(ref, x.astype(jnp.float32))
    assert _rel(y, y_ref) < 2**-8
    assert _cos(dx, vjp_ref(g.astype(jnp.float32))[0]) > 0.999


def test_nan_propagates_to_dx():
  x = jnp.ones((4, 32), jnp.bfloat16).at[1, 3].set(jnp.nan)
  dx = jax.jit(jax.grad(lambda x: jnp.sum(cnn.fp8_layer_norm(
      x, None, None).astype(jnp.float32))))(x)
  assert np.isnan(np.asarray(dx[1], np.float32)).all()
  assert not np.isnan(np.asarray(dx[0], np.float32)).any()


@pytest.mark.parametrize('recipe', ['coat', 'fp8_linear'])
def test_module_param_gradients(recipe):
  """nnx.grad of a CoatLayerNorm: float32 gradients of its float32 params,
  within FP8 tolerance of nnx.LayerNorm's (equal without FP8
  activations)."""
  x = (2 * jax.random.normal(jax.random.key(5114), (4, 16, 64))
       ).astype(jnp.bfloat16)
  g = jax.random.normal(jax.random.key(5115), x.shape)
  loss = lambda m: jnp.sum(m(x).astype(jnp.float32) * g)
  grads = []
  for layer in (nnx.LayerNorm(64, dtype=jnp.bfloat16, rngs=nnx.Rngs(1)),
                cnn.CoatLayerNorm(64, dtype=jnp.bfloat16, recipe=recipe,
                                  rngs=nnx.Rngs(1))):
    layer.scale[...], layer.bias[...] = _params(5116, 64)
    grads.append(nnx.jit(nnx.grad(loss))(layer))
  ref, got = grads
  for name in ('scale', 'bias'):
    assert got[name][...].dtype == jnp.float32
    if recipe == 'fp8_linear':
      np.testing.assert_allclose(got[name][...], ref[name][...], rtol=1e-5,
                                 atol=1e-5)
    else:
      assert _cos(got[name][...], ref[name][...]) > 0.999


def test_module_params_and_metadata():
  norm = cnn.CoatLayerNorm(32, epsilon=1e-5, param_dtype=jnp.bfloat16,
                           scale_axes=('norm',), rngs=nnx.Rngs(0))
  assert norm.scale.shape == norm.bias.shape == (32,)
  assert norm.scale.dtype == norm.bias.dtype == jnp.bfloat16
  np.testing.assert_array_equal(norm.scale[...], 1)
  np.testing.assert_array_equal(norm.bias[...], 0)
  assert norm.scale.get_metadata()['out_sharding'] == ('norm',)
  assert norm.bias.get_metadata()['out_sharding'] == ('norm',)
  bare = cnn.CoatLayerNorm(32, use_scale=False, use_bias=False,
                           rngs=nnx.Rngs(0))
  assert bare.scale is None and bare.bias is None
  assert not jax.tree.leaves(nnx.state(bare, nnx.Param))


def test_errors():
  with pytest.raises(ValueError, match='num_features=40 must be a multiple'):
    cnn.CoatLayerNorm(40, rngs=nnx.Rngs(0))
  cnn.CoatLayerNorm(40, recipe=recipes.FP8_LINEAR, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match='recipe=.fp9. is not a recipe'):
    cnn.CoatLayerNorm(32, recipe='fp9', rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match='floating'):
    cnn.fp8_layer_norm(jnp.ones((2, 32), jnp.int32), None, None)
  with pytest.raises(ValueError, match='at least one axis'):
    cnn.fp8_layer_norm(jnp.float32(1.0), None, None)
  with pytest.raises(ValueError, match=r'bias has shape \(16,\)'):
    cnn.fp8_layer_norm(jnp.ones((2, 32)), jnp.ones((32,)), jnp.ones((16,)))
  with pytest.raises(ValueError, match='activation_group_size=3'):
    cnn.fp8_layer_norm(jnp.ones((2, 32)), None, None, group_size=3)
  norm = cnn.CoatLayerNorm(32, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match='mask'):
    norm(jnp.ones((2, 32)), mask=jnp.ones((2, 32), bool))
