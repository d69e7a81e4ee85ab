"""Tests of coat_jax.quant.quantize_blockwise: QuantizedArrays that
dequantize, shard and checkpoint like the per-tensor and per-group ones."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coat_jax import checkpoint
from coat_jax import quant

P = jax.sharding.PartitionSpec


def f32(x):
  return np.asarray(jnp.asarray(x).astype(jnp.float32))


def test_tiles_are_per_group_arrays_and_dequantize():
  x = jax.random.normal(jax.random.key(0), (2, 24, 300)) * 5.0
  q = quant.quantize_blockwise(x, (1, 128), 'e4m3')
  want = quant.quantize_per_group(x, 128, 'e4m3')
  assert q == jax.tree.map(lambda a: a, q)  # a pytree
  assert (q.group_size, q.block) == (128, None)
  assert jax.tree.structure(q) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(want)):
    np.testing.assert_array_equal(f32(a), f32(b))
  deq = f32(quant.dequantize(q))
  assert np.abs(deq - np.asarray(x)).max() <= 2**-4 * np.abs(x).max()


@pytest.mark.parametrize('implementation', ['xla', 'pallas'])
def test_transpose_pair(implementation):
  x = jax.random.normal(jax.random.key(1), (3, 48, 256)).astype(jnp.bfloat16)
  q, q_t = quant.quantize_blockwise(x, (1, 128), 'e5m2', transpose=True,
                                    implementation=implementation)
  assert q.shape == (3, 48, 256) and q.scale.shape == (3, 48, 2)
  assert q_t.shape == (256, 144) and q_t.scale.shape == (256, 2)
  assert q_t.dtype == jnp.float8_e5m2
  np.testing.assert_array_equal(
      f32(quant.dequantize(q_t)),
      f32(quant.dequantize(quant.quantize_blockwise(
          x.reshape(144, 256).T, (1, 128), 'e5m2'))))


@pytest.mark.parametrize('pow2', [False, True])
def test_blocks_dequantize(pow2):
  w = jax.random.normal(jax.random.key(2), (200, 272)) * 0.02
  w = w.at[130:, 200:].multiply(100.0)
  q = quant.quantize_blockwise(w, (128, 128), pow2_scales=pow2)
  assert (q.block, q.group_size) == ((128, 128), None)
  assert q.scale.shape == (2, 3) and q.values.shape == (200, 272)
  deq = f32(quant.dequantize(q, jnp.float32))
  s = np.repeat(np.repeat(f32(q.scale), 128, 0), 128, 1)[:200, :272]
  np.testing.assert_array_equal(deq, f32(q.values) * s)
  err = np.abs(deq - np.asarray(w)) / s
  assert err.max() <= 16  # half an E4M3 step at the top binade (32 / 2)
  assert quant.dequantize(q, jnp.bfloat16).dtype == jnp.bfloat16


def test_old_trees_keep_their_structure():
  """The new `block` field defaults to None: per-tensor and per-group trees
  (optimizer states, checkpoints) flatten exactly as before."""
  q = quant.quantize_per_group(jnp.ones((4, 16)), 16)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(q)
  assert [jax.tree_util.keystr(p) for p, _ in leaves] == ['.values', '.scale']
  assert q.block is None
  again = jax.tree.unflatten(treedef, [v for _, v in leaves])
  assert (again.group_size, again.block, again.exponent) == (16, None, None)
  assert again.values is q.values and again.scale is q.scale


@pytest.mark.parametrize('block,spec', [((1, 128), ('x', None)),
                                        ((128, 128), ('x', None))])
def test_sharding_is_kept(block, spec):
  mesh = jax.make_mesh((8,), ('x',),
                       axis_types=(jax.sharding.AxisType.Explicit,))
  x = jax.random.normal(jax.random.key(3), (1024, 256))
  xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, P(*spec)))
  f = jax.jit(lambda v: quant.quantize_blockwise(v, block))
  with jax.set_mesh(mesh):
    q = f(xs)
    deq = jax.jit(quant.dequantize)(q)
  assert q.values.sharding.spec == P(*spec)
  assert q.scale.sharding.spec == P(*spec)
  ref = f(x)
  for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(ref)):
    np.testing.assert_array_equal(f32(a), f32(b))
  np.testing.assert_array_equal(f32(deq), f32(quant.dequantize(ref)))


def test_checkpoint_round_trip(tmp_path):
  x = jax.random.normal(jax.random.key(4), (256, 384))
  tree = {'tiles': quant.quantize_blockwise(x, (1, 128), 'e5m2'),
          'blocks': quant.quantize_blockwise(x, (128, 128), pow2_scales=True)}
  checkpoint.save(tmp_path / 'ckpt', tree)
  restored = checkpoint.restore(tmp_path / 'ckpt', tree)
  assert jax.tree.structure(restored) == jax.tree.structure(tree)
  assert restored['blocks'].block == (128, 128)
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(tree)):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8),
                                  np.asarray(b).view(np.uint8))


def test_bad_arguments():
  with pytest.raises(ValueError, match=r'block=\(2, 128\)'):
    quant.quantize_blockwise(jnp.ones((4, 128)), (2, 128))
  with pytest.raises(ValueError, match='2-D'):
    quant.quantize_blockwise(jnp.ones(128), (128, 128))
  with pytest.raises(TypeError, match='floating'):
    quant.quantize_blockwise(jnp.arange(128))
