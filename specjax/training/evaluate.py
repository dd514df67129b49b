"""How well a draft matches its target: teacher-forced and in real decoding."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from specjax import losses
from specjax.data.dataset import TokenDataset
from specjax.generation.speculative import speculative_generate
from specjax.models.transformer import Transformer
from specjax.sampling import SamplingParams


def mean_metrics(
  metrics_fn: Callable[[np.ndarray], dict[str, jax.Array]], batches: Iterable[np.ndarray]
) -> dict[str, float]:
  """The mean over `batches` of the scalar metrics `metrics_fn(batch)` returns.

  Raises ValueError when `batches` is empty (a mean of nothing is no metric).
  """
  sums, count = {}, 0
  for batch in batches:
    for k, v in jax.device_get(metrics_fn(batch)).items():
      sums[k] = sums.get(k, 0.0) + float(v)
    count += 1
  if not count:
    raise ValueError("mean_metrics needs at least one batch, got none.")
  return {k: v / count for k, v in sums.items()}


@jax.jit
def _agreement(target: Transformer, draft: Transformer, batch: jax.Array) -> dict[str, jax.Array]:
  """Agreement and both cross-entropies on int32 `[B, T + 1]` windows."""
  inputs, labels = batch[:, :-1], batch[:, 1:]
  p_logits, q_logits = target(inputs), draft(inputs)
  return {
    **losses.agreement(p_logits, q_logits),
    "target_ce": losses.cross_entropy(p_logits, labels),
    "draft_ce": losses.cross_entropy(q_logits, labels),
  }


def teacher_forced_agreement(
  target: Transformer,
  draft: Transformer,
  data: TokenDataset,
  batch_size: int = 8,
  seq_len: int = 256,
  num_batches: int = 8,
) -> dict[str, float]:
  """Mean per-position α on corpus windows: `alpha_t0` (argmax agreement),
  `alpha_t1` (1 - TV(p, q)), and both models' cross-entropy (nats)."""
  return mean_metrics(
    lambda batch: _agreement(target, draft, jnp.asarray(batch)),
    data.eval_batches(batch_size, seq_len, num_batches),
  )


def decoding_acceptance(
  target: Transformer,
  draft: Transformer,
  prompts: jax.Array,
  lengths: jax.Array,
  temperature: float,
  gamma: int = 4,
  max_new_tokens: int = 64,
  seed: int = 0,
) -> dict[str, float]:
  """α and tokens/iteration of real speculative decoding on a prompt batch."""
  out = speculative_generate(
    target,
    draft,
    prompts,
    lengths,
    gamma=gamma,
    max_new_tokens=max_new_tokens,
    sampling=SamplingParams(temperature=temperature),
    key=jax.random.key(seed),
  )
  return {
    "acceptance_rate": float(out.stats.acceptance_rate),
    "tokens_per_iteration": float(out.stats.tokens_per_iteration),
  }
