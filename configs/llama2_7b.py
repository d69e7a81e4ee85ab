"""Llama-2-7B dimensions in coat mode; shard with --set mesh.fsdp=N.

The fastest setting measured on one H200: unrolled layers (the default)
without remat ('auto' stands for 'none' there), batch 16 x 2048: 21.4K
tokens/s in train.py with evaluation and a checkpoint, peak 130.3 GiB of
the 132.8 that train.py's default XLA_PYTHON_CLIENT_MEM_FRACTION (0.95)
allows (2026-11-26; e2e.py: 21.1K, 1.56x a plain BF16 Llama at its
largest batch). Less headroom wanted: batch 12 (20.3K, 108.6 GiB) or 8
(19.1K, 90.6 GiB); remat 'minimal' at batch 8 18.7K, scanned 17.4K.
Scanned layers (--set model.scan_layers=true) run remat 'full' under
'auto': batch 32 17.2K, 77.5 GiB (benchmarks/RESULTS.md "e2e-7b").
Longer sequences (4 x 16384) need remat 'full' (scanned: 11.8K, 77.5
GiB). `python train.py --config configs/llama2_7b.py --estimate` prints
the memory plan without training.
"""

from coat_jax.training import Config
from coat_jax.training import DataConfig
from coat_jax.training import ModelConfig
from coat_jax.training import OptimConfig
from coat_jax.training import TrainConfig


def get_config() -> Config:
  return Config(
      model=ModelConfig(preset='llama2_7b', recipe='coat'),
      optim=OptimConfig(learning_rate=3e-4, warmup_steps=200),
      data=DataConfig(seq_len=2048),
      train=TrainConfig(steps=1000, batch_size=16, eval_every=200,
                        checkpoint_every=200, run_dir='runs/llama2_7b'),
  )
