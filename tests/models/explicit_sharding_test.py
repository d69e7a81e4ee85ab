"""The tiny Llama under Explicit mesh axes gives the single-device numbers.

Params are sharded at creation by their logical axes (`LOGICAL_AXIS_RULES`
on a (data, fsdp, tensor) mesh), the tokens over ('data', 'fsdp'); each
layer gathers its weights (`coat_jax.nn.fsdp.gather_weight`), so every
token's activations are computed as on one device and only sums over tokens
(weight gradients, the loss) are split across devices.

Both programs are compiled without XLA's excess precision: with it, XLA:CPU
may skip a BF16 rounding inside a fusion, and which fusions form depends on
the partitioning (the sharded and single-device programs then differ in the
last BF16 bit here and there, which FP8 rounding magnifies). Without it the
loss comes out bit for bit, float32 gradients to float32 reordering, and
gradients that are BF16 values (BF16 matmuls and reductions: all of 'bf16'
mode, norm gains, the LM head over several chunks) to the rounding of each
device's partial sum to BF16.
"""

import functools

from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import coat_jax

_EXACT = {'xla_allow_excess_precision': False}
# Norm-wise relative error of gradients: float32 values (sums reordered) and
# BF16 values (each device's partial sum rounded to BF16; measured <= 1.4%).
_F32_TOL = 1e-5
_BF16_TOL = 3e-2


def _value_and_grad(model, tokens, chunk_size):
  graphdef, state = nnx.split(model)

  @functools.partial(jax.jit, compiler_options=_EXACT)
  def run(state, tokens):
    def loss(state):
      return coat_jax.models.lm_loss(nnx.merge(graphdef, state),
                                     tokens[:, :-1], tokens[:, 1:],
                                     chunk_size=chunk_size)
    return jax.value_and_grad(loss)(state)

  loss, grads = run(state, tokens)
  return loss, nnx.to_pure_dict(grads)


def _explicit_mesh(shape):
  return jax.make_mesh(shape, ('data', 'fsdp', 'tensor'),
                       axis_types=(jax.sharding.AxisType.Explicit,) * 3)


# The loss' chunks come after the layer stack: chunking is tested with the
# scanned layers only (unrolled, it would run the same chunk loop again).
@pytest.mark.parametrize('mesh_shape, chunk_size, scan_layers', [
    ((1, 2, 4), 1024, True),  # one chunk of the loss
    ((1, 2, 4), 1024, False),
    ((2, 1, 4), 24, True),  # 128 tokens padded to 6 chunks of 24
])
@pytest.mark.parametrize('recipe', ['bf16', 'fp8_linear', 'coat'])
def test_lm_loss_grads_under_explicit_axes_match_one_device(
    recipe, scan_layers, mesh_shape, chunk_size):
  cfg = coat_jax.models.LlamaConfig.preset('tiny', scan_layers=scan_layers)
  tokens = jax.random.randint(jax.random.key(0), (4, 33), 0, cfg.vocab_size)
  ref_loss, ref_grads = _value_and_grad(
      coat_jax.models.Llama(cfg, recipe=recipe, rngs=nnx.Rngs(0)),
      tokens, chunk_size)

  mesh = _explicit_mesh(mesh_shape)
  with (jax.set_mesh(mesh),
        nnx.logical_axis_rules(coat_jax.nn.LOGICAL_AXIS_RULES),
        nnx.use_eager_sharding(True)):
    model = coat_jax.models.Llama(cfg, recipe=recipe,
                                  rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    kernel = params['layers']['mlp']['gate_proj']['kernel']  # (L, 64, 176)
    assert tuple(jax.typeof(kernel).sharding.spec)[1:] == ('fsdp', 'tensor') \
        or mesh.shape['fsdp'] == 1
    assert tuple(jax.typeof(kernel).sharding.spec)[-1] == 'tensor'
    sharded_tokens = jax.sharding.reshard(tokens, P(('data', 'fsdp'), None))
    loss, grads = _value_and_grad(model, sharded_tokens, chunk_size)

  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
  flat = jax.tree_util.tree_leaves_with_path(grads)
  flat_ref = jax.tree_util.tree_leaves(ref_grads)
  flat_params = jax.tree_util.tree_leaves(params)
  assert len(flat) == len(flat_ref) == len(flat_params)
  for (path, g), ref, p in zip(flat, flat_ref, flat_params, strict=True):
    name = jax.tree_util.keystr(path)
    # Each gradient comes sharded like its param (reduce-scattered).
    assert jax.typeof(g).sharding.spec == jax.typeof(p).sharding.spec, name
    g, ref = np.asarray(g), np.asarray(ref)
    bf16_valued = np.array_equal(
        ref, ref.astype(jnp.bfloat16).astype(np.float32))
    err = np.linalg.norm(g - ref) / np.linalg.norm(ref)
    assert err <= (_BF16_TOL if bf16_valued else _F32_TOL), (
        name, bf16_valued, err)
