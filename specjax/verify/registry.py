"""Verifiers by name, for configs and flags; a verifier function works as well."""

from __future__ import annotations

from specjax.verify.base import Verifier
from specjax.verify.block import block_verify
from specjax.verify.coupled import coupled_verify
from specjax.verify.greedy import greedy_verify
from specjax.verify.token import token_verify

VERIFIERS: dict[str, Verifier] = {
  "token": token_verify,
  "block": block_verify,
  "greedy": greedy_verify,
  "coupled": coupled_verify,
}


def get_verifier(verifier: str | Verifier) -> Verifier:
  """A verifier from its name ("token", "block", "greedy", "coupled") or the function itself.

  A function must have the common signature `(key, draft_tokens [B, g],
  draft_probs [B, g, V], target_probs [B, g+1, V]) -> VerifyResult`; it is a
  jit static argument, so pass the same function object to reuse a compilation.
  """
  if callable(verifier):
    return verifier
  if verifier not in VERIFIERS:
    raise ValueError(
      f"verifier must be one of {sorted(VERIFIERS)} or a verifier function, got {verifier!r}."
    )
  return VERIFIERS[verifier]
