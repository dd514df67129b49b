"""Drafters: the ways of proposing tokens that `speculative_step` verifies.

  ModelDrafter(model)           a small draft model (any `Transformer`)
  layer_skip(target, k)         the target's first k layers + its head (self-speculation)
  NGramDrafter(vocab_size, n)   prompt lookup: copy what followed the last n-gram

All share the `Drafter` protocol (`specjax.drafting.base`); `as_drafter` turns a
plain `Transformer` into a `ModelDrafter`.
"""

from specjax.drafting.base import Commit, Drafter, DrafterBase, Proposal, proposal_probs
from specjax.drafting.model import ModelDrafter, as_drafter, layer_skip
from specjax.drafting.ngram import NGramDrafter, lookup

__all__ = [
  "Commit",
  "Drafter",
  "DrafterBase",
  "ModelDrafter",
  "NGramDrafter",
  "Proposal",
  "as_drafter",
  "layer_skip",
  "lookup",
  "proposal_probs",
]
