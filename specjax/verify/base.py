"""What every verifier shares: the result type, the protocol and the input rules.

Inputs are checked in two ways. Shapes are static, so `check_inputs` raises a
`ValueError` naming the argument at trace time, before anything is compiled.
Values are data, so `drafted_laws` turns anything a correct drafter cannot
produce (a token outside [0, V), a non-finite or non-positive q(x)) into a
rejection at that position, never an acceptance.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np


class VerifyResult(NamedTuple):
  """What one verification decides for each row.

  Attributes:
    num_accepted: `[B]` int32 in [0, g], the length of the accepted draft prefix.
    next_token: `[B]` int32, the correction drawn after the first rejection, or
      the bonus token drawn from `target_probs[:, g]` when all g were accepted.
  """

  num_accepted: jax.Array
  next_token: jax.Array


class Verifier(Protocol):
  """verifier(key, draft_tokens [B, g], draft_probs [B, g, V], target_probs [B, g+1, V])."""

  def __call__(
    self, key: jax.Array, draft_tokens: jax.Array, draft_probs: jax.Array, target_probs: jax.Array
  ) -> VerifyResult: ...


def _shape(name: str, x) -> tuple[int, ...]:
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise ValueError(f"{name} must be an array, got {type(x).__name__}.")
  return tuple(x.shape)


def check_inputs(
  draft_tokens, draft_probs, target_probs, *, probs_optional: bool = False
) -> tuple[int, int, int]:
  """Checks the verifier arguments' ranks, dtypes and shapes; returns (B, g, V).

  Raises:
    ValueError naming the argument: draft_tokens must be integer `[B, g]`,
    draft_probs float `[B, g, V]` (None allowed only if `probs_optional`),
    target_probs float `[B, g + 1, V]` (the last row is the bonus position).
  """
  tokens_shape = _shape("draft_tokens", draft_tokens)
  if len(tokens_shape) != 2 or not np.issubdtype(draft_tokens.dtype, np.integer):
    raise ValueError(
      f"draft_tokens must be an integer array [B, g], got {draft_tokens.dtype}{list(tokens_shape)}."
    )
  b, g = tokens_shape
  target_shape = _shape("target_probs", target_probs)
  if len(target_shape) != 3 or not jnp.issubdtype(target_probs.dtype, jnp.floating):
    raise ValueError(
      "target_probs must be a float array [B, g + 1, V], got "
      f"{target_probs.dtype}{list(target_shape)}."
    )
  if target_shape[:2] != (b, g + 1):
    raise ValueError(
      f"target_probs must have shape [B={b}, g + 1={g + 1}, V] to match "
      f"draft_tokens [{b}, {g}] (one row per drafted token plus the bonus "
      f"row), got {list(target_shape)}."
    )
  v = target_shape[2]
  if v < 1:
    raise ValueError(f"target_probs must have a vocabulary axis V >= 1, got {list(target_shape)}.")
  if draft_probs is None:
    if not probs_optional:
      raise ValueError("draft_probs must be a float array [B, g, V], got None.")
    return b, g, v
  probs_shape = _shape("draft_probs", draft_probs)
  if len(probs_shape) != 3 or not jnp.issubdtype(draft_probs.dtype, jnp.floating):
    raise ValueError(
      f"draft_probs must be a float array [B, g, V], got {draft_probs.dtype}{list(probs_shape)}."
    )
  if probs_shape != (b, g, v):
    raise ValueError(
      f"draft_probs must have shape [B={b}, g={g}, V={v}] to match "
      f"draft_tokens and target_probs, got {list(probs_shape)}."
    )
  return b, g, v


class DraftedLaws(NamedTuple):
  """The laws along a drafted block, cleaned of what no drafter can produce.

  Attributes:
    p: `[B, g+1, V]` float32 target law.
    q: `[B, g, V]` float32 draft law, non-finite entries set to 0.
    p_x: `[B, g]` p(x_i) of each drafted token (0 where the token is invalid).
    q_x: `[B, g]` q(x_i); 0 wherever x_i must be rejected: outside [0, V),
      or q(x_i) non-finite or <= 0.
  """

  p: jax.Array
  q: jax.Array
  p_x: jax.Array
  q_x: jax.Array


def drafted_laws(
  draft_tokens: jax.Array, draft_probs: jax.Array, target_probs: jax.Array
) -> DraftedLaws:
  """Gathers p(x_i) and q(x_i), mapping every impossible draft to q(x_i) = 0 (a
  rejection, as for unproposed positions); ids outside [0, V) are never gathered
  (a negative id would wrap around)."""

  g, v = draft_tokens.shape[1], target_probs.shape[-1]
  p = target_probs.astype(jnp.float32)
  q = draft_probs.astype(jnp.float32)
  finite_q = jnp.isfinite(q)
  q = jnp.where(finite_q, q, 0.0)
  in_vocab = (draft_tokens >= 0) & (draft_tokens < v)
  index = jnp.where(in_vocab, draft_tokens, 0)[..., None]
  p_x = jnp.take_along_axis(p[:, :g], index, axis=-1)[..., 0]
  q_x = jnp.take_along_axis(q, index, axis=-1)[..., 0]
  # A row of q with any non-finite entry is not a law: reject its token too.
  valid = in_vocab & jnp.all(finite_q, axis=-1) & (q_x > 0)
  return DraftedLaws(p, q, jnp.where(valid, p_x, 0.0), jnp.where(valid, q_x, 0.0))


def accepted_prefix_length(accept: jax.Array) -> jax.Array:
  """`[B, g]` bool per-position acceptance -> `[B]` int32 length of the all-True prefix."""
  return jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def check_key(key) -> None:
  """Sampling verifiers need a PRNG key: a typed key or raw `uint32[2]` key data."""
  if isinstance(key, jax.Array):
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) and key.shape == ():
      return
    if key.dtype == jnp.uint32 and key.shape == (2,):
      return
  raise ValueError(f"key must be a single jax.random.key(...), got {key!r}.")
