"""AdamW with linear warmup, cosine decay and global-norm gradient clipping."""

from __future__ import annotations

import ml_collections
import optax


def learning_rate_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
  """Linear warmup to `learning_rate` over `warmup_steps`, then cosine decay to
  `learning_rate * min_lr_ratio` at `num_steps`. The first update already uses
  `learning_rate / (warmup_steps + 1)`, not zero."""
  return optax.warmup_cosine_decay_schedule(
    init_value=config.learning_rate / (config.warmup_steps + 1),
    peak_value=config.learning_rate,
    warmup_steps=config.warmup_steps,
    decay_steps=config.num_steps,
    end_value=config.learning_rate * config.min_lr_ratio,
  )


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """Clipping then AdamW on `learning_rate_schedule(config)`, from a train config's
  `clip_norm`, `b1`, `b2` and `weight_decay`."""
  return optax.chain(
    optax.clip_by_global_norm(config.clip_norm),
    optax.adamw(
      learning_rate_schedule(config), b1=config.b1, b2=config.b2, weight_decay=config.weight_decay
    ),
  )
