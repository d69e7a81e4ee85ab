"""benchmarks/hf_load.py: writes, loads onto a mesh and checks the sums."""

from benchmarks import hf_load


def test_tiny_checkpoint_round_trip(tmp_path):
  path = str(tmp_path / 'hf')
  written = hf_load.write('tiny', path, shard_gb=2e-5)
  assert written['checkpoint_bytes'] > 0
  loaded = hf_load.load(path, str(tmp_path / 'saved'))
  assert loaded['sums_match'] and loaded['devices'] == 8
  assert loaded['largest_param_shard_bytes'] > 0
