"""A damaged checkpoint raises one line naming the file, not a traceback."""

import glob
import os

import numpy as np
import pytest

from coat_jax import checkpoint


def _saved(tmp_path):
  tree = {'w': np.arange(4096, dtype=np.float32).reshape(64, 64),
          'b': np.ones(5, np.float32)}
  directory = tmp_path / 'ckpt'
  checkpoint.save(directory, tree)
  return str(directory), tree


def test_a_truncated_data_file_names_the_array_and_the_directory(tmp_path):
  directory, tree = _saved(tmp_path)
  data = max(glob.glob(os.path.join(directory, 'ocdbt.process_0', 'd', '*')),
             key=os.path.getsize)
  os.truncate(data, os.path.getsize(data) // 2)
  with pytest.raises(checkpoint.DamagedCheckpointError) as e:
    checkpoint.restore(directory, tree)
  assert e.value.path == directory and e.value.step is None
  assert e.value.why.startswith('ValueError: OUT_OF_RANGE: Error reading "w/')
  assert str(e.value) == (f'the checkpoint is damaged: {directory}:'
                          f' {e.value.why}')
  assert '\n' not in str(e.value)


def test_an_overwritten_metadata_file_is_named(tmp_path):
  directory, tree = _saved(tmp_path)
  metadata = os.path.join(directory, '_METADATA')
  with open(metadata, 'w') as f:
    f.write('{"tree_metadata": ')
  with pytest.raises(checkpoint.DamagedCheckpointError,
                     match='JSONDecodeError: Expecting value') as e:
    checkpoint.restore(directory, tree)
  assert e.value.path == metadata


def test_a_file_tensorstore_names_is_the_one_reported(tmp_path):
  directory, tree = _saved(tmp_path)
  manifest = os.path.join(directory, 'manifest.ocdbt')
  with open(manifest, 'wb') as f:
    f.write(b'garbage')
  with pytest.raises(checkpoint.DamagedCheckpointError,
                     match='Error decoding manifest') as e:
    checkpoint.restore(directory, tree)
  assert e.value.path == manifest


def test_running_out_of_memory_is_no_damage():
  with pytest.raises(MemoryError):
    with checkpoint.reading('/some/checkpoint'):
      raise MemoryError
  with pytest.raises(ValueError, match='^RESOURCE_EXHAUSTED'):
    with checkpoint.reading('/some/checkpoint'):
      raise ValueError('RESOURCE_EXHAUSTED: Out of memory allocating 8 GiB')
