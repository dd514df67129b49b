"""The sequential block drafter's drafter: `DSparkDrafter` drafts with one `DSparkHead`
call, each token from its position's law corrected by the token drafted before it,
and hands the iteration the confidence head's estimates."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specjax import trees
from specjax.coupling import chain_draws
from specjax.drafting.base import (
  ConfidenceLength,
  DraftConstraint,
  Proposal,
  draw_chain_token,
)
from specjax.drafting.tree import draft_tree
from specjax.heads.dflash.drafter import DFlashDrafter, DFlashState
from specjax.sampling import RowSampling, SamplingParams
from specjax.vocab import fit_ids


@struct.dataclass
class DSparkDrafter(DFlashDrafter, ConfidenceLength):
  """Drafts a block of up to B - 1 tokens per iteration with one `DSparkHead` call,
  each token drawn from its position's law corrected by the token drafted before it.

  Attributes (besides `DFlashDrafter`'s):
    confidence: adaptive "confidence" threshold (`with_confidence`): a row drafts
      only the leading tokens whose survival (the running product of the
      confidence head's estimates) is at least this; 0 drafts gamma.
  """

  confidence: float = struct.field(pytree_node=False, default=0.0)
  gives_confidence = True  # its chains carry the confidence head's estimates

  def propose(
    self,
    state: DFlashState,
    recent: jax.Array,
    key: jax.Array,
    limit: jax.Array,
    *,
    gamma: int,
    sampling: SamplingParams | RowSampling,
    constraint: DraftConstraint | None = None,
  ) -> tuple[Proposal, DFlashState]:
    last = fit_ids(recent[:, -1], self.vocab_size)
    head = self.head
    if self.tree is not None:
      return self._propose_tree(state, last, key, sampling, constraint), state
    h = head.draft_hidden(self.target, state.cache, last, gamma)  # [B, g, D]
    base = head.logits(self.target, h, self.vocab_subset)  # [B, g, V]
    b = base.shape[0]
    argmax = sampling.greedy or self.draft == "argmax"
    draw = None if argmax else chain_draws(key, gamma, b)
    tokens, probs, confidence, rule, previous = [], [], [], constraint, last
    for i in range(gamma):  # sequential: each law is corrected by the token before it
      embed = head.markov_embed(previous)
      law = head.corrected(base[:, i], embed, first=i == 0)
      token, q, rule = draw_chain_token(i, law, rule, sampling, draw)
      confidence.append(jax.nn.sigmoid(head.confidence_logit(h[:, i], embed)))
      tokens.append(token)
      if q is not None:
        probs.append(q)
      previous = token
    confidence = jnp.stack(confidence, axis=1)  # [B, g]
    lengths = jnp.minimum(limit, gamma).astype(jnp.int32)
    if self.confidence > 0:  # at least one draft; then while the survival holds
      survival = jnp.cumprod(confidence, axis=1)
      keep = (survival >= self.confidence).at[:, 0].set(True)
      lengths = jnp.minimum(lengths, jnp.cumprod(keep, axis=1).sum(1).astype(jnp.int32))
    proposal = Proposal(
      jnp.stack(tokens, axis=1),
      jnp.stack(probs, axis=1) if probs else None,
      lengths,
      jnp.int32(1),
      confidence=confidence,
    )
    return proposal, state

  def _propose_tree(self, state, last, key, sampling, constraint) -> Proposal:
    head, parents = self.head, self.tree
    depths = trees.tree_depths(parents)
    h = head.draft_hidden(self.target, state.cache, last, len(trees.levels(parents)))
    base = head.logits(self.target, h, self.vocab_subset)  # [B, depth, V]

    def read(start, stop, tokens):  # a depth's nodes: their children's corrected laws
      d = depths[start]  # the nodes' depth, 1 for the root's children: base row d
      return head.corrected(base[:, d : d + 1], head.markov_embed(tokens))

    root = head.corrected(base[:, 0], head.markov_embed(last), first=True)
    tokens, probs = draft_tree(parents, self.tree_mode, sampling, key, root, read, constraint)
    lengths = jnp.full((base.shape[0],), len(parents), jnp.int32)
    return Proposal(tokens, probs, lengths, jnp.int32(1), trees.Tree.static(parents))
