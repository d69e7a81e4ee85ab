"""A 1B VLM in coat mode on the shapes questions (one GPU): a ViT-B/16
encoder at 224 px (196 image tokens), a projector MLP and the 1b Llama
decoder, trained from scratch (`model.preset='vlm_1b'`; a SigLIP tower's
weights load with `coat_jax.models.load_siglip`, docs/vlm.md)."""

from coat_jax.training import Config
from coat_jax.training import DataConfig
from coat_jax.training import ModelConfig
from coat_jax.training import OptimConfig
from coat_jax.training import TrainConfig


def get_config() -> Config:
  return Config(
      model=ModelConfig(preset='vlm_1b', recipe='coat'),
      optim=OptimConfig(learning_rate=5e-4, warmup_steps=50),
      data=DataConfig(source='shapes'),
      train=TrainConfig(steps=700, batch_size=32, eval_every=350,
                        eval_batches=32, checkpoint_every=1000, log_every=10,
                        run_dir='runs/vlm_1b'),
  )
