"""Exports the latest checkpoint of a train.py run as a Hugging Face
checkpoint of its family.

  python -m coat_jax.export RUN_DIR OUT_DIR [--dtype bfloat16]

Reads RUN_DIR/config.json (written by train.py) and the newest checkpoint
under RUN_DIR/checkpoints, then writes OUT_DIR/config.json and safetensors
that `transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)` loads. The
tokenizer files of model.init_from, if any, are copied along, and its
config.json's bos_token_id, eos_token_id and pad_token_id kept.
"""

import argparse
import dataclasses
import json
import os
import shutil
import sys

TOKENIZER_FILES = ('tokenizer.json', 'tokenizer_config.json',
                   'special_tokens_map.json', 'tokenizer.model',
                   'generation_config.json')
# The config.json fields of model.init_from that an export keeps.
TOKEN_ID_FIELDS = ('bos_token_id', 'eos_token_id', 'pad_token_id')


def load_run_config(run_dir: str):
  """The `training.Config` that train.py saved in RUN_DIR/config.json."""
  from coat_jax.training import config as config_lib  # noqa: PLC0415

  file = os.path.join(run_dir, 'config.json')
  if not os.path.isfile(file):
    raise FileNotFoundError(f'{file}: no such file; RUN_DIR must be a'
                            ' train.py run directory (train.run_dir).')
  with open(file) as f:
    return config_lib.from_dict(json.load(f))


def token_ids(init_from: str) -> dict:
  """The special token ids (`TOKEN_ID_FIELDS`) that model.init_from's
  config.json sets: a tokenizer's ids, not the architecture's, so the
  exported config.json keeps them."""
  from coat_jax.models import hf  # noqa: PLC0415

  config = hf.read_hf_config(init_from)
  return {k: config[k] for k in TOKEN_ID_FIELDS if k in config}


def export(run_dir: str, out_dir: str, *, dtype: str = 'float32',
           max_shard_size: int = 5 * 2**30) -> int:
  """Writes the latest checkpoint of `run_dir` to `out_dir`; returns its
  step."""
  from flax import nnx  # noqa: PLC0415
  import jax  # noqa: PLC0415

  from coat_jax.models import hf  # noqa: PLC0415
  from coat_jax.training import config as config_lib  # noqa: PLC0415
  from coat_jax.training import trainer  # noqa: PLC0415
  from coat_jax.training.checkpoints import Checkpointer  # noqa: PLC0415

  config = load_run_config(run_dir)
  if config_lib.vlm_architecture(config.model) is not None:
    raise ValueError(
        f'{run_dir} trained a vision-language model; export writes a'
        ' Hugging Face language model: save its decoder yourself with'
        ' coat_jax.models.save_hf(model.decoder, ...) (docs/vlm.md).')
  # The checkpoint fixes the model and optimizer layout, not the mesh or the
  # batch: spread the state over this machine's devices.
  n = len(jax.devices())
  config.mesh = dataclasses.replace(config.mesh, data=1, fsdp=n, tensor=1)
  config.train = dataclasses.replace(config.train, batch_size=n,
                                     microbatches=1)
  setup = trainer.build(config)
  checkpointer = Checkpointer(run_dir, config)
  try:
    step = checkpointer.latest_step()
    if step is None:
      raise FileNotFoundError(f'{checkpointer.directory} holds no'
                              ' checkpoint to export.')
    template = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        setup.abstract_state, setup.state_shardings)
    with jax.set_mesh(setup.mesh):
      state = checkpointer.restore(step, template)
  finally:
    checkpointer.close()
  model = nnx.merge(setup.graphdef, state['params'])
  init_from = config.model.init_from
  hf.save_hf(model, out_dir, dtype=dtype, max_shard_size=max_shard_size,
             extra_config=token_ids(init_from) if init_from else None)
  for name in TOKENIZER_FILES if init_from else ():
    if os.path.isfile(os.path.join(init_from, name)):
      shutil.copyfile(os.path.join(init_from, name),
                      os.path.join(out_dir, name))
  return step


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('run_dir', help='a train.py run directory')
  parser.add_argument('out_dir', help='where to write the HF checkpoint')
  parser.add_argument('--dtype', default='float32',
                      choices=('float32', 'bfloat16'))
  parser.add_argument('--max_shard_gb', type=float, default=5.0,
                      help='GiB per safetensors file')
  args = parser.parse_args(argv)
  try:
    step = export(args.run_dir, args.out_dir, dtype=args.dtype,
                  max_shard_size=int(args.max_shard_gb * 2**30))
  except (ValueError, FileNotFoundError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  print(f'exported step {step} of {args.run_dir} to {args.out_dir}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
