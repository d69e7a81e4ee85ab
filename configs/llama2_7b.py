"""Llama-2-7B dimensions in coat mode; shard with --set mesh.fsdp=N.

Unrolled layers without remat, batch 8 x 2048: 19.1K tokens/s, 90.6 GiB on
one H200 (compile ~55 s; 2026-11-24); batch 16, the fastest measured:
21.1K, 129.8 GiB (2026-11-26; batch 12: 20.3K, 108.6 GiB); remat 'minimal'
at batch 8 18.7K; scanned 17.4K; remat 'full' at batch 32 16.1K, 91.5 GiB
(benchmarks/RESULTS.md "e2e-7b"). Longer sequences (4 x 16384) need remat
'full'.
"""

from coat_jax.training import Config
from coat_jax.training import DataConfig
from coat_jax.training import ModelConfig
from coat_jax.training import OptimConfig
from coat_jax.training import TrainConfig


def get_config() -> Config:
  return Config(
      model=ModelConfig(preset='llama2_7b', precision='coat',
                        scan_layers=False, remat='none'),
      optim=OptimConfig(learning_rate=3e-4, warmup_steps=200),
      data=DataConfig(seq_len=2048),
      train=TrainConfig(steps=1000, batch_size=8, eval_every=200,
                        checkpoint_every=200, run_dir='runs/llama2_7b'),
  )
