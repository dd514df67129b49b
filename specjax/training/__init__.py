"""Training and distillation: optax AdamW, a jitted step, orbax checkpoints."""

from specjax.training.checkpoint import (
  Checkpointer,
  CheckpointError,
  load_model_config,
  load_trained_model,
)
from specjax.training.trainer import LOSSES, check_config, prepare_data, train

__all__ = [
  "CheckpointError",
  "Checkpointer",
  "LOSSES",
  "check_config",
  "load_model_config",
  "load_trained_model",
  "prepare_data",
  "train",
]
