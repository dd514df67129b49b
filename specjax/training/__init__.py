"""Training and distillation: optax AdamW, a jitted step, orbax checkpoints.

Draft heads of any registered kind (`specjax.heads`) train in the same loop on a frozen
target (`config.head`, see `specjax.training.heads`).
"""

import importlib

# name -> the submodule that defines it. Imported on first use: a module that needs
# one submodule (`specjax.hf.heads` the checkpoint loader) does not import the trainer.
_EXPORTS = {
  "CheckpointError": "checkpoint",
  "Checkpointer": "checkpoint",
  "load_head_config": "checkpoint",
  "load_model_config": "checkpoint",
  "load_trained_head": "checkpoint",
  "load_trained_model": "checkpoint",
  "LOSSES": "trainer",
  "check_config": "trainer",
  "prepare_data": "trainer",
  "train": "trainer",
}


def __getattr__(name: str):
  if name in _EXPORTS:
    return getattr(importlib.import_module(f"specjax.training.{_EXPORTS[name]}"), name)
  raise AttributeError(f"module 'specjax.training' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
