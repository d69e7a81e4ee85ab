"""Llama-2-13B dimensions in coat mode; shard with --set mesh.fsdp=N."""

from coat_jax.training import Config
from coat_jax.training import DataConfig
from coat_jax.training import ModelConfig
from coat_jax.training import OptimConfig
from coat_jax.training import TrainConfig


def get_config() -> Config:
  return Config(
      model=ModelConfig(preset='llama2_13b', recipe='coat'),
      optim=OptimConfig(learning_rate=2e-4, warmup_steps=200),
      data=DataConfig(seq_len=2048),
      train=TrainConfig(steps=1000, batch_size=8, eval_every=200,
                        checkpoint_every=200, run_dir='runs/llama2_13b'),
  )
