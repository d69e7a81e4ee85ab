"""Continues a prompt with a trained run's model: its latest checkpoint.

  python -m coat_jax.generate runs/default --prompt 'def ' --max-new-tokens 200
  python -m coat_jax.generate RUN_DIR --prompt 'import ' --temperature 0.8 \
      --seed 1

Text goes through the run's tokenizer: byte-level for the default corpus and
for text without data.tokenizer, else that tokenizer.json. The params are
restored on one device.
"""

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

from flax import nnx
import jax

from coat_jax.models import sampling
from coat_jax.training import config as config_lib
from coat_jax.training import tasks
from coat_jax.training import tokenizer as tokenizer_lib
from coat_jax.training import trainer
from coat_jax.training.checkpoints import Checkpointer


def load_run(run_dir: str, devices=None) -> tuple[config_lib.Config, Any, int]:
  """(config, model, step) of the latest checkpoint in `run_dir`.

  Args:
    run_dir: a train.py run directory (config.json, checkpoints/).
    devices: where to place the state; default the first device (the run's
      own mesh need not fit this machine).

  Raises:
    FileNotFoundError: no config.json or no checkpoint in `run_dir`.
  """
  path = os.path.join(run_dir, 'config.json')
  if not os.path.isfile(path):
    raise FileNotFoundError(f'{run_dir}: no config.json; give a run directory'
                            ' that train.py wrote (train.run_dir).')
  with open(path) as f:
    config = config_lib.from_dict(json.load(f))
  devices = jax.devices()[:1] if devices is None else devices
  # The run's mesh and batch may not fit these devices; neither changes the
  # saved state, which restores onto any mesh.
  config.mesh = config_lib.MeshConfig(data=-1, fsdp=1, tensor=1)
  config.train = dataclasses.replace(
      config.train, batch_size=len(devices), microbatches=1)
  checkpointer = Checkpointer(run_dir, config)
  try:
    step = checkpointer.latest_step()
    if step is None:
      raise FileNotFoundError(
          f'{run_dir}: no checkpoint under {checkpointer.directory}; train'
          ' first (python train.py --set train.run_dir=...).')
    setup = trainer.build(config, devices)
    with jax.set_mesh(setup.mesh):
      state = trainer.restore_state(setup, checkpointer, step)
  finally:
    checkpointer.close()
  return config, nnx.merge(setup.graphdef, state['params']), step


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('run_dir', help='a train.py run directory')
  parser.add_argument('--prompt', required=True, help='the text to continue')
  parser.add_argument('--max-new-tokens', type=int, default=128,
                      help='tokens to generate (default 128)')
  parser.add_argument('--temperature', type=float, default=0.0,
                      help='0 (default): greedy; > 0: sample')
  parser.add_argument('--seed', type=int, default=0,
                      help='the sampling seed (default 0)')
  args = parser.parse_args(argv)
  try:
    config, model, step = load_run(args.run_dir)
    if config_lib.vlm_architecture(config.model) is not None:
      raise ValueError(
          f'{args.run_dir} trained a vision-language model, which answers'
          ' questions about images rather than continuing text: use'
          ' coat_jax.models.vlm.greedy_decode (docs/vlm.md).')
    tokenizer = tokenizer_lib.for_data(tasks.data_config(config))
    if tokenizer is None:
      raise ValueError(
          f'{args.run_dir} trained on token files (data.source=tokens),'
          ' which come without a tokenizer: no text to encode the prompt'
          ' with.')
    new = sampling.generate(
        model, tokenizer.encode(args.prompt), args.max_new_tokens,
        temperature=args.temperature, seed=args.seed,
        vocab_limit=tokenizer.vocab_size)
  except (ValueError, FileNotFoundError, ImportError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  print(f'# {args.run_dir}, step {step}', file=sys.stderr)
  print(args.prompt + tokenizer.decode(new))
  return 0


if __name__ == '__main__':
  sys.exit(main())
