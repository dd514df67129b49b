"""Drafters: the ways of proposing tokens that `speculative_step` verifies.

  ModelDrafter(model)           a small draft model (any `Transformer`)
  layer_skip(target, k)         the target's first k layers + its head (self-speculation)
  NGramDrafter(vocab_size, n)   prompt lookup: copy what followed the last n-gram
  count_drafter(docs, V, order) a unigram or bigram model of a corpus (CountDrafter)
  CrossTokenizerDrafter(draft, draft_tok, target_tok)
                                a draft model of another tokenizer, drafting the
                                tokens both vocabularies share (TLI)
  TreeDrafter(model, tree)      a draft model drafting a token tree (`specjax.trees`)

The drafters of draft heads (EAGLE, Medusa, early exit, the block drafter, ...) live
with their heads, one file per kind in `specjax.heads` (`heads.drafter(target, head)`).

Under a constraint (`specjax.constraints`) drafters with `constrained_drafts`
draw among the tokens the constraint allows (`DraftConstraint`): q is masked
like p. All share the `Drafter` protocol (`specjax.drafting.base`); `as_drafter` turns a
plain `Transformer` into a `ModelDrafter`, and `check_drafter` checks a drafter
against a run (capacity, target, tree rules) before anything compiles. A
drafter's loop over its draft positions goes through `draft_loop`, which the
chunked generation loop runs with a known trip count (`fixed_trip_loops`).
"""

from specjax.drafting.base import (
  Commit,
  DraftConstraint,
  Drafter,
  DrafterBase,
  Proposal,
  chain_confidence,
  draft_loop,
  fixed_trip_loops,
  proposal_probs,
)
from specjax.drafting.counts import CountDrafter, count_drafter
from specjax.drafting.cross_tokenizer import CrossTokenizerDrafter
from specjax.drafting.model import ModelDrafter, as_drafter, check_drafter, layer_skip
from specjax.drafting.ngram import NGramDrafter, lookup
from specjax.drafting.tree import TreeDrafter

__all__ = [
  "chain_confidence",
  "Commit",
  "CountDrafter",
  "CrossTokenizerDrafter",
  "DraftConstraint",
  "Drafter",
  "DrafterBase",
  "ModelDrafter",
  "NGramDrafter",
  "Proposal",
  "TreeDrafter",
  "as_drafter",
  "check_drafter",
  "count_drafter",
  "draft_loop",
  "fixed_trip_loops",
  "layer_skip",
  "lookup",
  "proposal_probs",
]
