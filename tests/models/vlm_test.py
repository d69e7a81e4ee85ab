"""The vision-language model: the decoder's prefix, the presets, what each
recipe converts, the loss's mask, gradients of coat against bf16, training
on the shapes data, greedy decoding and answer accuracy."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import coat_jax
from coat_jax import recipes
import coat_jax.models as cm
from coat_jax.models import hf
from coat_jax.models import vit
from coat_jax.models import vlm
from coat_jax.nn import CoatLayerNorm
from coat_jax.nn import CoatLinear
from coat_jax.training import shapes

SEED = 7301
CONFIG = vlm.VLMConfig.preset('vlm_tiny')
DATA = shapes.ShapesDataset(image_size=CONFIG.vision.image_size)


def _batch(index, batch_size=16, split='train'):
  return jax.tree.map(jnp.asarray,
                      DATA.batch(split, SEED, index, batch_size))


def _loss_fn(graphdef):
  return jax.jit(lambda state, b: vlm.vlm_loss(
      nnx.merge(graphdef, state), b.images, b.tokens, b.targets,
      b.loss_mask))


# --- The decoder's prefix ---------------------------------------------------


@pytest.mark.parametrize('recipe,scan', [('bf16', False), ('coat', False),
                                         ('coat', True)])
def test_prefix_of_token_embeddings_equals_the_tokens(recipe, scan):
  """hidden_states(tokens[:, P:], prefix=the embeddings of tokens[:, :P])
  is hidden_states(tokens), bit for bit: the prefix takes the first P
  positions (RoPE, the causal mask, the FP8 scales' whole tensors)."""
  config = cm.LlamaConfig.preset('tiny', scan_layers=scan)
  model = cm.Llama(config, recipe=recipe, rngs=nnx.Rngs(SEED))
  tokens = jax.random.randint(jax.random.key(SEED), (2, 24), 0, 256)
  p = 9
  prefix = jnp.take(model.embed[...], tokens[:, :p], axis=0)
  graphdef, state = nnx.split(model)
  hidden = jax.jit(lambda s, t, prefix: nnx.merge(graphdef, s).hidden_states(
      t, prefix=prefix))
  want = hidden(state, tokens, None)
  got = hidden(state, tokens[:, p:], prefix.astype(jnp.bfloat16))
  assert got.shape == want.shape == (2, 24, config.hidden_size)
  np.testing.assert_array_equal(np.asarray(got, np.float32),
                                np.asarray(want, np.float32))
  # float32 embeddings are cast to the activation dtype.
  np.testing.assert_array_equal(
      np.asarray(hidden(state, tokens[:, p:], prefix), np.float32),
      np.asarray(want, np.float32))


def test_prefix_errors():
  config = cm.LlamaConfig.preset('tiny', max_seq_len=32)
  model = cm.Llama(config, recipe='bf16', rngs=nnx.Rngs(0))
  tokens = jnp.zeros((2, 8), jnp.int32)
  for prefix, match in (
      (jnp.zeros((3, 4, 64)), r'prefix has shape \(3, 4, 64\) and dtype'
       r' float32; expected floating embeddings of shape \(batch=2, prefix'
       r' length, hidden_size=64\)'),
      (jnp.zeros((2, 4, 32)), r'prefix has shape \(2, 4, 32\)'),
      (jnp.zeros((2, 4, 64), jnp.int32), 'dtype int32'),
      (jnp.zeros((2, 64)), r'prefix has shape \(2, 64\)'),
      (jnp.zeros((2, 25, 64)), 'prefix \\+ tokens has sequence length 33,'
       r' longer than the RoPE table \(config.max_seq_len=32\)')):
    with pytest.raises(ValueError, match=match):
      model.hidden_states(tokens, prefix=prefix)


# --- Config and conversion --------------------------------------------------


def test_presets():
  assert CONFIG.vision == vit.ViTConfig.preset('tiny')
  assert CONFIG.decoder == cm.LlamaConfig.preset('tiny')
  assert CONFIG.num_image_tokens == 16
  assert CONFIG.num_image_tokens + DATA.seq_len <= CONFIG.decoder.max_seq_len
  big = vlm.VLMConfig.preset('vlm_1b')
  assert big.vision == vit.ViTConfig.preset('vit_b16')
  assert big.decoder == cm.LlamaConfig.preset('1b')
  assert big.num_image_tokens == 196
  abstract = nnx.eval_shape(lambda: vlm.VLM(big, rngs=nnx.Rngs(0)))
  counts = {name: sum(x.size for x in jax.tree.leaves(
      nnx.state(getattr(abstract, name), nnx.Param)))
            for name in ('vision', 'projector', 'decoder')}
  print(f'vlm_1b params: {counts}')
  # SigLIP-B/16's tower without its head (vit_test.py compares them).
  assert counts['vision'] == 85_797_120
  assert counts['projector'] == 768 * 2048 + 2048 + 2048 * 2048 + 2048
  assert 1.0e9 < counts['decoder'] < 1.2e9
  assert abstract.conversion.converted and not abstract.conversion.skipped
  with pytest.raises(ValueError, match="preset 'vlm_7b' is unknown"):
    vlm.VLMConfig.preset('vlm_7b')
  with pytest.raises(ValueError, match='projector_size=0 must be a positive'):
    vlm.VLMConfig.preset('vlm_tiny', projector_size=0)
  with pytest.raises(ValueError, match='max_seq_len=16 leaves no room for'
                     ' text after the 16 image tokens'):
    vlm.VLMConfig.preset('vlm_tiny', decoder=cm.LlamaConfig.preset(
        'tiny', max_seq_len=16))


@pytest.mark.parametrize('recipe', ['bf16', 'fp8_linear', 'coat'])
def test_recipe_converts_the_vision_tower_and_projector(recipe):
  """coat: the ViT's and the projector's 15 Linear and 5 LayerNorm layers
  become FP8 layers and their GELUs the FP8-saving drop-in; fp8_linear:
  the linear layers only; bf16: none. The params are the same in every
  recipe."""
  model = vlm.VLM(CONFIG, recipe=recipe, rngs=nnx.Rngs(SEED))
  report = model.conversion
  print(report)
  r = recipes.get(recipe)
  converted = {}
  for row in report.converted:
    converted[row.to_type] = converted.get(row.to_type, 0) + 1
  want = {CoatLinear: 15 if r.fp8_matmuls else 0,
          CoatLayerNorm: 5 if r.fp8_activations else 0}
  assert converted == {k: v for k, v in want.items() if v}
  assert len(report.skipped) == 20 - len(report.converted)
  assert all(s.path[0] in ('vision', 'projector') for s in report.skipped)
  layer = model.vision.layers[1]
  assert isinstance(layer.mlp.fc2, CoatLinear) == r.fp8_matmuls
  assert isinstance(model.projector.fc1, CoatLinear) == r.fp8_matmuls
  assert isinstance(layer.layer_norm1, CoatLayerNorm) == r.fp8_activations
  gelu = coat_jax.nn.gelu if r.fp8_activations else jax.nn.gelu
  assert layer.mlp.activation.func is gelu
  assert model.projector.activation.func is gelu
  assert model.decoder.recipe == r
  reference = vlm.VLM(CONFIG, recipe='bf16', rngs=nnx.Rngs(SEED))
  jax.tree.map(np.testing.assert_array_equal,
               nnx.to_pure_dict(nnx.state(model, nnx.Param)),
               nnx.to_pure_dict(nnx.state(reference, nnx.Param)))


def test_pretrained_siglip_tower_goes_into_the_vlm(tmp_path):
  """A SigLIP vision tower of the tiny ViT's dims, loaded with load_siglip,
  updates the coat VLM's converted tower in place (the state trees are the
  same): its features are then the loaded ViT's converted with coat."""
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  torch.manual_seed(SEED)
  v = CONFIG.vision
  hf_config = transformers.SiglipVisionConfig(
      hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
      num_hidden_layers=v.num_layers, num_attention_heads=v.num_heads,
      image_size=v.image_size, patch_size=v.patch_size)
  transformers.SiglipVisionModel(hf_config).save_pretrained(tmp_path)
  tower = hf.load_siglip(tmp_path, activation_group_size=16)
  assert tower.config == v
  model = vlm.VLM(CONFIG, recipe='coat', rngs=nnx.Rngs(SEED))
  nnx.update(model.vision, nnx.state(tower, nnx.Param))
  coat_jax.convert(tower)
  images = _batch(0, batch_size=2).images
  np.testing.assert_array_equal(
      np.asarray(model.vision(images), np.float32),
      np.asarray(tower(images), np.float32))


# --- The loss ---------------------------------------------------------------


def test_loss_counts_the_masked_text_positions_only():
  """vlm_loss is the mean cross entropy of the logits at positions P + t
  (t a text position whose mask is set) of the decoder's whole P + S
  sequence; the image tokens have no targets. Targets where the mask is
  off do not change it; one where it is on does."""
  model = vlm.VLM(CONFIG, recipe='bf16', rngs=nnx.Rngs(SEED))
  b = _batch(0, batch_size=4)
  graphdef, state = nnx.split(model)
  loss_fn = _loss_fn(graphdef)
  loss = float(loss_fn(state, b))
  p = CONFIG.num_image_tokens

  @jax.jit
  def all_logits(state, images, tokens):
    model = nnx.merge(graphdef, state)
    hidden = model.decoder.hidden_states(tokens,
                                         prefix=model.image_tokens(images))
    return jnp.dot(hidden, model.decoder.head_kernel().astype(jnp.bfloat16),
                   preferred_element_type=jnp.float32)

  logits = all_logits(state, b.images, b.tokens)
  assert logits.shape[1] == p + DATA.seq_len

  def reference(logits):
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    picked = np.take_along_axis(logp, np.asarray(b.targets)[..., None],
                                axis=-1)[..., 0]
    return -picked[np.asarray(b.loss_mask)].mean()

  want = reference(logits[:, p:])
  print(f'loss {loss:.6f}, reference {want:.6f}')
  assert loss == pytest.approx(want, rel=1e-4)
  # The same logits read from position 0 (image tokens counted) differ.
  assert abs(reference(logits[:, :DATA.seq_len]) - want) > 1e-3 * want
  text_logits = jax.jit(lambda s, x, t: nnx.merge(graphdef, s)(x, t))
  np.testing.assert_allclose(text_logits(state, b.images, b.tokens),
                             logits[:, p:], rtol=1e-6)
  mask = np.asarray(b.loss_mask)
  off = np.where(mask, b.targets, (np.asarray(b.targets) + 7) % 256)
  assert float(loss_fn(state, b._replace(targets=jnp.asarray(off)))) == loss
  row, col = np.argwhere(mask)[0]
  on = np.asarray(b.targets).copy()
  on[row, col] = (on[row, col] + 7) % 256
  assert float(loss_fn(state, b._replace(targets=jnp.asarray(on)))) != loss
  none = b._replace(loss_mask=jnp.zeros_like(b.loss_mask))
  assert float(loss_fn(state, none)) == 0.0
  with pytest.raises(TypeError, match='loss_mask has dtype int32'):
    vlm.vlm_loss(model, b.images, b.tokens, b.targets,
                 b.loss_mask.astype(jnp.int32))
  with pytest.raises(ValueError, match=r'loss_mask has shape \(4, 3\)'):
    vlm.vlm_loss(model, b.images, b.tokens, b.targets, b.loss_mask[:, :3])


# --- Gradients and training -------------------------------------------------


def _cos(a, b):
  a, b = (np.concatenate([np.ravel(np.asarray(x, np.float64))
                          for x in jax.tree.leaves(t)]) for t in (a, b))
  return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_coat_gradients_match_bf16():
  """On 3 batches of shapes data: the coat VLM's loss within 1% of the bf16
  VLM's (same params) and its gradient's cosine to bf16's >= 0.98 over all
  params, every part (vision, projector, decoder) >= 0.97, every gradient
  finite and the vision tower's nonzero.

  The ViT's attention key biases are left out: softmax is invariant to
  q . b_k, so their gradient is rounding noise in both models (its size is
  asserted instead).
  """
  grads, losses = {}, {}
  for recipe in ('bf16', 'coat'):
    model = vlm.VLM(CONFIG, recipe=recipe, rngs=nnx.Rngs(SEED))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    step = jax.jit(jax.value_and_grad(
        lambda params, rest, b: vlm.vlm_loss(
            nnx.merge(graphdef, params, rest), b.images, b.tokens,
            b.targets, b.loss_mask)))
    out = [step(params, rest, _batch(i)) for i in range(3)]
    losses[recipe] = [float(loss) for loss, _ in out]
    grads[recipe] = [nnx.to_pure_dict(g) for _, g in out]
  for i in range(3):
    bf16, coat = grads['bf16'][i], grads['coat'][i]
    for g in (bf16, coat):
      assert all(np.isfinite(x).all() for x in jax.tree.leaves(g))
      assert np.abs(g['vision']['layers'][0]['mlp']['fc1']['kernel']).max(
          ) > 0
    norm = np.sqrt(sum(np.sum(np.square(x, dtype=np.float64))
                       for x in jax.tree.leaves(bf16)))
    for g in (bf16, coat):
      for layer in g['vision']['layers'].values():
        k_bias = layer['self_attn']['k_proj'].pop('bias')
        assert np.linalg.norm(k_bias) < 1e-3 * norm
    overall = _cos(coat, bf16)
    parts = {name: _cos(coat[name], bf16[name])
             for name in ('vision', 'projector', 'decoder')}
    print(f'batch {i}: loss bf16 {losses["bf16"][i]:.5f} coat'
          f' {losses["coat"][i]:.5f}; gradient cosine {overall:.4f},'
          f' parts {({k: round(v, 4) for k, v in parts.items()})}')
    assert losses['coat'][i] == pytest.approx(losses['bf16'][i], rel=0.01)
    assert overall >= 0.98
    assert min(parts.values()) >= 0.97


def test_coat_adamw_steps_lower_the_held_out_loss():
  """Ten coat_adamw steps of the coat VLM on train batches lower the loss
  of a held-out batch."""
  model = vlm.VLM(CONFIG, recipe='coat', rngs=nnx.Rngs(SEED))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  optimizer = coat_jax.coat_adamw(3e-3)
  opt_state = jax.jit(optimizer.init)(params)
  loss_fn = lambda params, b: vlm.vlm_loss(
      nnx.merge(graphdef, params, rest), b.images, b.tokens, b.targets,
      b.loss_mask)

  @jax.jit
  def step(params, opt_state, b):
    loss, grads = jax.value_and_grad(loss_fn)(params, b)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  held_out = _batch(0, split='val')
  evaluate = jax.jit(loss_fn)
  before = float(evaluate(params, held_out))
  losses = []
  for i in range(10):
    params, opt_state, loss = step(params, opt_state, _batch(i))
    losses.append(float(loss))
  after = float(evaluate(params, held_out))
  print(f'held-out loss {before:.4f} -> {after:.4f}; train losses'
        f' {np.round(losses, 3).tolist()}')
  assert np.isfinite(losses).all()
  assert after < 0.7 * before


def test_sharded_on_eight_devices():
  """Built under a (data, fsdp, tensor) = (2, 2, 2) mesh of the fake CPU
  devices with the logical axis rules, the coat VLM's params are sharded
  by their names (the ViT's and projector's too, kept by convert), and its
  loss and gradients with the batch sharded are the single-device
  model's."""
  b = _batch(0)
  single = vlm.VLM(CONFIG, recipe='coat', rngs=nnx.Rngs(SEED))
  graphdef, params, rest = nnx.split(single, nnx.Param, ...)
  grad_fn = jax.jit(jax.value_and_grad(lambda params, rest, b: vlm.vlm_loss(
      nnx.merge(graphdef, params, rest), b.images, b.tokens, b.targets,
      b.loss_mask)))
  want_loss, want_grads = grad_fn(params, rest, b)
  mesh = jax.make_mesh((2, 2, 2), ('data', 'fsdp', 'tensor'),
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(
      coat_jax.nn.LOGICAL_AXIS_RULES):
    model = vlm.VLM(CONFIG, recipe='coat', rngs=nnx.Rngs(SEED))
    fc1 = model.vision.layers[0].mlp.fc1
    assert isinstance(fc1, CoatLinear)
    assert fc1.kernel[...].sharding.spec == jax.sharding.PartitionSpec(
        'fsdp', 'tensor')
    assert model.projector.fc2.kernel[...].sharding.spec == (
        jax.sharding.PartitionSpec('tensor', 'fsdp'))
    batch_sharding = jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(('data', 'fsdp')))
    sharded = jax.device_put(b, batch_sharding)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    loss, grads = jax.jit(jax.value_and_grad(
        lambda params, rest, b: vlm.vlm_loss(
            nnx.merge(graphdef, params, rest), b.images, b.tokens,
            b.targets, b.loss_mask)))(params, rest, sharded)
  print(f'loss sharded {float(loss):.6f}, single device'
        f' {float(want_loss):.6f}; gradient cosine'
        f' {_cos(grads, want_grads):.6f}')
  assert float(loss) == pytest.approx(float(want_loss), rel=1e-3)
  assert _cos(grads, want_grads) > 0.999


# --- Decoding and accuracy --------------------------------------------------


def test_greedy_decode_follows_the_logits_and_accuracy_runs():
  """Each decoded id is the argmax (below vocab_limit) of the model's logits
  at the position before it, given the prompt and the ids decoded before
  (bf16: exact); answer_accuracy of the untrained model runs."""
  model = vlm.VLM(CONFIG, recipe='bf16', rngs=nnx.Rngs(SEED))
  b = _batch(0, batch_size=4, split='val')
  lq, la = DATA.question_len, DATA.answer_len
  got = np.asarray(vlm.greedy_decode(model, b.images, b.tokens[:, :lq], la,
                                     vocab_limit=100))
  assert got.shape == (4, la) and got.dtype == np.int32
  assert got.max() < 100
  text = jnp.concatenate([b.tokens[:, :lq], jnp.asarray(got)], axis=1)
  logits = nnx.jit(lambda m, x, t: m(x, t))(model, b.images, text)
  logits = logits[:, lq - 1:lq - 1 + la, :100]
  np.testing.assert_array_equal(got, np.argmax(logits, axis=-1))
  with pytest.raises(ValueError, match='num_tokens=0 must be >= 1'):
    vlm.greedy_decode(model, b.images, b.tokens[:, :lq], 0)
  accuracy = shapes.answer_accuracy(model, DATA, SEED, num_batches=1,
                                    batch_size=4)
  assert 0.0 <= accuracy <= 1.0


def test_answer_accuracy_is_exact_match_up_to_the_end(monkeypatch):
  """With a decoder that answers from a table: all right -> 1.0; a byte
  after END does not count; a wrong END or answer byte in one answer ->
  that answer wrong."""
  batches = [DATA.batch('val', SEED, i, 8) for i in range(2)]
  lq = DATA.question_len
  table = {}
  for b in batches:
    for i in range(8):
      table[b.images[i].tobytes() + b.tokens[i, :lq].tobytes()] = (
          b.tokens[i, lq:].copy())
  edits = {}  # (row, column) -> id, in the first batch's answers
  calls = []

  def fake(model, images, prompt, num_tokens, *, vocab_limit):
    del model
    assert vocab_limit == shapes.BYTE_VOCAB
    out = np.stack([table[x.tobytes() + p.tobytes()]
                    for x, p in zip(np.asarray(images), np.asarray(prompt))])
    assert out.shape[1] == num_tokens
    if not calls:
      for (row, col), value in edits.items():
        out[row, col] = value
    calls.append(None)
    return out

  monkeypatch.setattr(shapes.vlm, 'greedy_decode', fake)

  def accuracy():
    calls.clear()
    return shapes.answer_accuracy(None, DATA, SEED, num_batches=2,
                                  batch_size=8)

  assert accuracy() == 1.0
  # The shortest answer's row: its END at `end`, padding after it.
  counted = batches[0].loss_mask.sum(axis=1)
  row = int(np.argmin(counted))
  end = int(counted[row]) - 1
  assert end + 1 < DATA.answer_len
  edits[row, end + 1] = ord('x')
  assert accuracy() == 1.0
  edits[row, end] = ord('x')
  assert accuracy() == 15 / 16
  edits.clear()
  edits[row, 0] = ord('x')
  assert accuracy() == 15 / 16
