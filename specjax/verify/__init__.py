"""Verification rules: which drafted tokens to keep, and the token that follows.

Every verifier has one signature, so `speculative_step` can take any of them:

  verifier(key, draft_tokens [B, g], draft_probs [B, g, V], target_probs [B, g+1, V])
      -> VerifyResult(num_accepted [B], next_token [B])

`draft_probs[:, i]` is the distribution `draft_tokens[:, i]` was drawn from and
`target_probs[:, i]` the target's (same warp) at that position; the extra last
row of `target_probs` is the target's distribution after all g drafted tokens.
"""

from specjax.verify.base import VerifyResult, Verifier, get_verifier
from specjax.verify.block import block_verify
from specjax.verify.greedy import greedy_verify
from specjax.verify.token import token_verify

__all__ = ["VerifyResult", "Verifier", "block_verify", "get_verifier", "greedy_verify",
           "token_verify"]
