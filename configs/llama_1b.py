"""A 1B Llama (TinyLlama shape) with the COAT recipe (one or more GPUs).

Unrolled layers (the default) without remat (`model.remat='auto'` stands
for 'none' there): the fastest setting measured on one H200
(benchmarks/RESULTS.md "e2e-1b"). Scanned layers compile faster and keep
the least: --set model.scan_layers=true, where 'auto' stands for remat
'full' (docs/decisions.md#scanned).
"""

from coat_jax.training import Config
from coat_jax.training import DataConfig
from coat_jax.training import ModelConfig
from coat_jax.training import OptimConfig
from coat_jax.training import TrainConfig


def get_config() -> Config:
  return Config(
      model=ModelConfig(preset='1b', recipe='coat'),
      optim=OptimConfig(learning_rate=3e-4, warmup_steps=50),
      data=DataConfig(seq_len=2048),
      train=TrainConfig(steps=300, batch_size=8, eval_every=100,
                        checkpoint_every=1000, log_every=10,
                        run_dir='runs/llama_1b'),
  )
