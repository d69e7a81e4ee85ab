"""Training: typed configs, data, sharding rules, checkpoints and the loop."""

from coat_jax.training.compilation_cache import use_compilation_cache
from coat_jax.training.config import Config
from coat_jax.training.config import DataConfig
from coat_jax.training.config import MeshConfig
from coat_jax.training.config import ModelConfig
from coat_jax.training.config import OptimConfig
from coat_jax.training.config import TrainConfig
from coat_jax.training.config import apply_overrides
from coat_jax.training.config import architecture
from coat_jax.training.config import load_config
from coat_jax.training.config import validate
from coat_jax.training.trainer import NonFiniteError
from coat_jax.training.trainer import build
from coat_jax.training.trainer import device_batch
from coat_jax.training.trainer import train

__all__ = [
    'Config', 'DataConfig', 'MeshConfig', 'ModelConfig', 'NonFiniteError',
    'OptimConfig', 'TrainConfig', 'apply_overrides', 'architecture', 'build',
    'device_batch', 'load_config',
    'train', 'use_compilation_cache', 'validate',
]
