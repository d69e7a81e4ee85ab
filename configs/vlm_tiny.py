"""A tiny VLM in coat mode on the shapes questions (CPU-sized): a 2-layer
ViT on 32 px images, a projector and the tiny Llama."""

from coat_jax.training import Config
from coat_jax.training import DataConfig
from coat_jax.training import ModelConfig
from coat_jax.training import OptimConfig
from coat_jax.training import TrainConfig


def get_config() -> Config:
  return Config(
      model=ModelConfig(preset='vlm_tiny', recipe='coat'),
      optim=OptimConfig(learning_rate=3e-3, warmup_steps=20),
      data=DataConfig(source='shapes'),
      train=TrainConfig(steps=200, batch_size=32, eval_every=100,
                        run_dir='runs/vlm_tiny'),
  )
