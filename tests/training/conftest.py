"""Shared fixtures for the train.py tests: a small text corpus, tiny configs."""

import dataclasses
import os

import pytest

from coat_jax import training
from coat_jax.training import trainer


@pytest.fixture(scope='session')
def corpus(tmp_path_factory) -> str:
  """~200 KB of real Python source, as one text file."""
  import json  # noqa: PLC0415 (any stdlib package is real text)
  src = os.path.dirname(json.__file__)
  text = ''.join(open(os.path.join(src, f)).read() for f in sorted(
      os.listdir(src)) if f.endswith('.py'))
  path = tmp_path_factory.mktemp('corpus') / 'code.txt'
  path.write_text(text * 2)
  return str(path)


@pytest.fixture
def tiny_config(corpus, tmp_path):
  def make(**sections) -> training.Config:
    config = training.Config()
    config.data = training.DataConfig(source='text', paths=(corpus,),
                                      seq_len=32)
    config.train = training.TrainConfig(
        steps=3, batch_size=8, log_every=1, eval_every=100, eval_batches=1,
        checkpoint_every=100, run_dir=str(tmp_path / 'run'),
        progress_bar=False, sample_tokens=0)
    config.optim.warmup_steps = 1
    for section, fields in sections.items():
      target = getattr(config, section)
      for k, v in fields.items():
        # A name that is no field would be set and then ignored.
        assert k in {f.name for f in dataclasses.fields(target)}, (section, k)
        setattr(target, k, v)
    return config
  return make


@pytest.fixture
def ctrl_c_at_call(monkeypatch):
  """ctrl_c_at_call(n): the train steps `trainer.build` makes from then on
  raise KeyboardInterrupt (a Ctrl-C) at their n-th call instead of
  running it."""
  def install(n: int) -> None:
    build = trainer.build

    def build_with_ctrl_c(*args, **kwargs):
      setup = build(*args, **kwargs)
      step, calls = setup.train_step, []

      def interrupted(*a):
        calls.append(1)
        if len(calls) == n:
          raise KeyboardInterrupt
        return step(*a)

      setup.train_step = interrupted
      return setup

    monkeypatch.setattr(trainer, 'build', build_with_ctrl_c)
  return install
