"""Exact token verification (Leviathan et al. 2023; Chen et al. 2023).

For i = 1..g accept x_i with probability min(1, p(x_i) / q(x_i)); at the first
rejection n emit y ~ normalize(max(0, p_n - q_n)); if all g are accepted emit a
bonus y ~ p_{g+1}. The emitted tokens are then distributed exactly as the
target's own samples.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.sampling import sample_with_uniform
from specjax.verify.base import (
  VerifyResult,
  accepted_prefix_length,
  check_inputs,
  check_key,
  drafted_laws,
)


def token_verify(
  key: jax.Array, draft_tokens: jax.Array, draft_probs: jax.Array, target_probs: jax.Array
) -> VerifyResult:
  """Exact token-by-token verification of a drafted block, vectorised over rows.

  Args:
    key: PRNG key; all randomness of this call comes from it.
    draft_tokens: `[B, g]` int32, x_i drawn from `draft_probs[:, i]` (g >= 0).
    draft_probs: `[B, g, V]` q, the distribution each draft token was drawn from.
    target_probs: `[B, g+1, V]` p at the same positions plus one.

  Returns:
    `VerifyResult(num_accepted [B] in [0, g], next_token [B])`.

  Raises:
    ValueError naming the argument when shapes or dtypes disagree.

  A token that cannot have come from q is rejected; a zero-mass residual (p ==
  q) falls back to p.
  """

  b, g, _ = check_inputs(draft_tokens, draft_probs, target_probs)
  check_key(key)
  p, q, p_x, q_x = drafted_laws(draft_tokens, draft_probs, target_probs)
  # One random-bit computation: g acceptance uniforms, then the emitted token's.
  u = jax.random.uniform(key, (b, g + 1), jnp.float32)
  # u < p/q without dividing; q_x > 0 rejects impossible drafts.
  n = accepted_prefix_length((q_x > 0) & (u[:, :g] * q_x < p_x))

  # The distribution of the emitted token: residual at the rejected position,
  # or p itself at position g (append a zero q row so both cases are one gather).
  q_padded = jnp.concatenate([q, jnp.zeros_like(p[:, :1])], axis=1)
  p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]  # [B, V]
  q_n = jnp.take_along_axis(q_padded, n[:, None, None], axis=1)[:, 0]
  residual = jnp.maximum(p_n - q_n, 0.0)
  mass = jnp.sum(residual, axis=-1, keepdims=True)
  dist = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_n)
  return VerifyResult(n, sample_with_uniform(u[:, g], dist))
