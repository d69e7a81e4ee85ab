"""LLaMA-1 33B dimensions (32.5B params) in coat mode under FSDP over every
visible GPU: on 8, params, FP8 moments and gradients shard 8 ways (about 38
GiB a GPU before activations). Scanned layers with remat 'full' keep the least; try
`--find-max-batch` for faster settings."""

from coat_jax.training import Config
from coat_jax.training import DataConfig
from coat_jax.training import MeshConfig
from coat_jax.training import ModelConfig
from coat_jax.training import OptimConfig
from coat_jax.training import TrainConfig


def get_config() -> Config:
  return Config(
      model=ModelConfig(preset='llama_33b', recipe='coat', scan_layers=True,
                        remat='full'),
      optim=OptimConfig(learning_rate=1.5e-4, warmup_steps=200),
      data=DataConfig(seq_len=2048),
      mesh=MeshConfig(data=1, fsdp=-1),
      train=TrainConfig(steps=1000, batch_size=16, eval_every=200,
                        checkpoint_every=200, run_dir='runs/llama_33b_fsdp'),
  )
