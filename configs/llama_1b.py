"""A 1B Llama (TinyLlama shape) in coat mode (one or more GPUs).

Unrolled layers (the default) without remat: the fastest measured on one
H200 (90.3K tokens/s at batch 8, 1.22x a plain BF16 Llama, 20.1 GiB;
89.9K with remat minimal, 79.5K with scanned layers; benchmarks/RESULTS.md
"e2e-1b"). Scanned layers compile in ~4 s instead of ~28 s:
--set model.scan_layers=true.
"""

from coat_jax.training import Config
from coat_jax.training import DataConfig
from coat_jax.training import ModelConfig
from coat_jax.training import OptimConfig
from coat_jax.training import TrainConfig


def get_config() -> Config:
  return Config(
      model=ModelConfig(preset='1b', precision='coat', remat='none'),
      optim=OptimConfig(learning_rate=3e-4, warmup_steps=50),
      data=DataConfig(seq_len=2048),
      train=TrainConfig(steps=300, batch_size=8, eval_every=100,
                        checkpoint_every=1000, log_every=10,
                        run_dir='runs/llama_1b'),
  )
