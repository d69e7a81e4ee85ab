"""Generation: greedy is the model's argmax, sampling follows the seed."""

from flax import nnx
import jax.numpy as jnp
import numpy as np
import pytest

from coat_jax import models
from coat_jax.models import sampling
from coat_jax.training import tokenizer as tokenizer_lib


def _model(recipe, seed=0):
  return models.Llama(models.LlamaConfig.preset('tiny'), recipe=recipe,
                      rngs=nnx.Rngs(seed))


@pytest.mark.parametrize('recipe', ['bf16', 'coat'])
def test_greedy_is_the_argmax_of_the_logits_step_by_step(recipe):
  model = _model(recipe)
  prompt = list(np.random.default_rng(1).integers(0, 256, 5))
  new = sampling.generate(model, prompt, 7)
  assert new == sampling.generate(model, prompt, 7)  # deterministic
  # The reference: the model on the same fixed buffer, one token at a time.
  buffer = np.zeros(len(prompt) + 7, np.int32)
  buffer[:len(prompt)] = prompt
  for pos in range(len(prompt), len(buffer)):
    logits = np.asarray(model(jnp.asarray(buffer)[None])[0, pos - 1])
    assert np.isfinite(logits).all()
    buffer[pos] = int(np.argmax(logits))
  assert new == list(buffer[len(prompt):])


def test_temperature_sampling_depends_on_the_seed():
  model = _model('coat')
  draw = lambda seed, temperature=2.0: sampling.generate(
      model, [10, 20], 24, temperature=temperature, seed=seed)
  assert draw(0) == draw(0)
  assert draw(0) != draw(1)
  assert all(0 <= t < 256 for t in draw(2))
  # A vanishing temperature is greedy.
  assert draw(3, 1e-6) == sampling.generate(model, [10, 20], 24)


def test_vocab_limit_and_bad_arguments():
  model = _model('bf16')
  assert max(sampling.generate(model, [1], 20, temperature=5.0,
                               vocab_limit=3)) < 3
  assert sampling.generate(model, [1], 0) == []
  with pytest.raises(ValueError, match='prompt is empty'):
    sampling.generate(model, [], 4)
  with pytest.raises(ValueError, match='max_seq_len=256'):
    sampling.generate(model, [1] * 200, 57)
  with pytest.raises(ValueError, match='temperature=-1'):
    sampling.generate(model, [1], 4, temperature=-1)


def test_byte_tokenizer_round_trips():
  tok = tokenizer_lib.ByteTokenizer()
  text = 'def f(x):\n  return "héllo ✓"\t\x00'
  ids = tok.encode(text)
  assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode())
  assert tok.decode(ids) == text
  assert tok.decode([0xE2, 0x9C]) == '\ufffd'  # a cut character, replaced
