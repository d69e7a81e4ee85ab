"""benchmarks/checkpoint_memory.py end to end on the CPU, on its smallest
state (the embedding alone)."""

import sys

from benchmarks import checkpoint_memory


def test_saves_restores_and_reports(tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(sys, 'argv', ['checkpoint_memory.py',
                                    str(tmp_path / 'ck'), '--layers', '0'])
  checkpoint_memory.main()
  line = capsys.readouterr().out.strip().splitlines()[-1]
  assert line.startswith('state 0.7 GB (largest leaf 0.7 GB), streams '), line
  assert 'resident memory +' in line and line.endswith('bit-exact'), line
  assert '; restore ' in line, line
  assert (tmp_path / 'ck' / 'checkpoints' / '1').is_dir()


def test_measured_returns_the_result_its_time_and_growth():
  out, seconds, growth = checkpoint_memory._measured(lambda: 'done')
  assert out == 'done' and seconds >= 0
  assert set(growth) == {'VmRSS', 'RssShmem'}


def test_resident_memory_is_read_in_mb():
  mb = checkpoint_memory._resident_mb()
  assert set(mb) == {'VmRSS', 'RssShmem'}
  assert mb['VmRSS'] > 10  # this process holds jax
