"""Verification rules: which drafted tokens to keep, and the token that follows.

Every verifier has one signature, so `speculative_step` can take any of them:

  verifier(key, draft_tokens [B, g], draft_probs [B, g, V], target_probs [B, g+1, V])
      -> VerifyResult(num_accepted [B], next_token [B])

`draft_probs[:, i]` is the law `draft_tokens[:, i]` was drawn from, and
`target_probs[:, i]` the target's (same warp) there; its last row is the law
after all g. Rules: `token_verify`, `block_verify`, `greedy_verify`, and
`tree_verify` for token trees (its own signature); `coupled_verify` and
`coupled_tree_verify` take a `specjax.coupling.Coupling` (per-row noise) as key.
"""

from specjax.verify.base import Verifier, VerifyResult
from specjax.verify.block import block_verify
from specjax.verify.coupled import coupled_tree_verify, coupled_verify
from specjax.verify.greedy import greedy_verify
from specjax.verify.registry import VERIFIERS, get_verifier
from specjax.verify.token import token_verify
from specjax.verify.tree import TreeVerifyResult, tree_verify

__all__ = [
  "VERIFIERS",
  "TreeVerifyResult",
  "VerifyResult",
  "Verifier",
  "block_verify",
  "coupled_tree_verify",
  "coupled_verify",
  "get_verifier",
  "greedy_verify",
  "token_verify",
  "tree_verify",
]
