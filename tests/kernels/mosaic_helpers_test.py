"""Tests of pallas_kernels/_mosaic.py, the Mosaic GPU kernels' helpers."""

import types

import pytest

from pallas_kernels import _mosaic


def test_ptxas_is_asked_once():
  calls = []

  def ask():
    calls.append(1)
    return 90

  ext = types.SimpleNamespace(_get_ptxas_isa_version=ask)
  assert _mosaic.ask_ptxas_once(ext)
  assert [ext._get_ptxas_isa_version() for _ in range(5)] == [90] * 5
  assert len(calls) == 1
  cached = ext._get_ptxas_isa_version
  assert _mosaic.ask_ptxas_once(ext)  # a second call wraps nothing again
  assert ext._get_ptxas_isa_version is cached


def test_ptxas_ask_missing_is_a_no_op():
  """Another jaxlib without the function (or without Mosaic GPU): nothing
  changes."""
  ext = types.SimpleNamespace()
  assert not _mosaic.ask_ptxas_once(ext)
  assert not _mosaic.ask_ptxas_once(None)
  assert not hasattr(ext, '_get_ptxas_isa_version')


def test_jaxlibs_mosaic_extension_asks_once_after_import():
  if _mosaic._mgpu_lib is None:  # pylint: disable=protected-access
    pytest.skip('this jaxlib has no Mosaic GPU extension')
  ext = _mosaic._mgpu_lib._mosaic_gpu_ext  # pylint: disable=protected-access
  assert hasattr(ext._get_ptxas_isa_version, 'cache_info')
