"""`coat_jax.nn.fsdp.embed_lookup`: the embedding rows of batch-sharded
tokens from a table sharded over 'fsdp' on its H axis (8 fake CPU devices),
against a plain take on one device; forward and the table's gradient."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from benchmarks import fsdp as fsdp_bench
from coat_jax.nn import fsdp
from coat_jax.training import sharding

V, H = 64, 32


def _inputs(batch, seq=5):
  key_t, key_x, key_g = jax.random.split(jax.random.key(0), 3)
  table = jax.random.normal(key_t, (V, H), jnp.float32)
  tokens = jax.random.randint(key_x, (batch, seq), 0, V)
  tokens = tokens.at[0, :3].set(7)  # a token repeated: its grads add
  cotangent = jax.random.normal(key_g, (batch, seq, H), jnp.float32)
  return table, tokens, cotangent


def _lookup(table, tokens, dtype=jnp.float32):
  return fsdp.embed_lookup(table, tokens, dtype)


def _value_and_table_grad(lookup, table, tokens, cotangent):
  rows, vjp = jax.vjp(lambda t: lookup(t, tokens), table)
  return rows, vjp(cotangent)[0]


@pytest.mark.parametrize('data,dtype', [(1, jnp.float32), (2, jnp.float32),
                                        (4, jnp.float32), (2, jnp.bfloat16)])
def test_lookup_on_shards_is_a_take(data, dtype):
  table, tokens, cotangent = _inputs(batch=16)
  cotangent = cotangent.astype(dtype)
  want = _value_and_table_grad(
      lambda t, x: jnp.take(t, x, axis=0).astype(dtype), table, tokens,
      cotangent)
  mesh = sharding.make_mesh((data, 8 // data, 1))
  with jax.set_mesh(mesh):
    table_s = jax.device_put(table, NamedSharding(mesh, P(None, 'fsdp')))
    tokens_s, cotangent_s = (
        jax.device_put(a, NamedSharding(mesh, P(fsdp.BATCH_AXES)))
        for a in (tokens, cotangent))
    fn = jax.jit(lambda *a: _value_and_table_grad(
        lambda t, x: _lookup(t, x, dtype), *a))
    got = fn(table_s, tokens_s, cotangent_s)
    hlo = fn.lower(table_s, tokens_s, cotangent_s).compile().as_text()
  np.testing.assert_array_equal(got[0], want[0])
  # A repeated token's rows are added in another order across devices.
  np.testing.assert_allclose(got[1], want[1], rtol=1e-6, atol=1e-6)
  assert got[0].dtype == dtype and got[0].sharding.is_equivalent_to(
      NamedSharding(mesh, P(fsdp.BATCH_AXES)), 3)
  # Moved: the FSDP group's tokens, one device's rows each way and, with
  # data > 1, the sum of the table slices' gradients; never the whole
  # batch's rows (B, S, H) or a gathered table.
  slice_grad = (V, H // (8 // data))
  for c in fsdp_bench.collectives(hlo):
    for dtype, shape in c['arrays']:
      assert (dtype == 's32' or np.prod(shape) <= 16 * 5 * H // 8
              or (c['kind'] == 'all-reduce' and shape == slice_grad)), c


def test_lookup_falls_back_where_it_does_not_apply():
  table, tokens, _ = _inputs(batch=6)  # 6 rows over 8 devices
  assert _lookup(table, tokens) is None  # no mesh
  with jax.set_mesh(sharding.make_mesh((1, 8, 1))):
    assert _lookup(table, tokens) is None
    assert _lookup(table[:, :4], tokens[:8].repeat(2, 0)) is None  # H 4
  with jax.set_mesh(sharding.make_mesh((1, 4, 2))):  # tensor parallel
    assert _lookup(table, tokens[:4]) is None
  with jax.set_mesh(sharding.make_mesh((8, 1, 1))):  # data parallel
    assert _lookup(table, tokens[:8].repeat(2, 0)) is None
