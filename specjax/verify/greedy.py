"""Greedy verification (temperature 0): accept while the draft equals the target's argmax."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.verify.base import VerifyResult, accepted_prefix_length, check_inputs, drafted_laws


def greedy_verify(
  key: jax.Array | None,
  draft_tokens: jax.Array,
  draft_probs: jax.Array | None,
  target_probs: jax.Array,
) -> VerifyResult:
  """Accepts the longest prefix of `draft_tokens` that matches the target's argmax.

  `key` is ignored. `draft_probs` (may be None) only rejects x where q(x) is 0
  or non-finite; ids outside [0, V) are rejected. Ties break to the lowest id,
  as autoregressive greedy decoding's `jnp.argmax`, so the output equals it.


  Args:
    draft_tokens: `[B, g]` int32 (g >= 0).
    draft_probs: `[B, g, V]` or None.
    target_probs: `[B, g+1, V]` (probabilities or logits; only the argmax is used).

  Returns:
    `VerifyResult(num_accepted [B], next_token [B])`; next_token is the target's
    argmax at the first mismatch, or at position g when all g match.

  Raises:
    ValueError naming the argument when shapes or dtypes disagree.
  """
  del key
  check_inputs(draft_tokens, draft_probs, target_probs, probs_optional=True)
  best = jnp.argmax(target_probs, axis=-1).astype(jnp.int32)  # [B, g+1]
  match = draft_tokens == best[:, :-1]  # an id outside [0, V) never equals an argmax
  if draft_probs is not None:
    match &= drafted_laws(draft_tokens, draft_probs, target_probs).q_x > 0
  n = accepted_prefix_length(match)
  next_token = jnp.take_along_axis(best, n[:, None], axis=1)[:, 0]
  return VerifyResult(n, next_token)
