"""Training and distillation: optax AdamW, a jitted step, orbax checkpoints.

Draft heads (EAGLE, Medusa, early exit) train in the same loop on a frozen
target (`config.head`, see `specjax.training.heads`).
"""

from specjax.training.checkpoint import (
  Checkpointer,
  CheckpointError,
  load_head_config,
  load_model_config,
  load_trained_head,
  load_trained_model,
)
from specjax.training.heads import HeadLoss
from specjax.training.trainer import LOSSES, check_config, prepare_data, train

__all__ = [
  "CheckpointError",
  "Checkpointer",
  "HeadLoss",
  "LOSSES",
  "check_config",
  "load_head_config",
  "load_model_config",
  "load_trained_head",
  "load_trained_model",
  "prepare_data",
  "train",
]
