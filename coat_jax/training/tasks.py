"""What the trainer trains: a language model on token windows, or a
vision-language model on the shapes data.

A `Task` is everything the loop needs to know about the model and its data
beyond the decoder stack they share: how to build the model, its loss on a
batch, the batch's arrays (a tuple, batch-major: what the train step takes
after the state), where the decoder's stacked layers sit in the params, and
what evaluation and the closing sample add for it. `of_config` picks the
task from the config (a vision-language `model.preset` trains on
`data.source=shapes`; `config.validate` keeps the two together).
"""

from collections.abc import Callable
import dataclasses
import os
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from coat_jax import recipes
from coat_jax.models import decoder
from coat_jax.models import families
from coat_jax.models import sampling
from coat_jax.models import vlm
from coat_jax.training import config as config_lib
from coat_jax.training import data as data_lib
from coat_jax.training import shapes
from coat_jax.training import tokenizer as tokenizer_lib


@dataclasses.dataclass(frozen=True)
class Task:
  """A model and its data, as the trainer uses them.

  Attributes:
    name: 'lm' (a decoder on token windows) or 'vlm' (a `vlm.VLM` on
      `shapes` images and questions).
    decoder: the language model's architecture (its layers' layout and
      remat policy, its vocabulary).
    make_model: (recipe, rngs) -> the model, unplaced.
    loss: (model, *batch, layers=None) -> float32 scalar loss; layers: the
      decoder's per-layer params or a `LayerFeed` (`Decoder.hidden_states`).
    batch_shapes: batch_size -> the batch's ShapeDtypeStructs, unsharded.
    layers_path: the keys of the decoder's stacked layer params in the
      params dict.
    tokens_per_example: decoder positions an example fills (what tokens/s
      counts: for a VLM, image tokens and text).
    family: the decoder's model family (`families`), for Hugging Face
      checkpoints; None for a VLM.
  """

  name: str
  decoder: decoder.DecoderConfig
  make_model: Callable[[recipes.Recipe, nnx.Rngs], nnx.Module]
  loss: Callable[..., jax.Array]
  batch_shapes: Callable[[int], tuple[jax.ShapeDtypeStruct, ...]]
  layers_path: tuple[str, ...]
  tokens_per_example: int
  family: families.Family | None = None

  def layers_of(self, tree: dict) -> Any:
    """The subtree of `tree` (the params, or a tree like them: their
    gradients, moments) at layers_path."""
    for key in self.layers_path:
      tree = tree[key]
    return tree

  def with_layers(self, tree: dict, value: Any) -> dict:
    """`tree` with its subtree at layers_path replaced by `value` (the
    dicts on the way copied; None: a subtree without leaves)."""
    return _replace(tree, self.layers_path, value)


def _replace(tree: dict, path: tuple[str, ...], value: Any) -> dict:
  if not path:
    return value
  return {**tree, path[0]: _replace(tree[path[0]], path[1:], value)}


def of_config(config: config_lib.Config) -> Task:
  """The task `config` describes (a validated config)."""
  vlm_config = config_lib.vlm_architecture(config.model)
  if vlm_config is not None:
    return _vlm_task(vlm_config)
  arch = config_lib.architecture(config.model)
  family = families.of_config(arch)
  seq = config.data.seq_len

  def make_model(recipe, rngs):
    return family.model(arch, recipe=recipe, rngs=rngs)

  def batch_shapes(batch_size):
    tokens = jax.ShapeDtypeStruct((batch_size, seq), jnp.int32)
    return tokens, tokens

  return Task(name='lm', decoder=arch, make_model=make_model,
              loss=family.loss, batch_shapes=batch_shapes,
              layers_path=('layers',), tokens_per_example=seq,
              family=family)


# A VLM's image tokens and text fill a multiple of this: cuDNN's flash
# attention has no backward for odd lengths, and tiles of 16 rows waste
# little at either size.
POSITION_MULTIPLE = 16


def shapes_dataset(config: vlm.VLMConfig) -> shapes.ShapesDataset:
  """The shapes data drawn at the size of the VLM's images, its text padded
  so that image tokens and text fill a multiple of POSITION_MULTIPLE."""
  image = config.num_image_tokens
  fewest = shapes.ShapesDataset(image_size=config.vision.image_size).seq_len
  total = -(-(image + fewest) // POSITION_MULTIPLE) * POSITION_MULTIPLE
  return shapes.ShapesDataset(image_size=config.vision.image_size,
                              text_len=total - image)


def _vlm_task(config: vlm.VLMConfig) -> Task:
  dataset = shapes_dataset(config)
  size, text = config.vision.image_size, dataset.seq_len

  def make_model(recipe, rngs):
    return vlm.VLM(config, recipe=recipe, rngs=rngs)

  def batch_shapes(batch_size):
    tokens = jax.ShapeDtypeStruct((batch_size, text), jnp.int32)
    return (jax.ShapeDtypeStruct((batch_size, size, size,
                                  config.vision.num_channels), jnp.uint8),
            tokens, tokens, jax.ShapeDtypeStruct((batch_size, text), bool))

  return Task(name='vlm', decoder=config.decoder, make_model=make_model,
              loss=vlm.vlm_loss, batch_shapes=batch_shapes,
              layers_path=('decoder', 'layers'),
              tokens_per_example=config.num_image_tokens + text)


class Data:
  """A task's batches: `batch(split, index, batch_size)` is a tuple of
  numpy arrays (the train step's arguments after the state), a function
  of (train.seed, split, index, batch_size) alone, so a resumed run draws
  what it would have drawn."""

  def __init__(self, batch: Callable[[str, int, int], tuple[np.ndarray, ...]],
               tokenizer: Any = None):
    self.batch = batch
    # Decodes generated ids (None: token files without one).
    self.tokenizer = tokenizer


def load_data(config: config_lib.Config, task: Task) -> Data:
  """Reads and checks the data of `config` for `task` (no compilation: call
  it before compiling the step, so that bad data stops a run at once).

  Raises:
    ValueError: data the model cannot take (naming the setting to change).
  """
  seed = config.train.seed
  if task.name == 'vlm':
    dataset = shapes_dataset(config_lib.vlm_architecture(config.model))
    if task.tokens_per_example > task.decoder.max_seq_len:
      raise ValueError(
          f'the VLM reads {task.tokens_per_example} positions (image tokens'
          f' and {dataset.seq_len} text tokens) but model.max_seq_len is'
          f' {task.decoder.max_seq_len}: raise model.max_seq_len.')
    return Data(lambda split, index, batch_size: tuple(dataset.batch(
        split, seed, index, batch_size, dtype=np.uint8)))
  data = data_config(config)
  tokens = data_lib.load_dataset(data, task.decoder.vocab_size,
                                 init_from=config.model.init_from)
  seq = config.data.seq_len
  return Data(lambda split, index, batch_size: tokens.batch(
      split, seed, index, batch_size, seq), tokenizer_lib.for_data(data))


def data_config(config: config_lib.Config) -> config_lib.DataConfig:
  """config.data, with data.source=text reading model.init_from's
  tokenizer.json when data.tokenizer is unset and that file exists."""
  d, init_from = config.data, config.model.init_from
  if d.source == 'text' and d.tokenizer is None and init_from is not None:
    tokenizer = os.path.join(init_from, 'tokenizer.json')
    if os.path.isfile(tokenizer):
      return dataclasses.replace(d, tokenizer=tokenizer)
  return d


def evaluate_more(task: Task, config: config_lib.Config, model: nnx.Module
                  ) -> dict[str, float]:
  """What evaluation reports beyond the validation loss: for a VLM,
  `val_accuracy`, the exact-match answer accuracy of greedy decoding on
  train.eval_batches held-out batches; {} for a language model."""
  if task.name != 'vlm':
    return {}
  t = config.train
  dataset = shapes_dataset(model.config)
  return {'val_accuracy': shapes.answer_accuracy(
      model, dataset, t.seed, num_batches=t.eval_batches,
      batch_size=t.batch_size)}


def sample(task: Task, config: config_lib.Config, model: nnx.Module,
           data: Data) -> str | None:
  """What a run that trained shows at its end: a greedy continuation of
  train.sample_prompt of train.sample_tokens (language models with a
  tokenizer), or a held-out question with the VLM's answer and the right
  one; None when train.sample_tokens=0 or there is no tokenizer."""
  t = config.train
  if not t.sample_tokens:
    return None
  if task.name == 'vlm':
    dataset = shapes_dataset(model.config)
    drawn = dataset.sample('val', t.seed, 0, 1)
    batch = dataset.encode(drawn, np.uint8)
    question = batch.tokens[:, :dataset.question_len]
    ids = np.asarray(vlm.greedy_decode(model, batch.images, question,
                                       dataset.answer_len,
                                       vocab_limit=shapes.BYTE_VOCAB))[0]
    answer = bytes(ids.astype(np.uint8)).split(bytes([shapes.END]))[0]
    return (f'{drawn.questions[0]} {answer.decode(errors="replace")}'
            f' (right: {drawn.answers[0]})')
  if data.tokenizer is None:
    return None
  prompt = data.tokenizer.encode(t.sample_prompt)
  room = model.config.max_seq_len - len(prompt)
  new = sampling.generate(model, prompt, min(t.sample_tokens, max(room, 0)),
                          vocab_limit=data.tokenizer.vocab_size)
  return t.sample_prompt + data.tokenizer.decode(new)
