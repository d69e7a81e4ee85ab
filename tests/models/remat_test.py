"""Remat policies: what each keeps, same numbers, scanned <= unrolled."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coat_jax import recipes
import coat_jax.models as cm
from coat_jax.models import remat
from coat_jax.models.decoder import DecoderLayer
from coat_jax.models.decoder import rope_tables
import coat_jax.nn as cnn
from coat_jax.nn import residuals
from tests import compiled_step

MODES = ('bf16', 'fp8_linear', 'coat')
FP8 = (jnp.float8_e4m3fn,)


def _layer_residuals(cfg, recipe, policy, batch=2, seq=32):
  """The activation residuals (those growing with the batch) of one decoder
  layer under `policy`."""
  layer = DecoderLayer(cfg, recipe=recipes.get(recipe),
                       dtype=jnp.bfloat16, param_dtype=jnp.float32,
                       implementation=None, rngs=nnx.Rngs(0))
  graph, state = nnx.split(layer)
  cos, sin = rope_tables(seq, cfg.head_features, cfg.rope_theta)
  body = remat.apply(lambda lay, x: lay(x, (cos, sin)), policy,
                     in_scan=False)
  fn = lambda s, x: body(nnx.merge(graph, s), x)
  x = lambda b: jax.ShapeDtypeStruct((b, seq, cfg.hidden_size), jnp.bfloat16)
  return cnn.activation_residuals(fn, (state, x(batch)), (state, x(2 * batch)))


@pytest.mark.skipif(jax.default_backend() == 'gpu',
                    reason="counts XLA attention's residuals (cuDNN's differ)")
@pytest.mark.parametrize('recipe', MODES)
def test_policies_keep_what_they_promise(recipe):
  cfg = cm.LlamaConfig.preset('tiny')
  b, s = 2, 32
  h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_features
  qkv = b * s * (cfg.num_heads + 2 * cfg.num_kv_heads) * d * 2  # bf16 bytes
  saved = {p: _layer_residuals(cfg, recipe, p, b, s)
           for p in ('none', 'minimal', 'full')}
  nbytes = {p: residuals.nbytes(r) for p, r in saved.items()}
  print(recipe, nbytes)
  assert saved['full'] == []  # only the layer's input (an argument)
  assert 0 < nbytes['minimal'] < nbytes['none']
  minimal = saved['minimal']
  wide = [r for r in minimal if r.dtype not in FP8]
  if recipe == 'bf16':
    # q, k, v, attention output, o_proj output, gate and up: all bf16.
    assert all(r.dtype == jnp.bfloat16 for r in minimal)
    assert nbytes['minimal'] == qkv + b * s * (2 * h + 2 * i) * 2
  else:
    # The FP8 residuals of the custom_vjps (and their scales), plus bf16
    # q, k, v: attention's backward needs them (flash attention keeps them).
    fp8 = residuals.nbytes([r for r in minimal if r.dtype in FP8])
    bf16 = residuals.nbytes([r for r in wide if r.dtype == jnp.bfloat16
                             and r.size >= b * s * d])
    f32 = [r for r in wide if r.dtype == jnp.float32]
    assert all(r.size <= b * s for r in f32), f32  # rstd, scales
    if recipe == 'fp8_linear':
      # E4M3 inputs of the qkv, o, gate/up and down GEMMs; bf16 q, k, v,
      # o_proj's output (the residual stream) and gate, up (for SwiGLU).
      assert fp8 == b * s * (3 * h + i)
      assert bf16 == qkv + b * s * (h + 2 * i) * 2
    else:
      # No bf16 GEMM output but q, k, v: the norms' inputs, gate and up
      # are kept as FP8 1x16 groups, the GEMM inputs as FP8.
      assert fp8 == b * s * (5 * h + 3 * i)
      assert bf16 == qkv


def _grads(cfg, recipe, tokens):
  model = cm.Llama(cfg, recipe=recipe, rngs=nnx.Rngs(0))
  graph, state = nnx.split(model)
  targets = jnp.roll(tokens, -1, axis=1)
  loss_fn = lambda s: cm.lm_loss(nnx.merge(graph, s), tokens, targets)
  loss, grads = jax.jit(jax.value_and_grad(loss_fn))(state)
  return float(loss), np.concatenate(
      [np.asarray(g, np.float32).ravel() for g in jax.tree.leaves(grads)])


@pytest.mark.parametrize('recipe', ('coat',))
def test_policies_give_the_same_gradients(recipe, seed):
  """Remat recomputes the same numbers (scanned and unrolled layers)."""
  tokens = jax.random.randint(jax.random.key(seed), (2, 32), 0, 256)
  base = cm.LlamaConfig.preset('tiny', remat='none')
  loss0, g0 = _grads(base, recipe, tokens)
  assert np.isfinite(g0).all() and np.abs(g0).max() > 0
  for policy, scan in (('minimal', False), ('full', True)):
    cfg = cm.LlamaConfig.preset('tiny', remat=policy, scan_layers=scan)
    loss, g = _grads(cfg, recipe, tokens)
    # XLA fuses the recomputed forward (and unrolled layers) differently:
    # bf16 rounding, as between scanned and unrolled layers without remat.
    np.testing.assert_allclose(loss, loss0, rtol=1e-3)
    cos = g @ g0 / np.linalg.norm(g) / np.linalg.norm(g0)
    print(f'{recipe} {policy} scan={scan}: cos {cos:.6f}')
    # As tests/models/decoder_test.py's scanned vs unrolled layers: FP8
    # rounding amplifies bf16's (a dropped term scores < 0.99).
    assert cos > (0.9999 if recipe == 'bf16' else 0.995), (policy, scan)
    np.testing.assert_allclose(np.linalg.norm(g), np.linalg.norm(g0),
                               rtol=1e-2)


@pytest.mark.parametrize('recipe', MODES)
def test_default_policy_scanned_keeps_no_more_than_unrolled(recipe):
  # Compiled as XLA:GPU does, with jax.checkpoint's optimization barriers
  # kept (`compiled_step.gpu_like_options`). Scanned 'auto' is 'full'.
  # Measured on this CPU (MiB, temp of the gradient, 4 layers, width 128,
  # batch 8 x 256), scanned/unrolled: bf16 53.6/54.1 (CPU stacks bf16 as
  # float32), fp8_linear 47.4/58.7, coat 44.9/127.5. Scanned 'minimal'
  # keeps more than unrolled layers: the scan's stacked weight gradients
  # (1b on an H200, compiled: coat 4.65 GiB scanned against 13.63
  # unrolled, 15.50 with 'minimal'). The train step compiled for the GPU:
  # tests/training/memory_test.py (gpu).
  assert cm.LlamaConfig().remat == remat.DEFAULT == 'auto'
  dims = dict(num_layers=4, hidden_size=128, intermediate_size=352)
  temp = {scan: compiled_step.temp_bytes(
      cm.LlamaConfig.preset('tiny', scan_layers=scan, **dims), recipe,
      8, 256, compiled_step.gpu_like_options()) for scan in (True, False)}
  print(f'{recipe}: scanned {temp[True] / 2**20:.1f} MiB, unrolled'
        f' {temp[False] / 2**20:.1f} MiB')
  assert temp[True] <= temp[False]


@pytest.mark.parametrize('policy', ['none', 'minimal', 'full'])
@pytest.mark.parametrize('in_scan', [False, True])
def test_fp8_weight_codes_kept_unrolled_and_recomputed_under_scan(
    policy, in_scan):
  """Unrolled layers keep each weight's FP8 codes for dgrad (else XLA keeps
  the float32 weight slices alive until backward); scan bodies requantize
  them from the weight ('none': kept in both; 'full': in neither)."""
  k = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(k[0], (2, 40, 64), jnp.bfloat16)
  w1 = jax.random.normal(k[1], (64, 32)) * 0.1
  w2 = jax.random.normal(k[2], (64, 48)) * 0.1
  fn = lambda x, w1, w2: sum(
      jnp.sum(y) for y in cnn.fp8_dense(x, [w1, w2]))
  policy_fn = remat.jax_policy(policy, in_scan=in_scan)
  if policy_fn is not None:
    fn = jax.checkpoint(fn, policy=policy_fn)
  saved = [(r.shape, str(r.dtype)) for r in cnn.saved_residuals(fn, x, w1, w2)]
  codes = [((64, 32), 'float8_e4m3fn'), ((64, 48), 'float8_e4m3fn')]
  keeps = policy == 'none' or (policy == 'minimal' and not in_scan)
  assert all((c in saved) == keeps for c in codes), saved
  x_t = ((64, 80), 'float8_e4m3fn')
  assert (x_t in saved) == (policy != 'full'), saved
  grads = jax.grad(fn, argnums=(1, 2))(x, w1, w2)
  want = jax.grad(lambda *a: sum(jnp.sum(y) for y in cnn.fp8_dense(
      a[0], [a[1], a[2]])), argnums=(1, 2))(x, w1, w2)
  for g, g0 in zip(grads, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(g0))


def test_auto_picks_a_policy_per_precision_and_layout():
  """'auto', the default: in 'coat' mode unrolled layers keep the same with
  'minimal' as with 'none' (FP8 residuals only; 1b on an H200: 20.13 vs
  20.15 GiB) and would only recompute; scanned layers take 'full' (with
  'minimal' the scan's stacked weight gradients put the scanned step above
  the unrolled one); the model runs what it resolves to."""
  want = {('bf16', False): 'minimal', ('bf16', True): 'full',
          ('fp8_linear', False): 'minimal', ('fp8_linear', True): 'full',
          ('coat', False): 'none', ('coat', True): 'full'}
  assert set(want) == {(p, s) for p in MODES for s in (False, True)}
  for (recipe, scan), policy in want.items():
    assert remat.resolve('auto', recipe, scan) == policy
    assert remat.resolve('auto', recipes.get(recipe), scan) == policy
    for other in remat.POLICIES:
      assert remat.resolve(other, recipe, scan) == other
    cfg = cm.LlamaConfig.preset('tiny', num_layers=1, scan_layers=scan)
    model = cm.Llama(cfg, recipe=recipe, rngs=nnx.Rngs(0))
    assert model.remat == policy
  with pytest.raises(ValueError, match="resolve"):
    remat.jax_policy('auto')


def test_bad_policy_names():
  with pytest.raises(ValueError, match=r"remat='nope'.*'none', 'minimal'"):
    cm.LlamaConfig.preset('tiny', remat='nope')
  with pytest.raises(ValueError, match='remat policy'):
    remat.jax_policy('Full')


@pytest.mark.skipif(jax.default_backend() == 'gpu', reason='CPU behaviour')
def test_offloading_off_gpu_is_a_clear_error():
  cfg = cm.LlamaConfig.preset('tiny', remat='minimal_offloaded')
  model = cm.Llama(cfg, recipe='coat', rngs=nnx.Rngs(0))
  tokens = jnp.zeros((1, 16), jnp.int32)
  with pytest.raises(ValueError, match="pinned host.*use 'minimal'"):
    cm.lm_loss(model, tokens, tokens)


@pytest.mark.gpu
@pytest.mark.parametrize('recipe', MODES)
def test_offloaded_policy_matches_minimal_on_gpu(recipe):
  tokens = jax.random.randint(jax.random.key(0), (2, 64), 0, 256)
  loss0, g0 = _grads(cm.LlamaConfig.preset('tiny', remat='minimal'),
                     recipe, tokens)
  for scan in (True, False):
    loss, g = _grads(cm.LlamaConfig.preset(
        'tiny', remat='minimal_offloaded', scan_layers=scan), recipe,
        tokens)
    np.testing.assert_allclose(loss, loss0, rtol=1e-4)
    assert g @ g0 / np.linalg.norm(g) / np.linalg.norm(g0) > 0.999
