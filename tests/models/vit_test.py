"""The ViT encoder: SigLIP vision towers loaded against transformers, the
presets, what coat_jax.convert makes of it, bad input."""

import json
import os

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import coat_jax
from coat_jax.models import hf
from coat_jax.models import vit
from coat_jax.nn import CoatLayerNorm
from coat_jax.nn import CoatLinear
from coat_jax.nn import residuals

SEED = 7201
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, image_size=32, patch_size=8)


def _torch():
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  return torch, transformers


def _images(seed, batch=3, size=32):
  return np.random.default_rng(seed).normal(
      size=(batch, size, size, 3)).astype(np.float32)


def _siglip_features(model, images):
  """transformers' last_hidden_state of NHWC float32 images."""
  torch, _ = _torch()
  with torch.no_grad():
    pixels = torch.tensor(images.transpose(0, 3, 1, 2))
    return model(pixel_values=pixels).last_hidden_state.numpy()


def _relative_error(got, want):
  return float(np.abs(np.asarray(got) - want).max() / np.abs(want).max())


@pytest.fixture(scope='module')
def siglip_vision(tmp_path_factory):
  """{hidden_act: (checkpoint dir, the transformers SiglipVisionModel)},
  each with its pooling head (which load_siglip does not read)."""
  torch, transformers = _torch()
  torch.manual_seed(SEED)
  out = {}
  for act in ('gelu_pytorch_tanh', 'gelu'):
    config = transformers.SiglipVisionConfig(hidden_act=act,
                                             vision_use_head=True, **TINY)
    model = transformers.SiglipVisionModel(config).eval()
    path = str(tmp_path_factory.mktemp(act))
    model.save_pretrained(path)
    out[act] = path, model
  return out


@pytest.mark.parametrize('act', ['gelu_pytorch_tanh', 'gelu'])
def test_siglip_vision_model_features_equal_transformers(siglip_vision, act):
  """float32 last hidden states within 1e-5 of the largest (measured:
  2.5e-7 for both activations)."""
  path, reference = siglip_vision[act]
  images = _images(SEED)
  model = hf.load_siglip(path, dtype=jnp.float32)
  assert model.config.activation == {'gelu_pytorch_tanh': 'gelu_tanh',
                                     'gelu': 'gelu'}[act]
  error = _relative_error(model(jnp.asarray(images)),
                          _siglip_features(reference, images))
  print(f'{act}: max |error| / max |feature| = {error:.2e}')
  assert error < 1e-5


def test_full_siglip_checkpoint_loads_its_vision_tower(tmp_path):
  """A SiglipModel checkpoint (model_type 'siglip', text tower included):
  its vision_config and vision_model.* tensors."""
  torch, transformers = _torch()
  torch.manual_seed(SEED + 1)
  config = transformers.SiglipConfig(
      vision_config=TINY,
      text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=1, num_attention_heads=2,
                       max_position_embeddings=16, bos_token_id=1,
                       eos_token_id=2, pad_token_id=0))
  model = transformers.SiglipModel(config).eval()
  model.save_pretrained(tmp_path)
  assert json.load(open(tmp_path / 'config.json'))['model_type'] == 'siglip'
  images = _images(SEED + 1)
  error = _relative_error(
      hf.load_siglip(tmp_path, dtype=jnp.float32)(jnp.asarray(images)),
      _siglip_features(model.vision_model, images))
  assert error < 1e-5


def test_vision_model_checkpoint_with_prefixed_names(siglip_vision,
                                                     tmp_path):
  """transformers 4 saves a SiglipVisionModel's tensors under
  'vision_model.'; the same weights load the same ViT."""
  _torch()
  from safetensors.numpy import load_file  # noqa: PLC0415
  from safetensors.numpy import save_file  # noqa: PLC0415
  path, reference = siglip_vision['gelu_pytorch_tanh']
  tensors = load_file(os.path.join(path, 'model.safetensors'))
  assert 'embeddings.patch_embedding.weight' in tensors
  save_file({f'vision_model.{k}': v for k, v in tensors.items()},
            str(tmp_path / 'model.safetensors'), metadata={'format': 'pt'})
  with open(os.path.join(path, 'config.json')) as f:
    (tmp_path / 'config.json').write_text(f.read())
  images = _images(SEED + 2)
  error = _relative_error(
      hf.load_siglip(tmp_path, dtype=jnp.float32)(jnp.asarray(images)),
      _siglip_features(reference, images))
  assert error < 1e-5


def test_vit_b16_preset_has_siglip_b16s_tensors():
  """Every param of the 'vit_b16' ViT has the shape (in the ViT's layout)
  of its tensor in transformers' SiglipVisionModel at its defaults
  (SigLIP-B/16 at 224 px, built on the meta device), and every tensor of
  that model but the pooling head is read."""
  torch, transformers = _torch()
  with torch.device('meta'):
    model = transformers.SiglipVisionModel(transformers.SiglipVisionConfig())
  shapes = {k.removeprefix('vision_model.'): tuple(v.shape)
            for k, v in model.state_dict().items()}
  config = vit.ViTConfig.preset('vit_b16')
  assert hf.config_from_siglip(model.config.to_dict()) == config
  abstract = nnx.eval_shape(lambda: vit.ViT(config, rngs=nnx.Rngs(0)))
  read = set()
  for key_path, leaf in jax.tree_util.tree_leaves_with_path(
      nnx.to_pure_dict(nnx.state(abstract, nnx.Param))):
    name, transform = hf._siglip_tensor(tuple(k.key for k in key_path))
    assert transform(np.zeros(shapes[name], np.float32)).shape == leaf.shape
    read.add(name)
  assert set(shapes) - read == {n for n in shapes if n.startswith('head.')}
  assert config.num_patches == 196
  params = sum(int(np.prod(s)) for n, s in shapes.items()
               if not n.startswith('head.'))
  assert params == sum(x.size for x in jax.tree.leaves(
      nnx.state(abstract, nnx.Param)))


def test_config_from_siglip_defaults_and_errors():
  assert (hf.config_from_siglip({'model_type': 'siglip', 'vision_config': {}})
          == vit.ViTConfig.preset('vit_b16'))
  with pytest.raises(ValueError, match=r"model_type='clip' is not a SigLIP"):
    hf.config_from_siglip({'model_type': 'clip'})
  with pytest.raises(ValueError,
                     match=r"vision_config.hidden_act='quick_gelu' is not"):
    hf.config_from_siglip({'model_type': 'siglip',
                            'vision_config': {'hidden_act': 'quick_gelu'}})


def test_checkpoint_that_disagrees_with_its_config(siglip_vision, tmp_path):
  path, _ = siglip_vision['gelu']
  hf_config = json.load(open(os.path.join(path, 'config.json')))
  hf_config['intermediate_size'] = 128
  (tmp_path / 'config.json').write_text(json.dumps(hf_config))
  os.symlink(os.path.join(path, 'model.safetensors'),
             tmp_path / 'model.safetensors')
  with pytest.raises(ValueError, match=r"'encoder.layers.0.mlp.fc1.bias'"
                     r' has shape \(96,\); config.json implies the ViT'
                     r' param layers/0/mlp/fc1/bias \(128,\)'):
    hf.load_siglip(tmp_path)
  hf_config['model_type'] = 'siglip'
  (tmp_path / 'config.json').write_text(json.dumps(hf_config))
  with pytest.raises(ValueError, match='no SigLIP vision tower'):
    hf.load_siglip(tmp_path)


def test_convert_turns_every_layer_into_fp8_and_saves_fp8():
  """coat_jax.convert replaces the tiny ViT's 13 Linear and 5 LayerNorm
  layers, keeps its Params, and (with the FP8 GELU) its forward within
  FP8 tolerance and its batch-sized residuals FP8 but for attention's and
  row statistics (measured: features within 3.9% relative; residuals
  0.30x the unconverted ViT's bytes)."""
  config = vit.ViTConfig.preset('tiny')
  images = jnp.asarray(_images(SEED + 3, batch=8), jnp.bfloat16)
  plain = vit.ViT(config, rngs=nnx.Rngs(SEED))
  model = vit.ViT(config, activation_group_size=16, rngs=nnx.Rngs(SEED))
  kernel = model.layers[0].mlp.fc1.kernel
  report = coat_jax.convert(model)
  print(report)
  assert not report.skipped
  counts = {}
  for row in report.converted:
    key = (row.from_type, row.to_type)
    counts[key] = counts.get(key, 0) + 1
  assert counts == {(nnx.Linear, CoatLinear): 13,
                    (nnx.LayerNorm, CoatLayerNorm): 5}
  assert model.layers[0].mlp.fc1.kernel is kernel
  assert isinstance(model.patch_embedding, CoatLinear)
  assert isinstance(model.post_layernorm, CoatLayerNorm)
  want = np.asarray(plain(images), np.float32)
  got = np.asarray(model(images), np.float32)
  error = np.linalg.norm(got - want) / np.linalg.norm(want)
  print(f'converted ViT features: relative error {error:.4f}')
  assert error < 0.05

  def activations(m):
    graph, state = nnx.split(m)
    fn = lambda s, x: jnp.sum(nnx.merge(graph, s)(x).astype(jnp.float32))
    doubled = jnp.concatenate([images, images])
    return residuals.activation_residuals(fn, (state, images),
                                          (state, doubled))

  kept = activations(model)
  # Beside FP8 codes and their E8M0 scales: the LayerNorms' float32 mean
  # and rstd (one a row) and attention's per-head tensors (XLA's
  # attention here: q, k, v and the probabilities).
  fp8 = (jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float8_e8m0fnu)
  other = [r for r in kept if r.dtype not in fp8]
  assert all(r.shape[-1] == 1 or r.ndim >= 4 for r in other), other
  # One E4M3 input a layer: 13 linear layers, 5 LayerNorms, 2 GELUs.
  assert sum(r.dtype == jnp.float8_e4m3fn for r in kept) == 20
  ratio = residuals.nbytes(kept) / residuals.nbytes(activations(plain))
  print(f'activation residuals: {ratio:.3f}x the unconverted ViT\'s bytes')
  assert ratio < 0.5


def test_bad_config_and_images():
  with pytest.raises(ValueError, match='image_size=30 must be a multiple of'
                     ' patch_size=8'):
    vit.ViTConfig.preset('tiny', image_size=30)
  with pytest.raises(ValueError, match='hidden_size=64 must be a multiple of'
                     ' num_heads=5'):
    vit.ViTConfig.preset('tiny', num_heads=5)
  with pytest.raises(ValueError, match="activation='relu' must be one of"):
    vit.ViTConfig(activation='relu')
  with pytest.raises(ValueError, match="preset 'vit_l' is unknown"):
    vit.ViTConfig.preset('vit_l')
  model = vit.ViT(vit.ViTConfig.preset('tiny'), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r'images has shape \(2, 28, 28, 3\)'
                     r'.*expected floating \(batch, 32, 32, 3\)'):
    model(jnp.zeros((2, 28, 28, 3)))
  with pytest.raises(ValueError, match='dtype int32'):
    model(jnp.zeros((2, 32, 32, 3), jnp.int32))


def test_load_hf_reads_a_siglip_tower_converted_with_the_recipe(
    siglip_vision):
  """coat_jax.load_hf of a SigLIP checkpoint: the ViT of load_siglip, the
  recipe's conversion applied (bf16: none, the same features; coat: FP8
  layers, features within the FP8 error of transformers')."""
  path, reference = siglip_vision['gelu_pytorch_tanh']
  images = jnp.asarray(_images(SEED + 3))
  want = _siglip_features(reference, np.asarray(images))
  plain = coat_jax.models.load_hf(path, 'bf16', dtype=jnp.float32)
  assert isinstance(plain, vit.ViT) and not plain.conversion.converted
  np.testing.assert_array_equal(
      plain(images), hf.load_siglip(path, dtype=jnp.float32)(images))
  coat = coat_jax.models.load_hf(path, dtype=jnp.float32)
  kinds = {type(m) for _, m in nnx.iter_graph(coat)}
  assert CoatLinear in kinds and CoatLayerNorm in kinds
  # Per layer q, k, v, out, fc1, fc2 and two LayerNorms; the patch
  # embedding and the final LayerNorm.
  assert len(coat.conversion.converted) == 2 * (4 + 2 + 2) + 1 + 1
  got = np.asarray(coat(images), np.float32)
  error = float(np.linalg.norm(got - want) / np.linalg.norm(want))
  # FP8 GEMMs in and out of two layers on random weights and pixels
  # (measured 6.4% relative L2); BF16 is 0.
  assert 1e-4 < error < 0.1, error
  with pytest.raises(ValueError, match='drop shardings'):
    coat_jax.models.load_hf(path, shardings={})
  with pytest.raises(ValueError, match=r"drop \['max_seq_len'\]"):
    coat_jax.models.load_hf(path, max_seq_len=64)
