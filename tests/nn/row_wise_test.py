"""`coat_jax.nn.fsdp.row_wise`: the FP8 layers' row-by-row Pallas kernels on
each device's rows under an FSDP mesh (8 fake CPU devices, the kernels
interpreted), against one call on the whole arrays."""


import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from coat_jax.nn import activations
from coat_jax.nn import fsdp
from coat_jax.nn import linear
from coat_jax.nn import norm
from coat_jax.training import sharding
from pallas_kernels import _common

ROWS = 16  # 2 rows a device on 8


def _mesh(n=8, data=1):
  """A (data, fsdp = n / data, tensor 1) mesh of the first n devices."""
  return sharding.make_mesh((data, n // data, 1), jax.devices()[:n])


@pytest.fixture
def on_gpus(monkeypatch):
  """Makes this CPU pass for Hopper GPUs in `row_wise` (the kernels then
  run interpreted on each shard)."""
  monkeypatch.setattr(_common, 'gpus_run_pallas', lambda: True)


def _sharded(mesh, *arrays):
  return [jax.device_put(a, NamedSharding(mesh, P(fsdp.BATCH_AXES)))
          for a in arrays]


def _per_shard_and_whole(fn, *arrays, data=1):
  """(fn's outputs jitted under an 8-device mesh on row-sharded inputs,
  its jaxpr there, the outputs of the Pallas kernels on one device)."""
  mesh = _mesh(data=data)
  with jax.set_mesh(mesh):
    sharded = _sharded(mesh, *arrays)
    jaxpr = str(jax.make_jaxpr(fn)(*sharded))
    outs = jax.jit(fn)(*sharded)
  # One device: the same kernels (implementation='pallas') on the whole
  # arrays.
  with jax.set_mesh(_mesh(1)), pytest.MonkeyPatch.context() as m:
    m.setattr(fsdp, 'row_wise', lambda kernel, args, *_: kernel(
        *args, implementation='pallas'))
    whole = jax.jit(fn)(*arrays)
  return outs, jaxpr, whole


# XLA:CPU compiles an interpreted kernel's row reductions differently for 2
# rows and for 16: float32 statistics may differ by an ulp, and the bf16
# values computed from them by one bf16 rounding.
ULPS = {jnp.dtype(jnp.float32): 2e-7, jnp.dtype(jnp.bfloat16): 2**-8}


def _assert_same(outs, whole, exact=True):
  """Equal arrays: scalars exactly, the others exactly unless `exact` is
  False (then within ULPS: FP8 codes still exactly)."""
  for a, b in zip(jax.tree.leaves(outs), jax.tree.leaves(whole),
                  strict=True):
    assert a.shape == b.shape and a.dtype == b.dtype
    rtol = 0.0 if exact or a.ndim == 0 else ULPS.get(a.dtype, 0.0)
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=0)


def _x(key, shape, dtype=jnp.bfloat16, outlier_row=None):
  x = jax.random.normal(jax.random.key(key), shape, jnp.float32)
  if outlier_row is not None:  # the amax lives on one device only
    x = x.at[outlier_row].multiply(300.0)
  return x.astype(dtype)


def test_rms_norm_forward_and_backward_per_shard(on_gpus):
  x = _x(0, (ROWS, 4, 64), outlier_row=11)
  scale = jnp.linspace(0.5, 1.5, 64, dtype=jnp.float32)
  g = _x(1, x.shape, outlier_row=3)
  residual_grad = _x(2, x.shape)

  def fn(x, g, residual_grad):
    (y, y_amax), (xq, rstd, _) = norm._fp8_rms_norm_with_amax_fwd(
        x, scale, 1e-5, 16)
    grads = norm._fp8_rms_norm_bwd(1e-5, 16, (xq, rstd, scale), g)
    with_residual = norm._fp8_rms_norm_bwd(1e-5, 16, (xq, rstd, scale), g,
                                           residual_grad)
    return y, y_amax, xq.values, xq.scale, rstd, grads, with_residual

  outs, jaxpr, whole = _per_shard_and_whole(fn, x, g, residual_grad)
  assert jaxpr.count('shard_map') == 3 and 'pallas_call' in jaxpr
  y, y_amax, codes, scales, rstd = outs[:5]
  _assert_same((y_amax, codes, scales), whole[1:4])
  _assert_same((y, rstd), (whole[0], whole[4]), exact=False)
  for got, want in zip(outs[5:], whole[5:]):
    _assert_same(got[:2], want[:2], exact=False)  # dx, max |dx|
    # dscale: each device's column sums, then summed across devices.
    np.testing.assert_allclose(got[2], want[2], rtol=1e-5, atol=0)
  assert float(outs[1]) == float(jnp.max(jnp.abs(outs[0].astype(
      jnp.float32))))


def test_swiglu_forward_and_backward_per_shard(on_gpus):
  gate, up, dh = (_x(i, (ROWS * 4, 96), outlier_row=5 * i + 7)
                  for i in range(3))

  def fn(gate, up, dh):
    (h, h_amax), residuals = activations.fp8_swiglu_fwd(gate, up, 16)
    grads = activations.fp8_swiglu_grads(residuals, (dh, None))
    return h, h_amax, residuals, grads

  outs, jaxpr, whole = _per_shard_and_whole(fn, gate, up, dh)
  assert jaxpr.count('shard_map') == 2
  _assert_same(outs, whole)


@pytest.mark.parametrize('transpose,data', [(False, 1), (True, 1),
                                            (True, 2)])
def test_per_tensor_quantizer_per_shard(on_gpus, transpose, data):
  """data 2: rows split over data x fsdp = 2 x 4."""
  x = _x(3, (ROWS * 2, 48), outlier_row=29)

  def fn(x):
    return linear._quantize(x, 'e4m3', linear._amax(x), transpose)

  outs, jaxpr, whole = _per_shard_and_whole(fn, x, data=data)
  assert 'shard_map' in jaxpr and (outs[2] is None) == (not transpose)
  _assert_same(outs, whole)
  if transpose:  # the transposed codes are split by columns, as they came
    assert outs[2].addressable_shards[0].data.shape == (48, ROWS * 2 // 8)
    np.testing.assert_array_equal(np.asarray(outs[2], np.float32),
                                  np.asarray(outs[0], np.float32).T)


@pytest.mark.parametrize('amax', [None, 'given'])
def test_parts_quantizer_per_shard(on_gpus, amax):
  parts = [_x(4, (ROWS, 32)), _x(5, (ROWS, 16), outlier_row=14)]

  def fn(*parts):
    given = None if amax is None else [linear._amax(x) for x in parts]
    return linear._quantize_parts(parts, 'e5m2', given)

  outs, jaxpr, whole = _per_shard_and_whole(fn, *parts)
  assert 'shard_map' in jaxpr
  _assert_same(outs, whole)
  # The parts' codes side by side, as one tensor's with one scale.
  joined = linear._quantize(jnp.concatenate(parts, axis=1), 'e5m2',
                            linear._amax(jnp.concatenate(parts, axis=1)),
                            transpose=True)
  _assert_same(outs, joined)


def test_nan_on_one_device_reaches_every_amax(on_gpus):
  x = _x(6, (ROWS, 64)).at[13, 5].set(jnp.nan)
  scale = jnp.ones((64,), jnp.float32)
  mesh = _mesh()
  with jax.set_mesh(mesh):
    (xs,) = _sharded(mesh, x)
    (_, y_amax), _ = jax.jit(
        lambda x: norm._fp8_rms_norm_with_amax_fwd(x, scale, 1e-5, 16))(xs)
  assert np.isnan(float(y_amax))


def test_unchanged_where_rows_do_not_divide_or_without_a_mesh(on_gpus):
  """12 rows on 8 devices, or no mesh: the kernel is called once, as
  `implementation=None` picks (here XLA), with no shard_map."""
  calls = []

  def kernel(x, *, implementation):
    calls.append(implementation)
    return (x * 2,)

  with jax.set_mesh(_mesh()):
    assert not fsdp.pallas_on_shards(12)
    jaxpr = str(jax.make_jaxpr(lambda x: fsdp.row_wise(
        kernel, (x,), (fsdp.ROWS,), (fsdp.ROWS,)))(jnp.ones((12, 4))))
  assert 'shard_map' not in jaxpr
  fsdp.row_wise(kernel, (jnp.ones((16, 4)),), (fsdp.ROWS,), (fsdp.ROWS,))
  assert calls == [None, None]
  assert fsdp.pallas_on_shards(16) is False  # no mesh


def test_not_on_cpus_or_tensor_parallel_meshes():
  with jax.set_mesh(_mesh()):
    assert not fsdp.pallas_on_shards(16)  # CPUs run no compiled Pallas
  mesh = sharding.make_mesh((1, 4, 2), jax.devices())
  with jax.set_mesh(mesh):
    assert not fsdp.pallas_on_shards(16)
