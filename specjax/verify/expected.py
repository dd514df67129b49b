"""Expected accepted tokens of a drafted block under each verification rule.

Given one drafted block and the laws along it, the number of accepted tokens is
random only through the verifier's coins, so its expectation is a closed form:

  token: sum_{k=1..g} prod_{i<=k} min(1, p_i(x_i) / q_i(x_i))
  block: E[tau] = sum_{i=1..g} i * h_i * prod_{j>i} (1 - h_j)

Averaging these over drafted blocks compares the rules on a real model pair
with far less noise than counting accepted tokens in sampled runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.verify.base import drafted_laws
from specjax.verify.block import block_weights


def expected_accepted(
  rule: str, draft_tokens: jax.Array, draft_probs: jax.Array, target_probs: jax.Array
) -> jax.Array:
  """`[B]` expected number of accepted drafted tokens under `rule` ("token" or "block").

  Shapes as in the verifiers: draft_tokens `[B, g]`, draft_probs `[B, g, V]`,
  target_probs `[B, g+1, V]`.
  """
  if rule == "token":
    _, _, p, q = drafted_laws(draft_tokens, draft_probs, target_probs)
    keep = jnp.where(q > 0, jnp.minimum(1.0, p / jnp.where(q > 0, q, 1.0)), 0.0)
    return jnp.sum(jnp.cumprod(keep, axis=1), axis=1)
  if rule == "block":
    _, _, h = block_weights(draft_tokens, draft_probs, target_probs)
    g = h.shape[1]
    # P(tau = i) = h_i * prod_{j > i} (1 - h_j): reverse cumulative product.
    later = jnp.cumprod((1.0 - h)[:, ::-1], axis=1)[:, ::-1]
    after = jnp.concatenate([later[:, 1:], jnp.ones_like(later[:, :1])], axis=1)
    return jnp.sum(jnp.arange(1, g + 1) * h * after, axis=1)
  raise ValueError(f"rule must be 'token' or 'block', got {rule!r}.")
