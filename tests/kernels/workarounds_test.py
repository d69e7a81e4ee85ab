"""pallas_kernels.workarounds: each patch holds for its scope only."""

import types

import pallas_kernels
from pallas_kernels import workarounds


def _extension():
  calls = []

  def ask():
    calls.append(1)
    return 90

  return types.SimpleNamespace(_get_ptxas_isa_version=ask), ask, calls


def test_ptxas_is_asked_once_within_the_scope_only():
  ext, ask, calls = _extension()
  with pallas_kernels.ask_ptxas_once(ext) as cached:
    assert cached
    assert [ext._get_ptxas_isa_version() for _ in range(5)] == [90] * 5
    assert len(calls) == 1
  assert ext._get_ptxas_isa_version is ask  # restored
  assert ext._get_ptxas_isa_version() == 90 and len(calls) == 2


def test_ptxas_scopes_nest_and_restore_on_error():
  ext, ask, calls = _extension()
  try:
    with workarounds.ask_ptxas_once(ext):
      outer = ext._get_ptxas_isa_version
      with workarounds.ask_ptxas_once(ext) as cached:
        assert cached and ext._get_ptxas_isa_version is outer
      assert ext._get_ptxas_isa_version is outer  # the inner one kept it
      ext._get_ptxas_isa_version()
      ext._get_ptxas_isa_version()
      raise KeyError('inside')
  except KeyError:
    pass
  assert ext._get_ptxas_isa_version is ask and len(calls) == 1


def test_ptxas_without_the_function_patches_nothing():
  """Another jaxlib without the function: nothing changes."""
  ext = types.SimpleNamespace()
  with workarounds.ask_ptxas_once(ext) as cached:
    assert not cached
    assert not hasattr(ext, '_get_ptxas_isa_version')
  assert not hasattr(ext, '_get_ptxas_isa_version')


def test_ptxas_default_is_jaxlibs_extension():
  """With no argument it patches jaxlib's Mosaic GPU extension (where this
  jaxlib has one) and restores it."""
  ext = workarounds._mosaic_gpu_extension()  # pylint: disable=protected-access
  ask = getattr(ext, '_get_ptxas_isa_version', None)
  with workarounds.ask_ptxas_once() as cached:
    assert cached == (ask is not None)
    if ask is not None:
      assert hasattr(ext._get_ptxas_isa_version, 'cache_info')
  if ask is not None:
    assert ext._get_ptxas_isa_version is ask
