"""Verification rules: which drafted tokens to keep, and the token that follows.

Every verifier has one signature, so `speculative_step` can take any of them:

  verifier(key, draft_tokens [B, g], draft_probs [B, g, V], target_probs [B, g+1, V])
      -> VerifyResult(num_accepted [B], next_token [B])

`draft_probs[:, i]` is the distribution `draft_tokens[:, i]` was drawn from and
`target_probs[:, i]` the target's (same warp) at that position; the extra last
row of `target_probs` is the target's distribution after all g drafted tokens.

  base.py      result type, protocol, input checks and the rejection conventions
  token.py     token_verify   (Leviathan et al. 2023; Chen et al. 2023)
  block.py     block_verify   (Sun et al. 2024)
  greedy.py    greedy_verify  (temperature 0)
  tree.py      tree_verify    token trees, own signature (SpecInfer; Jeon et al. 2024)
  expected.py  closed-form expected accepted tokens per rule
  registry.py  names -> functions (`get_verifier`)
"""

from specjax.verify.base import Verifier, VerifyResult
from specjax.verify.block import block_verify
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
  "get_verifier",
  "greedy_verify",
  "token_verify",
  "tree_verify",
]
