"""The verifier result type, protocol and registry."""

from __future__ import annotations

from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp


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
  def __call__(self, key: jax.Array, draft_tokens: jax.Array, draft_probs: jax.Array,
               target_probs: jax.Array) -> VerifyResult:
    ...


def accepted_prefix_length(accept: jax.Array) -> jax.Array:
  """`[B, g]` bool per-position acceptance -> `[B]` int32 length of the all-True prefix."""
  return jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def get_verifier(name: str) -> Verifier:
  """Looks a verifier up by name: "token", "block" or "greedy"."""
  from specjax.verify.block import block_verify
  from specjax.verify.greedy import greedy_verify
  from specjax.verify.token import token_verify
  verifiers = {"token": token_verify, "block": block_verify, "greedy": greedy_verify}
  if name not in verifiers:
    raise ValueError(f"verifier must be one of {sorted(verifiers)}, got {name!r}.")
  return verifiers[name]
