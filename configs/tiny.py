"""The default run: a tiny Llama, coat mode, stdlib corpus (CPU-sized)."""

from coat_jax.training import Config


def get_config() -> Config:
  return Config()
