"""Llama-2-13B dimensions, full-parameter, on one GPU (an H200's 141 GB).

float32 params (52 GB) and FP8 moments (27.6 GB) stay on the device; each
decoder layer takes its optimizer step inside backward
(`optim.apply_in_backward`, docs/in_backward.md), so the layers' float32
gradients (52 GB) are never all live, and the clip uses the previous step's
global norm. `python train.py --config configs/llama2_13b_1gpu.py
--estimate` prints the plan before a run.
"""

from coat_jax.training import Config
from coat_jax.training import DataConfig
from coat_jax.training import ModelConfig
from coat_jax.training import OptimConfig
from coat_jax.training import TrainConfig


def get_config() -> Config:
  return Config(
      model=ModelConfig(preset='llama2_13b', recipe='coat'),
      optim=OptimConfig(learning_rate=2e-4, warmup_steps=200,
                        apply_in_backward=True, in_backward_clip='previous'),
      data=DataConfig(seq_len=2048),
      train=TrainConfig(steps=1000, batch_size=4, eval_every=200,
                        checkpoint_every=200, run_dir='runs/llama2_13b_1gpu'),
  )
