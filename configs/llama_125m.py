"""A 125M Llama in coat mode on the stdlib corpus (one GPU)."""

from coat_jax.training import Config
from coat_jax.training import DataConfig
from coat_jax.training import ModelConfig
from coat_jax.training import OptimConfig
from coat_jax.training import TrainConfig


def get_config() -> Config:
  return Config(
      model=ModelConfig(preset='125m', recipe='coat'),
      optim=OptimConfig(learning_rate=6e-4, warmup_steps=100),
      data=DataConfig(seq_len=1024),
      train=TrainConfig(steps=2000, batch_size=32, eval_every=250,
                        checkpoint_every=500, run_dir='runs/llama_125m'),
  )
