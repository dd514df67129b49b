"""Exact block verification (Sun et al. 2024, "Block verification accelerates
speculative decoding", arXiv 2403.10444).

Token verification decides each drafted token on its own and stops at the
first rejection. Block verification decides the accepted prefix jointly: it
carries the running weight p_i = min(1, p_{i-1} p(x_i) / q(x_i)) (p_0 = 1) and
accepts the longest prefix whose independent coin eta_i ~ Bernoulli(h_i)
comes up heads, where

  h_i = S_i / (S_i + 1 - p_i),  S_i = sum_x max(0, p_i p(x | x_<=i) - q(x | x_<=i))

for i < g and h_g = p_g. After accepting tau tokens it emits y from
normalize(max(0, p_tau p(. | x_<=tau) - q(. | x_<=tau))), or from p after all g.
The output has the target's distribution exactly, and the expected number of
accepted tokens is never below token verification's for the same draft.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.sampling import sample_with_uniform
from specjax.verify.base import VerifyResult, check_inputs, check_key, drafted_laws


def block_weights(
  draft_tokens: jax.Array, draft_probs: jax.Array, target_probs: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The quantities of the block rule, exposed for tests and analysis.

  Returns:
    `weights [B, g+1]` (p_0..p_g), `residual [B, g, V]` (max(0, p_i p_i(.) - q_i(.))
    for i = 0..g-1) and `h [B, g]` (h_1..h_g, the acceptance-coin probabilities).
  """
  g = draft_tokens.shape[1]
  p, q, p_x, q_x = drafted_laws(draft_tokens, draft_probs, target_probs)
  # q(x) = 0 means x cannot have come from q: give it weight 0, so S_i = 0 and
  # h_i = 0 (a rejection).
  ratio = jnp.where(q_x > 0, p_x / jnp.where(q_x > 0, q_x, 1.0), 0.0)
  weights = [jnp.ones(ratio.shape[:1], jnp.float32)]
  for i in range(g):  # g is static and small
    weights.append(jnp.minimum(1.0, weights[-1] * ratio[:, i]))
  weights = jnp.stack(weights, axis=1)
  residual = jnp.maximum(weights[:, :g, None] * p[:, :g] - q, 0.0)
  s = residual.sum(-1)
  denom = s + 1.0 - weights[:, :g]
  # denom = 0 only when p_i = 1 and S_i = 0; the limit of h_i at p_i -> 1 is 1.
  h_inner = jnp.where(denom > 0, s / jnp.where(denom > 0, denom, 1.0), 1.0)
  h = jnp.concatenate([h_inner[:, 1:], weights[:, g:]], axis=1)
  return weights, residual, h


def block_verify(
  key: jax.Array, draft_tokens: jax.Array, draft_probs: jax.Array, target_probs: jax.Array
) -> VerifyResult:
  """Exact block verification of a drafted block, vectorised over rows.

  Args:
    key: PRNG key; all randomness of this call comes from it.
    draft_tokens: `[B, g]` int32, x_i drawn from `draft_probs[:, i]` (g >= 0).
    draft_probs: `[B, g, V]` q at each drafted position.
    target_probs: `[B, g+1, V]` p at the same positions plus one.

  Returns:
    `VerifyResult(num_accepted [B] in [0, g], next_token [B])`.

  Raises:
    ValueError naming the argument when shapes or dtypes disagree.
  """
  b, g, _ = check_inputs(draft_tokens, draft_probs, target_probs)
  check_key(key)
  # One random-bit computation: g coins, then the emitted token's uniform.
  u = jax.random.uniform(key, (b, g + 1), jnp.float32)
  if g == 0:  # nothing drafted: the bonus token alone
    return VerifyResult(
      jnp.zeros((b,), jnp.int32),
      sample_with_uniform(u[:, 0], target_probs[:, 0].astype(jnp.float32)),
    )
  _, residual, h = block_weights(draft_tokens, draft_probs, target_probs)
  # Every coin is drawn (no early stop): tau is the last heads, 0 if none.
  heads = u[:, :g] < h
  tau = jnp.max(jnp.where(heads, jnp.arange(1, g + 1), 0), axis=1).astype(jnp.int32)

  p = target_probs.astype(jnp.float32)
  residual = jnp.concatenate([residual, jnp.zeros_like(residual[:, :1])], axis=1)
  r_tau = jnp.take_along_axis(residual, tau[:, None, None], axis=1)[:, 0]  # [B, V]
  p_tau = jnp.take_along_axis(p, tau[:, None, None], axis=1)[:, 0]
  mass = jnp.sum(r_tau, axis=-1, keepdims=True)
  # tau = g has a zero residual row, so it falls back to p_g: the bonus token.
  dist = jnp.where(mass > 0, r_tau / jnp.where(mass > 0, mass, 1.0), p_tau)
  return VerifyResult(tau, sample_with_uniform(u[:, g], dist))
