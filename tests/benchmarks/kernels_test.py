"""benchmarks/kernels.py: the table's bandwidths, and one tiny run on CPU."""

import jax

from benchmarks import kernels


def test_table_sets_each_op_against_its_copy_and_its_xla_reference():
  copy = dict(name='copy', impl='xla', bytes=8e9, s=2e-3, copy='copy')
  rows = [copy,
          dict(name='op', impl='xla', bytes=4e9, s=4e-3, copy='copy'),
          dict(name='op', impl='pallas', bytes=4e9, s=1e-3, copy='copy')]
  lines = kernels.table(rows).splitlines()
  assert lines[2] == '| copy | xla | 2000.0 | 4000 | 100% | 1.00x |'
  assert lines[3] == '| op | xla | 4000.0 | 1000 | 25% | 1.00x |'
  assert lines[4] == '| op | pallas | 1000.0 | 4000 | 100% | 4.00x |'


def test_fused_kernels_run_both_implementations(monkeypatch):
  """Every op of --fused through both implementations, at a tiny size
  (the Pallas kernels interpreted on CPU), with a copy of its width."""
  monkeypatch.setattr(kernels, 'TOKENS', 32)
  monkeypatch.setattr(kernels, 'FUSED_SHAPES', ((128, 256),))

  def run_once(fn, args, **_):
    jax.block_until_ready(fn(*args))
    return 1e-3

  monkeypatch.setattr(kernels, 'time_call', run_once)
  rows = kernels.bench_fused()
  assert [(r['name'], r['impl']) for r in rows] == [
      ('copy x*2 bfloat16 (32, 128)', 'xla'),
      ('rms_norm_fp8 fwd (32, 128)', 'xla'),
      ('rms_norm_fp8 fwd (32, 128)', 'pallas'),
      ('rms_norm_fp8 bwd (32, 128)', 'xla'),
      ('rms_norm_fp8 bwd (32, 128)', 'pallas'),
      ('copy x*2 bfloat16 (32, 256)', 'xla'),
      ('swiglu_fp8 fwd (32, 256)', 'xla'),
      ('swiglu_fp8 fwd (32, 256)', 'pallas'),
      ('swiglu_fp8 bwd (32, 256)', 'xla'),
      ('swiglu_fp8 bwd (32, 256)', 'pallas')]
  assert rows[1]['bytes'] == 32 * 128 * 5.125
  assert kernels.table(rows).count('| pallas |') == 4
