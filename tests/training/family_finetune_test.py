"""train.py fine-tunes a Hugging Face checkpoint of every family (written
by `transformers`): the loss falls, a rerun resumes, the result exports."""

import json
import os
import shutil

import jax
import numpy as np
import pytest
import torch
import transformers

from coat_jax import export
from coat_jax import training

SEED = 0
_BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96,
             num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
CONFIGS = {
    'mistral': lambda: transformers.MistralConfig(**_BASE, sliding_window=16),
    'qwen2': lambda: transformers.Qwen2Config(**_BASE,
                                              tie_word_embeddings=True),
    'qwen3': lambda: transformers.Qwen3Config(**_BASE, head_dim=32),
    'olmo2': lambda: transformers.Olmo2Config(**_BASE, eos_token_id=1,
                                              pad_token_id=0),
    'gemma3': lambda: transformers.Gemma3TextConfig(
        **_BASE, head_dim=32, query_pre_attn_scalar=32, sliding_window=16,
        layer_types=['sliding_attention', 'full_attention']),
}


def _losses(run_dir):
  with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
    return [r['loss'] for r in map(json.loads, f) if 'loss' in r]


@pytest.mark.parametrize('name', sorted(CONFIGS))
def test_finetunes_resumes_and_exports(tiny_config, tmp_path, name):
  torch.manual_seed(SEED)
  hf_dir = str(tmp_path / 'hf')
  transformers.AutoModelForCausalLM.from_config(
      CONFIGS[name]()).save_pretrained(hf_dir)
  run = str(tmp_path / 'run')
  config = tiny_config(model={'init_from': hf_dir, 'recipe': 'coat'},
                       optim={'learning_rate': 1e-2},
                       train={'steps': 4, 'checkpoint_every': 2,
                              'run_dir': run})
  devices = jax.devices()[:1]
  summary = training.train(config, devices=devices)
  losses = _losses(run)
  assert summary['step'] == 4 and np.isfinite(losses).all()
  assert losses[-1] < losses[0], losses
  shutil.rmtree(os.path.join(run, 'checkpoints', '4'))
  os.remove(os.path.join(run, 'metrics.jsonl'))
  summary = training.train(config, devices=devices)
  assert summary['resumed_from'] == 2 and _losses(run) == losses[2:]
  out = str(tmp_path / 'out')
  assert export.main([run, out]) == 0
  again = transformers.AutoModelForCausalLM.from_pretrained(out)
  assert type(again).__name__ == type(
      transformers.AutoModelForCausalLM.from_pretrained(hf_dir)).__name__
