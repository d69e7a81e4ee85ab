"""A 1B Llama (TinyLlama shape) in coat mode (one or more GPUs).

Unrolled layers without remat: the fastest measured on one H200 (90.5K
tokens/s at batch 8, 1.22x a plain BF16 Llama, against 79.3K scanned with
remat minimal; 20.0 GiB; benchmarks/RESULTS.md "e2e-1b"). Scanned layers
compile in ~5 s instead of ~35 s: --set model.scan_layers=true.
"""

from coat_jax.training import Config
from coat_jax.training import DataConfig
from coat_jax.training import ModelConfig
from coat_jax.training import OptimConfig
from coat_jax.training import TrainConfig


def get_config() -> Config:
  return Config(
      model=ModelConfig(preset='1b', precision='coat', scan_layers=False,
                        remat='none'),
      optim=OptimConfig(learning_rate=3e-4, warmup_steps=50),
      data=DataConfig(seq_len=2048),
      train=TrainConfig(steps=300, batch_size=8, eval_every=100,
                        checkpoint_every=1000, log_every=10,
                        run_dir='runs/llama_1b'),
  )
