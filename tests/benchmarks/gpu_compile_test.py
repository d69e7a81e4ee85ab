"""benchmarks/gpu_compile.py: a train step compiled for an H100 on a host
without one (needs jaxlib's CUDA plugin; without it, a clear error)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def test_compiles_for_an_h100_or_says_what_it_needs():
  # A child process: use_target repoints jax.default_backend and jax.devices.
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS='cpu')
  run = subprocess.run(
      [sys.executable, os.path.join(ROOT, 'benchmarks', 'gpu_compile.py'),
       '--preset', 'tiny', '--batch', '2', '--seq', '64', '--variants',
       'unrolled=coat:model.scan_layers=false,model.remat=minimal'],
      capture_output=True, text=True, env=env, timeout=600, check=False)
  try:
    import jax_plugins.xla_cuda13  # noqa: F401, PLC0415
  except ImportError:
    assert run.returncode != 0
    assert "pip install 'jax[cuda13]'" in run.stderr, run.stderr[-2000:]
    return
  assert run.returncode == 0, run.stderr[-2000:]
  assert 'NVIDIA H100 80GB HBM3' in run.stdout
  row = next(l for l in run.stdout.splitlines() if l.startswith('| unrolled'))
  temp = float(row.split('|')[2])
  assert 0 < temp < 1, row  # GiB: a tiny model's step
