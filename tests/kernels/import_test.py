"""Importing coat_jax or pallas_kernels changes no global state: neither
`warnings.filters` nor jaxlib's functions (each run in a fresh process)."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Every module of both packages, so that none patches anything at import.
_IMPORT_ALL = '''
import importlib, pkgutil
import coat_jax, pallas_kernels
for info in pkgutil.walk_packages(pallas_kernels.__path__, 'pallas_kernels.'):
  importlib.import_module(info.name)
'''

# Prints the modules that importing the packages loads from elsewhere.
_DEPENDENCIES = _IMPORT_ALL + '''
import sys
print('\\n'.join(m for m in sorted(sys.modules)
                 if m.split('.')[0] not in ('coat_jax', 'pallas_kernels')))
'''

# Loads those first (their own filters are theirs), then the packages. Where
# jaxlib has no Mosaic GPU extension (CPU jaxlibs) a stand-in takes its
# place, so that a patch at import would show here too.
_CHECK = '''
import importlib, sys, types, warnings
try:
  from jax._src.lib import mosaic_gpu
  ext = mosaic_gpu._mosaic_gpu_ext
except ImportError:
  ext = types.SimpleNamespace(_get_ptxas_isa_version=lambda: 0,
                              __file__='/no/such/dir/_mosaic_gpu_ext.so')
  stand_in = types.ModuleType('jax._src.lib.mosaic_gpu')
  stand_in._mosaic_gpu_ext = ext
  sys.modules['jax._src.lib.mosaic_gpu'] = stand_in
ask = ext._get_ptxas_isa_version
for name in sys.stdin.read().split():
  try:
    importlib.import_module(name)
  except Exception:  # modules that only import as a side effect of others
    pass
filters = list(warnings.filters)
''' + _IMPORT_ALL + '''
added = [f for f in warnings.filters if f not in filters]
assert warnings.filters == filters, added
assert ext._get_ptxas_isa_version is ask, ext._get_ptxas_isa_version
print('unchanged')
'''


def _run(code: str, stdin: str = '') -> str:
  done = subprocess.run(
      [sys.executable, '-c', code], input=stdin, capture_output=True,
      text=True, check=False, cwd=ROOT,
      env={**os.environ, 'PYTHONPATH': str(ROOT)})
  assert done.returncode == 0, done.stderr[-4000:]
  return done.stdout


def test_importing_the_packages_changes_no_global_state():
  dependencies = _run(_DEPENDENCIES)
  assert 'jax' in dependencies.split()
  assert _run(_CHECK, dependencies).strip() == 'unchanged'
