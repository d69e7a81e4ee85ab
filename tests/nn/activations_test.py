"""FP8-saving drop-ins for jax.nn (silu, gelu, swiglu, geglu): the values of
jax.nn's in float32, FP8-tolerance gradients, what they save, fallbacks and
errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import coat_jax.nn as cnn

# name -> (drop-in, its jax.nn reference, number of inputs)
UNARY = {
    'silu': (cnn.silu, jax.nn.silu),
    'gelu_tanh': (cnn.gelu, functools.partial(jax.nn.gelu, approximate=True)),
    'gelu_exact': (functools.partial(cnn.gelu, approximate=False),
                   functools.partial(jax.nn.gelu, approximate=False)),
}
GLU = {
    'swiglu': (cnn.swiglu, lambda g, u: jax.nn.silu(g) * u),
    'geglu_tanh': (cnn.geglu, lambda g, u: jax.nn.gelu(g) * u),
    'geglu_exact': (functools.partial(cnn.geglu, approximate=False),
                    lambda g, u: jax.nn.gelu(g, approximate=False) * u),
}
ALL = {**{k: (*v, 1) for k, v in UNARY.items()},
       **{k: (*v, 2) for k, v in GLU.items()}}


def _inputs(seed, n, shape, dtype):
  keys = jax.random.split(jax.random.key(seed), n)
  return tuple((2 * jax.random.normal(k, shape)).astype(dtype) for k in keys)


def _f32(fn):
  """fn computed in float32 and cast back: the drop-ins' forward."""
  return lambda *xs: fn(*(x.astype(jnp.float32) for x in xs)).astype(
      xs[0].dtype)


def _rel(a, b):
  a, b = (np.asarray(t, np.float64).ravel() for t in (a, b))
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def _cos(a, b):
  a, b = (np.asarray(t, np.float64).ravel() for t in (a, b))
  return a @ b / (np.linalg.norm(a) * np.linalg.norm(b))


def _group_exact(seed, shape):
  """x whose E4M3 1x16 groups with power-of-two scales are exact."""
  codes = jnp.clip(jax.random.normal(jax.random.key(seed), shape) * 100,
                   -448, 448)
  codes = codes.astype(jnp.float8_e4m3fn).astype(jnp.float32)
  groups = codes.reshape(shape[:-1] + (shape[-1] // 16, 16))
  groups = groups.at[..., 5].set(-448.0)
  return (groups.reshape(shape) * 2.0**-7).astype(jnp.bfloat16)


@pytest.mark.parametrize('name', ALL)
@pytest.mark.parametrize('dtype', [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize('width', [64, 40])
def test_forward_is_jax_nn_in_float32(name, dtype, width):
  """The jax.nn function of the float32 inputs, cast back: within one
  rounding of x.dtype (2^-8 relative in bfloat16, 1e-6 in float32); both
  the multiple-of-16 path (swiglu's Pallas-backed one) and the generic
  partial-group one (width 40)."""
  fn, ref, n = ALL[name]
  xs = _inputs(6201, n, (3, 17, width), dtype)
  y = jax.jit(fn)(*xs)
  y_ref = jax.jit(_f32(ref))(*xs)
  assert y.dtype == dtype and y.shape == xs[0].shape
  y, y_ref = (np.asarray(a, np.float32) for a in (y, y_ref))
  step = 2.0**-8 if dtype == jnp.bfloat16 else 1e-6
  assert (np.abs(y - y_ref) <= step * np.abs(y_ref) + 1e-7).all()


@pytest.mark.parametrize('name', ALL)
@pytest.mark.parametrize('dtype', [jnp.bfloat16, jnp.float32])
def test_gradients_within_fp8_tolerance(name, dtype):
  """Backward reads the E4M3 groups: each input's gradient within 5%
  relative error and cosine > 0.999 of float32 autodiff (measured:
  0.7-3.1%, cosines >= 0.9995)."""
  fn, ref, n = ALL[name]
  xs = _inputs(6202, n, (2, 33, 128), dtype)
  g = jax.random.normal(jax.random.key(6203), xs[0].shape, dtype)
  grads = jax.jit(lambda *xs: jax.vjp(fn, *xs)[1](g))(*xs)
  grads_ref = jax.jit(lambda *xs: jax.vjp(ref, *xs)[1](
      g.astype(jnp.float32)))(*(x.astype(jnp.float32) for x in xs))
  for got, want in zip(grads, grads_ref, strict=True):
    assert got.dtype == dtype
    print(f'{name} {jnp.dtype(dtype).name}: rel {_rel(got, want):.4f}'
          f' cos {_cos(got, want):.6f}')
    assert _rel(got, want) < 0.05 and _cos(got, want) > 0.999


@pytest.mark.parametrize('name', ALL)
def test_group_exact_inputs_give_float32_gradients(name):
  """Where the E4M3 groups hold the inputs exactly, the gradients are
  float32 autodiff's (rounded to bfloat16)."""
  fn, ref, n = ALL[name]
  xs = tuple(_group_exact(6204 + i, (4, 8, 64)) for i in range(n))
  g = jax.random.normal(jax.random.key(6206), xs[0].shape, jnp.bfloat16)
  grads = jax.jit(lambda *xs: jax.vjp(fn, *xs)[1](g))(*xs)
  grads_ref = jax.jit(lambda *xs: jax.vjp(ref, *xs)[1](
      g.astype(jnp.float32)))(*(x.astype(jnp.float32) for x in xs))
  for got, want in zip(grads, grads_ref, strict=True):
    got, want = np.asarray(got, np.float32), np.asarray(want)
    assert (np.abs(got - want) <= 2.0**-7 * np.abs(want)
            + 1e-6 * np.abs(want).max()).all()


@pytest.mark.parametrize('name', ALL)
@pytest.mark.parametrize('width', [128, 40])
def test_saves_only_fp8_groups(name, width):
  """Saved: each input's E4M3 codes and E8M0 group scales (a partial last
  group for width 40), nothing else: 1 + 1/16 bytes an element (bf16
  autodiff keeps 2 bytes or more an element)."""
  fn, ref, n = ALL[name]
  xs = _inputs(6207, n, (2, 24, width), jnp.bfloat16)
  res = cnn.saved_residuals(fn, *xs)
  groups = -(-width // 16)
  assert sorted((r.shape, str(r.dtype)) for r in res) == sorted(
      [((2, 24, width), 'float8_e4m3fn'), ((2, 24, groups), 'float8_e8m0fnu')]
      * n)
  plain = sum(np.prod(r.shape) * np.dtype(r.dtype).itemsize
              for r in cnn.saved_residuals(ref, *xs))
  assert plain >= 2 * n * xs[0].size


def test_swiglu_takes_the_kernel_path_where_it_tiles():
  """swiglu runs fp8_swiglu (the SwiGLU kernels' API) for a last axis that
  is a multiple of 16 in bfloat16 or float32, the generic custom_vjp
  elsewhere; both give the same values."""
  gate, up = _inputs(6208, 2, (4, 48), jnp.bfloat16)
  jaxpr = str(jax.make_jaxpr(jax.grad(
      lambda g: cnn.swiglu(g, up).astype(jnp.float32).sum()))(gate))
  jaxpr_fp8 = str(jax.make_jaxpr(jax.grad(
      lambda g: cnn.fp8_swiglu(g, up).astype(jnp.float32).sum()))(gate))
  assert jaxpr == jaxpr_fp8
  odd_gate, odd_up = gate[:, :40], up[:, :40]
  np.testing.assert_array_equal(cnn.swiglu(odd_gate, odd_up),
                                cnn.swiglu(gate, up)[:, :40])


def _outcome(fn, *xs):
  """fn's values, or the message of the TypeError it raises."""
  try:
    return np.asarray(fn(*xs))
  except TypeError as e:
    return str(e)


def test_non_floating_and_non_array_inputs_fall_back_to_jax_nn():
  """Inputs that are no floating jax.Array with an axis (ints, complex, 0-d,
  numpy arrays, Python numbers) get jax.nn's function itself: its values,
  or its error (jax.nn.silu refuses ints, the exact gelu complex)."""
  xs = [jnp.arange(-8, 8, dtype=jnp.int32).reshape(2, 8),
        jnp.ones((2, 16), jnp.complex64), jnp.float32(1.5),
        np.linspace(-3, 3, 32, dtype=np.float32).reshape(2, 16), 1.5]
  errors = 0
  for fn, ref, n in ALL.values():
    for x in xs:
      got, want = _outcome(fn, *[x] * n), _outcome(ref, *[x] * n)
      errors += isinstance(want, str)
      np.testing.assert_array_equal(got, want)
  assert errors == 4  # silu and swiglu on ints, exact gelu/geglu on complex
  # Nothing is quantized: a complex input keeps what autodiff keeps.
  c = xs[1]
  assert ({str(r.dtype) for r in cnn.saved_residuals(cnn.gelu, c)}
          == {str(r.dtype) for r in cnn.saved_residuals(jax.nn.gelu, c)})


def test_errors():
  gate = jnp.ones((4, 32), jnp.bfloat16)
  for fn in (cnn.swiglu, cnn.geglu):
    with pytest.raises(ValueError, match=r'gate \(4, 32\) bfloat16 and up'
                       r' \(4, 16\) bfloat16 must have the same shape'):
      fn(gate, gate[:, :16])
    with pytest.raises(ValueError, match='float32 must have the same shape and'
                       ' dtype'):
      fn(gate, gate.astype(jnp.float32))
  with pytest.raises(ValueError, match='activation_group_size=24'):
    cnn.silu(gate, group_size=24)
  with pytest.raises(ValueError, match=r'gate.shape\[-1\]=40 must be a'):
    cnn.fp8_swiglu(gate[:, :20].repeat(2, axis=1),
                   gate[:, :20].repeat(2, axis=1))
