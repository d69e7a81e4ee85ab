"""Fine-tunes a Hugging Face checkpoint (Llama 2/3, Mistral, Qwen2/2.5,
Qwen3, OLMo 2, Gemma 3 text) with the COAT recipe.

  python train.py --config configs/finetune_hf.py \
      --set model.init_from=path/to/Qwen3-1.7B data.source=text \
      data.paths='my/*.txt'

The checkpoint's config.json sets the model's dimensions and its
tokenizer.json tokenizes data.source=text; export the result with
`python -m coat_jax.export runs/finetune_hf OUT_DIR`.
"""

from coat_jax.training import Config
from coat_jax.training import DataConfig
from coat_jax.training import ModelConfig
from coat_jax.training import OptimConfig
from coat_jax.training import TrainConfig


def get_config() -> Config:
  return Config(
      model=ModelConfig(recipe='coat'),  # set model.init_from=DIR
      optim=OptimConfig(learning_rate=2e-5, warmup_steps=10,
                        end_learning_rate_ratio=0.1, weight_decay=0.0),
      # Your text: --set data.source=text data.paths='my/*.txt'.
      data=DataConfig(seq_len=2048),
      train=TrainConfig(steps=200, batch_size=8, eval_every=50,
                        checkpoint_every=100, log_every=10,
                        run_dir='runs/finetune_hf'),
  )
