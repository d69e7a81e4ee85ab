"""Llama-2-7B dimensions with the COAT recipe; shard with --set mesh.fsdp=N.

The fastest setting measured on one H200 (benchmarks/RESULTS.md "e2e-7b"):
unrolled layers (the default) without remat ('auto' stands for 'none'
there), batch 16 x 2048, which fills train.py's default
XLA_PYTHON_CLIENT_MEM_FRACTION (0.95); smaller batches leave headroom.
Scanned layers (--set model.scan_layers=true) run remat 'full' under
'auto' and fit batch 32, or 4 x 16384. `python train.py --config
configs/llama2_7b.py --estimate` prints the memory plan without training.
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
