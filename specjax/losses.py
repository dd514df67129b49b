"""Training objectives: next-token cross-entropy and draft distillation losses.

A low module (it imports only jax and optax): the trainer (`specjax.training`) and
the head kinds' objectives (`specjax.heads`) both use it, and neither is below the other.

Distillation compares the frozen target's next-token distribution p with the
draft's q at every position of a text window. With exact verification a draft
token is accepted with probability 1 - TV(p, q) at temperature 1 (Leviathan et
al. 2023, Thm 3.5 / DistillSpec), so `tv` optimises acceptance directly;
`kl` is the forward KL(p || q), which is smooth and covers p's support.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

DISTILL_LOSSES = ("kl", "tv", "kl+tv")


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy (nats). logits `[B, T, V]`, targets `[B, T]`."""
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def forward_kl(target_logits: jax.Array, draft_logits: jax.Array) -> jax.Array:
  """Mean KL(p || q) over positions; both `[B, T, V]`."""
  log_p = jax.nn.log_softmax(target_logits)
  log_q = jax.nn.log_softmax(draft_logits)
  return (jnp.exp(log_p) * (log_p - log_q)).sum(-1).mean()


def total_variation(target_logits: jax.Array, draft_logits: jax.Array) -> jax.Array:
  """Mean TV(p, q) = 0.5 * sum |p - q| over positions; both `[B, T, V]`."""
  p = jax.nn.softmax(target_logits)
  q = jax.nn.softmax(draft_logits)
  return 0.5 * jnp.abs(p - q).sum(-1).mean()


def distill_loss(kind: str, target_logits: jax.Array, draft_logits: jax.Array) -> jax.Array:
  """The distillation objective named `kind` (one of DISTILL_LOSSES)."""
  if kind == "kl":
    return forward_kl(target_logits, draft_logits)
  if kind == "tv":
    return total_variation(target_logits, draft_logits)
  if kind == "kl+tv":
    return forward_kl(target_logits, draft_logits) + total_variation(target_logits, draft_logits)
  raise ValueError(f"distill loss must be one of {DISTILL_LOSSES}, got {kind!r}.")


def agreement(target_logits: jax.Array, draft_logits: jax.Array) -> dict[str, jax.Array]:
  """Teacher-forced acceptance estimates, averaged over positions.

  `alpha_t1` = mean (1 - TV(p, q)): the acceptance probability at temperature 1.
  `alpha_t0` = mean [argmax p == argmax q]: greedy acceptance.
  """
  same = target_logits.argmax(-1) == draft_logits.argmax(-1)
  return {
    "alpha_t1": 1.0 - total_variation(target_logits, draft_logits),
    "alpha_t0": same.mean(dtype=jnp.float32),
  }


# -- what draft-head objectives share (each kind's objective: `specjax.heads.<kind>`)


def smooth_l1(pred: jax.Array, target: jax.Array) -> jax.Array:
  """Mean smooth-L1 (Huber with delta 1) over all elements, as EAGLE's feature loss."""
  return optax.huber_loss(pred.astype(jnp.float32), target.astype(jnp.float32), delta=1.0).mean()


def target_outputs(target, inputs: jax.Array, return_hidden):
  """The frozen target on `inputs [B, T]`: (logits `[B, T, V]`, features `[B, T, F]`),
  never differentiated."""
  b, t = inputs.shape
  logits, _, features = target.forward_cached(
    inputs, target.init_cache(b, t), return_hidden=return_hidden
  )
  return jax.lax.stop_gradient(logits), jax.lax.stop_gradient(features)


def law_metrics(loss: str, p_logits, q_logits, labels) -> dict[str, jax.Array]:
  """Divergence `loss` of q from p, the head's cross-entropy on `labels` and the
  agreement of p and q."""
  return {
    "distill": distill_loss(loss, p_logits, q_logits),
    "ce": cross_entropy(q_logits, labels),
    **agreement(p_logits, q_logits),
  }
