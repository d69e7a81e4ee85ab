"""pallas_kernels.dispatch: the registry, its resolver and scoped choices.

The decision table runs on stand-in devices (`_device`'s answers replaced:
a CPU, one or eight Hopper GPUs, an older and a newer GPU); every op of the
registry is then called through its public function, inside and outside a
`use_implementation` scope, and its jaxpr shows which implementation ran.
"""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import _device
from pallas_kernels import dispatch
from pallas_kernels.coat_adam_step import coat_adam_step
from pallas_kernels.coat_adam_step.reference import Moment
from pallas_kernels.coat_adam_update import coat_adam_update
from pallas_kernels.fp8_matmul import fp8_matmul
from pallas_kernels.quantize_blockwise import quantize_blockwise
from pallas_kernels.quantize_per_group import dequantize_per_group
from pallas_kernels.quantize_per_group import quantize_per_group
from pallas_kernels.quantize_per_group import reference as group_reference
from pallas_kernels.quantize_per_tensor import quantize_per_tensor
from pallas_kernels.rms_norm_fp8 import rms_norm_fp8_fwd
from pallas_kernels.swiglu_fp8 import swiglu_fp8_fwd

OPS = sorted(dispatch.OPS)
# (on a GPU, compute capability, devices)
DEVICES = {
    'cpu': (False, None, 8),
    'hopper': (True, (9, 0), 1),
    'hopper_x8': (True, (9, 0), 8),
    'ampere': (True, (8, 0), 1),
    'blackwell': (True, (10, 0), 1),
}
XLA = ('xla', False)


@pytest.fixture(params=sorted(DEVICES))
def devices(request, monkeypatch):
  """Stands in for the devices named by the param: `_device`'s answers."""
  gpu, capability, count = DEVICES[request.param]
  monkeypatch.setattr(_device, 'on_gpu', lambda: gpu)
  monkeypatch.setattr(_device, 'compute_capability', lambda: capability)
  monkeypatch.setattr(_device, 'single_device', lambda: count == 1)
  return request.param


def _compiles(op, devices):
  """Where each kernel compiles: Triton on 9.0 and newer, Mosaic GPU (wgmma)
  on Hopper only."""
  capability = DEVICES[devices][1]
  if dispatch.OPS[op].pallas is dispatch.MOSAIC_GPU:
    return capability is not None and capability[0] == 9
  return capability is not None and capability >= (9, 0)


def test_the_registry_keeps_the_measured_defaults():
  """The defaults as measured (benchmarks/RESULTS.md): the Pallas kernel
  for every op but the per-tensor FP8 GEMM and the dequantizer."""
  assert {op for op in OPS if dispatch.OPS[op].default == 'xla'} == {
      'dequantize_per_group', 'fp8_matmul'}
  assert all(dispatch.OPS[op].default in dispatch.IMPLEMENTATIONS
             for op in OPS)
  mosaic = {op for op in OPS if dispatch.OPS[op].pallas is dispatch.MOSAIC_GPU}
  assert mosaic == {'fp8_matmul', 'fp8_matmul_block_scaled'}


@pytest.mark.parametrize('op', OPS)
def test_none_is_the_default_where_its_kernel_compiles_on_one_device(
    op, devices):
  want = ('pallas', False) if (
      dispatch.OPS[op].default == 'pallas' and _compiles(op, devices)
      and DEVICES[devices][2] == 1) else XLA
  assert dispatch.resolve_implementation(op, None) == want


@pytest.mark.parametrize('op', OPS)
def test_named_implementations(op, devices):
  assert dispatch.resolve_implementation(op, 'xla') == XLA
  on_gpu = DEVICES[devices][0]
  interpretable = dispatch.OPS[op].pallas.interpretable
  if _compiles(op, devices):
    assert dispatch.resolve_implementation(op, 'pallas') == ('pallas', False)
  elif interpretable and not on_gpu:
    assert dispatch.resolve_implementation(op, 'pallas') == ('pallas', True)
  else:
    with pytest.raises(ValueError, match=f"'pallas' for {op} needs"):
      dispatch.resolve_implementation(op, 'pallas')


@pytest.mark.parametrize('op', OPS)
def test_scoped_choice(op, devices):
  """use_implementation changes what None means, where the kernel can run;
  named implementations keep theirs."""
  default = dispatch.resolve_implementation(op, None)
  interpretable = dispatch.OPS[op].pallas.interpretable
  with pallas_kernels.use_implementation('pallas', interpret=True):
    got = dispatch.resolve_implementation(op, None)
    assert got == (('pallas', True) if interpretable else default)
    assert dispatch.resolve_implementation(op, 'xla') == XLA
    with pallas_kernels.use_implementation('xla'):
      assert dispatch.resolve_implementation(op, None) == XLA
      with pallas_kernels.use_implementation(None):
        assert dispatch.resolve_implementation(op, None) == default
    assert dispatch.resolve_implementation(op, None) == got
  with pallas_kernels.use_implementation('pallas'):
    compiled = _compiles(op, devices)
    want = ('pallas', False) if compiled else (
        ('pallas', True) if interpretable and not DEVICES[devices][0]
        else default)
    assert dispatch.resolve_implementation(op, None) == want
  assert dispatch.resolve_implementation(op, None) == default


def test_scope_is_restored_on_error_and_local_to_its_thread():
  seen = []
  with pytest.raises(KeyError):
    with pallas_kernels.use_implementation('pallas', interpret=True):
      thread = threading.Thread(target=lambda: seen.append(
          dispatch.resolve_implementation('swiglu_fp8', None)))
      thread.start()
      thread.join()
      raise KeyError('inside')
  assert seen == [dispatch.resolve_implementation('swiglu_fp8', None)]
  assert seen != [('pallas', True)]


def test_errors_name_the_argument():
  with pytest.raises(ValueError, match="implementation='triton' must be"):
    dispatch.resolve_implementation('swiglu_fp8', 'triton')
  with pytest.raises(ValueError, match="op='swiglu'.*swiglu_fp8"):
    dispatch.resolve_implementation('swiglu', None)
  with pytest.raises(ValueError, match='implementation'):
    with pallas_kernels.use_implementation('cuda'):
      pass
  with pytest.raises(ValueError, match='interpret=True is for'):
    with pallas_kernels.use_implementation('xla', interpret=True):
      pass


def test_pick_pallas_fixture_interprets_the_kernels(pick_pallas):
  assert dispatch.resolve_implementation('rms_norm_fp8', None) != (
      'pallas', True)
  pick_pallas()
  assert dispatch.resolve_implementation('rms_norm_fp8', None) == (
      'pallas', True)


# One call of each op's public function, implementation=None.

def _moments(shape, seed):
  rng = np.random.default_rng(seed)
  quantize = lambda x: Moment(*group_reference.quantize_per_group(
      jnp.asarray(x, jnp.float32), 128, 'e4m3', True))
  return (quantize(rng.standard_normal(shape)),
          quantize(rng.uniform(0.1, 1.0, shape)))


def _x(shape, seed=0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape),
                     jnp.float32)


def _e4m3(shape, seed=0):
  return _x(shape, seed).astype(jnp.float8_e4m3fn)


CALLS = {
    'quantize_per_group': lambda: quantize_per_group(_x((4, 64)), 16),
    'dequantize_per_group': lambda: dequantize_per_group(
        *group_reference.quantize_per_group(_x((4, 64)), 16, 'e4m3', True),
        16),
    'quantize_per_tensor': lambda: quantize_per_tensor(_x((4, 64))),
    'coat_adam_step': lambda: coat_adam_step(
        _x((4, 128)), _x((4, 128), 1), *_moments((4, 128), 2), jnp.int32(1),
        learning_rate=1e-3),
    'coat_adam_update': lambda: coat_adam_update(
        _x((4, 128), 1), *_moments((4, 128), 2), jnp.int32(1)),
    'quantize_blockwise': lambda: quantize_blockwise(_x((4, 256))),
    'rms_norm_fp8': lambda: rms_norm_fp8_fwd(_x((4, 64)), _x((64,), 1)),
    'swiglu_fp8': lambda: swiglu_fp8_fwd(_x((4, 64)), _x((4, 64), 1)),
    'fp8_matmul': lambda: fp8_matmul(_e4m3((16, 32)), _e4m3((16, 32), 1),
                                     1.0, 1.0),
    'fp8_matmul_block_scaled': lambda: fp8_matmul(
        _e4m3((16, 128)), _e4m3((16, 128), 1), jnp.ones((16, 1)),
        jnp.ones((16, 1))),
}


def test_calls_cover_the_registry():
  assert sorted(CALLS) == OPS


@pytest.mark.parametrize('op', OPS)
@pytest.mark.parametrize('scope', [None, 'xla', 'pallas'])
def test_public_functions_run_what_the_resolver_says(op, scope):
  """On these devices, in each scope: a pallas_call in the traced program
  exactly when the resolver says 'pallas'."""
  interpret = scope == 'pallas' and jax.default_backend() != 'gpu'
  with pallas_kernels.use_implementation(scope, interpret=interpret):
    resolved = dispatch.resolve_implementation(op, None)
    # A new function: jax caches the trace of one it has traced before.
    jaxpr = str(jax.make_jaxpr(lambda: CALLS[op]())())
  assert ('pallas_call' in jaxpr) == (resolved.implementation == 'pallas')
  if scope == 'pallas' and dispatch.OPS[op].pallas.interpretable:
    assert resolved.implementation == 'pallas'
