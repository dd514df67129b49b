"""Exact token verification (Leviathan et al. 2023; Chen et al. 2023).

For i = 1..g accept x_i with probability min(1, p(x_i) / q(x_i)); at the first
rejection n emit y ~ normalize(max(0, p_n - q_n)); if all g are accepted emit a
bonus y ~ p_{g+1}. The emitted tokens are then distributed exactly as the
target's own samples.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.sampling import sample
from specjax.verify.base import VerifyResult, accepted_prefix_length


def token_verify(key: jax.Array, draft_tokens: jax.Array, draft_probs: jax.Array,
                 target_probs: jax.Array) -> VerifyResult:
  """Exact token-by-token verification of a drafted block, vectorised over rows.

  Args:
    key: PRNG key; all randomness of this call comes from it.
    draft_tokens: `[B, g]` int32, x_i drawn from `draft_probs[:, i]`.
    draft_probs: `[B, g, V]` q, the distribution each draft token was drawn from.
    target_probs: `[B, g+1, V]` p at the same positions plus one.

  Returns:
    `VerifyResult(num_accepted [B] in [0, g], next_token [B])`.

  Guards: a drafted token with q(x) = 0 (impossible if x really came from q) is
  treated as rejected; a residual max(0, p - q) that sums to zero (p == q, where
  rejection has probability zero) falls back to p instead of dividing by zero.
  """
  b, g = draft_tokens.shape
  accept_key, sample_key = jax.random.split(key)
  p = target_probs.astype(jnp.float32)
  q = draft_probs.astype(jnp.float32)
  p_x = jnp.take_along_axis(p[:, :g], draft_tokens[..., None], axis=-1)[..., 0]
  q_x = jnp.take_along_axis(q, draft_tokens[..., None], axis=-1)[..., 0]
  u = jax.random.uniform(accept_key, (b, g), jnp.float32)
  # u < p/q without dividing; q_x > 0 rejects impossible drafts.
  accept = (q_x > 0) & (u * q_x < p_x)
  n = accepted_prefix_length(accept)

  # The distribution of the emitted token: residual at the rejected position,
  # or p itself at position g (append a zero q row so both cases are one gather).
  q_padded = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)
  p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]  # [B, V]
  q_n = jnp.take_along_axis(q_padded, n[:, None, None], axis=1)[:, 0]
  residual = jnp.maximum(p_n - q_n, 0.0)
  mass = jnp.sum(residual, axis=-1, keepdims=True)
  dist = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_n)
  return VerifyResult(n, sample(sample_key, dist))
