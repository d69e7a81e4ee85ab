"""Text generation from a decoder: greedy or temperature sampling.

No KV cache: each new token runs the model over a fixed buffer of
len(prompt) + max_new_tokens ids (zeros after the last written token), so
the loop compiles once per buffer length. A causal model ignores the zeros
for the positions before them; in the FP8 modes the per-tensor scales see
the whole buffer, which the zeros are part of, so a position's logits are
those of `model(buffer)` at that position, not of the prompt alone.
"""

import functools

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from coat_jax.models.decoder import Decoder


@functools.partial(jax.jit, static_argnames=('graphdef', 'start', 'greedy',
                                             'vocab_limit'))
def _fill(graphdef, params, buffer, key, temperature, *, start: int,
          greedy: bool, vocab_limit: int | None):
  def step(i, carry):
    buffer, params = carry
    pos = start + i
    # The params ride in the carry: nnx refuses values of an outer trace.
    logits = nnx.merge(graphdef, params)(buffer[None])[0]
    logits = jax.lax.dynamic_index_in_dim(logits, pos - 1, keepdims=False)
    logits = logits[:vocab_limit]
    if greedy:
      token = jnp.argmax(logits)
    else:
      token = jax.random.categorical(jax.random.fold_in(key, i),
                                     logits / temperature)
    return buffer.at[pos].set(token.astype(buffer.dtype)), params

  return jax.lax.fori_loop(0, buffer.shape[0] - start, step,
                           (buffer, params))[0]


def generate(model: Decoder, prompt: list[int],
             max_new_tokens: int, *, temperature: float = 0.0, seed: int = 0,
             vocab_limit: int | None = None) -> list[int]:
  """Continues `prompt` by `max_new_tokens` token ids.

  Args:
    model: a Decoder (the trainer's is `nnx.merge(graphdef, params)`).
    prompt: the token ids to continue, at least one.
    max_new_tokens: how many ids to generate (>= 0).
    temperature: 0 picks the most likely id (greedy, deterministic);
      > 0 samples from softmax(logits / temperature).
    seed: the sampling key's seed (unused when greedy).
    vocab_limit: only ids below it are generated (the tokenizer's vocab, when
      the model's is larger); None: all of the model's.

  Returns:
    The new ids only, int, length `max_new_tokens`.

  Raises:
    ValueError: an empty prompt, a negative length or temperature, or a
      prompt + new tokens longer than the model's max_seq_len.
  """
  if not len(prompt):
    raise ValueError('prompt is empty: give at least one token (--prompt).')
  if max_new_tokens < 0:
    raise ValueError(f'max_new_tokens={max_new_tokens} must be >= 0.')
  if not temperature >= 0:
    raise ValueError(f'temperature={temperature} must be >= 0 (0: greedy).')
  total = len(prompt) + max_new_tokens
  max_len = model.config.max_seq_len
  if total > max_len:
    raise ValueError(
        f'the prompt ({len(prompt)} tokens) + max_new_tokens'
        f' ({max_new_tokens}) = {total} is longer than the model\'s'
        f' max_seq_len={max_len}: shorten the prompt or generate fewer.')
  if max_new_tokens == 0:
    return []
  buffer = np.zeros(total, np.int32)
  buffer[:len(prompt)] = prompt
  graphdef, params = nnx.split(model)
  out = _fill(graphdef, params, jnp.asarray(buffer),
              jax.random.key(seed), jnp.float32(temperature or 1.0),
              start=len(prompt), greedy=temperature == 0,
              vocab_limit=vocab_limit)
  return [int(t) for t in np.asarray(out)[len(prompt):]]

