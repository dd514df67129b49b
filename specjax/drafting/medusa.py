"""Medusa drafting (Cai et al. 2024, arXiv 2401.10774): K heads on the last feature.

The state is the target's feature at the position that predicted s[-1] (from
the prefill, then from each verification call). Head k maps it to a feature
for the token k positions after s[-1], read through the target's own final
norm and head: x_k ~ q_k, all g tokens from one call, each independent of the
earlier drafted tokens given the prefix. Verification uses q_k itself, so
token and block verification are exact at any temperature (a q that ignores
x_1..x_{k-1} is still a law for x_k given everything before it).

With a `tree` (Medusa's sparse tree, `specjax.trees.from_paths`) a node at depth
d has its children drawn from head d's law, the same whatever the node (the heads
read s only): the top-k of each head at temperature 0, as in the paper, and
sampled top-k (or i.i.d. draws) otherwise, fresh per node. Still one head call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specjax import trees
from specjax.coupling import Coupling, chain_draws
from specjax.drafting.base import (
  Commit,
  ConfidenceLength,
  DraftConstraint,
  Proposal,
  VocabSubset,
  check_confidence,
)
from specjax.drafting.tree import (
  check_tree_depth,
  check_tree_gamma,
  check_tree_mode,
  draft_depth_tree,
)
from specjax.models.heads import MedusaHeads
from specjax.models.transformer import Transformer
from specjax.sampling import SamplingParams, sample_with_uniform, warp_probs


@struct.dataclass
class MedusaDrafter(ConfidenceLength, VocabSubset):
  """Drafts g <= K tokens with `MedusaHeads` in one call (see the module docstring).

  Attributes:
    target: the target (its final norm and head are shared, not copied).
    heads: trained `MedusaHeads` for this target's shape.
    confidence: a row's draft ends at the first head whose top probability
      falls below this (0 disables it).
    vocab_subset: None, or `[K]` ids to draft among (FR-Spec; `with_vocab_subset`).
    tree: None (a chain of gamma tokens), or a static breadth-first token tree
      of depth <= K (`specjax.trees`); then gamma is its number of nodes.
    tree_mode: how a tree's siblings are drawn, "without_replacement" or "iid".
  """

  target: Transformer
  heads: MedusaHeads
  confidence: float = struct.field(pytree_node=False, default=0.0)
  vocab_subset: jax.Array | None = None
  tree: tuple[int, ...] | None = struct.field(pytree_node=False, default=None)
  tree_mode: str = struct.field(pytree_node=False, default="without_replacement")

  prefill_calls = 0  # the prefill's target features are all it needs
  target_features = True
  constrained_drafts = True

  def __post_init__(self):
    self.heads.cfg.check_target(self.target.cfg)
    check_confidence(self.confidence)
    check_tree_mode(self.tree_mode)
    if self.tree is not None:
      object.__setattr__(self, "tree", trees.check_drafting_tree(self.tree))
      check_tree_depth(self.tree, self.max_tree_depth, "one Medusa head")
      if self.confidence > 0:
        raise ValueError("confidence must be 0 with a tree (a tree is drafted whole).")

  @property
  def vocab_size(self) -> int:
    return self.target.cfg.vocab_size

  @property
  def max_tree_depth(self) -> int:
    """The deepest tree it drafts: one head per depth."""
    return self.heads.cfg.num_heads

  def _logits(self, features: jax.Array) -> jax.Array:
    if hasattr(self.heads, "logits"):  # hub heads draft through their own lm_heads
      return self.heads.logits(features, self.vocab_subset)
    return VocabSubset._logits(self, features)

  def check_capacity(self, prompt_width: int, max_new_tokens: int, gamma: int) -> None:
    del prompt_width, max_new_tokens  # no cache of its own
    if self.tree is not None:
      return check_tree_gamma(self.tree, gamma)
    k = self.heads.cfg.num_heads
    if gamma > k:
      raise ValueError(f"gamma must be in [1, {k}] for {k} Medusa heads, got {gamma}.")

  def init(self, prompts, prompt_lengths, first, capacity, hidden=None) -> jax.Array:
    if hidden is None:
      raise ValueError("MedusaDrafter.init needs the target's features at the prompt (hidden).")
    return jnp.take_along_axis(hidden, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]

  def propose(
    self,
    feature: jax.Array,
    recent: jax.Array,
    key: jax.Array,
    limit: jax.Array,
    *,
    gamma: int,
    sampling: SamplingParams,
    constraint: DraftConstraint | None = None,
  ) -> tuple[Proposal, jax.Array]:
    del recent
    if self.tree is not None:
      return self._propose_tree(feature, key, sampling, constraint), feature
    b, g = limit.shape[0], gamma
    logits = self._logits(self.heads(feature, num_heads=g))  # [B, g, V]
    proposed = jnp.arange(g)[None, :] < limit[:, None]
    if constraint is not None:  # head i's law masked by the state tokens 1..i-1 reach
      return self._propose_constrained(logits, proposed, key, sampling, constraint), feature
    if sampling.greedy:
      tokens, probs = jnp.argmax(logits, axis=-1).astype(jnp.int32), None
    else:
      probs = warp_probs(logits, sampling)
      if isinstance(key, Coupling):
        draw_token = chain_draws(key, g, b)
        tokens = jnp.stack([draw_token(i, probs[:, i]) for i in range(g)], axis=1)
      else:
        tokens = sample_with_uniform(jax.random.uniform(key, (b, g), jnp.float32), probs)
      if self.confidence > 0:
        proposed &= jnp.max(probs, axis=-1) >= self.confidence
    return Proposal(tokens, probs, _leading(proposed), calls=jnp.int32(1)), feature

  def _propose_constrained(self, logits, proposed, key, sampling, rule: DraftConstraint):
    """The chain under a constraint: the heads' laws are masked one position at a
    time, since each position's state depends on the tokens drawn before it."""
    b, g = proposed.shape
    if not sampling.greedy:
      if isinstance(key, Coupling):
        draw_token = chain_draws(key, g, b)
      else:  # the unconstrained chain's uniforms, position by position
        uniforms = jax.random.uniform(key, (b, g), jnp.float32)
        draw_token = lambda i, q: sample_with_uniform(uniforms[:, i], q)
    tokens, probs = [], []
    for i in range(g):
      masked = rule.logits(logits[:, i])
      if sampling.greedy:
        token = jnp.argmax(masked, axis=-1).astype(jnp.int32)
      else:
        q = warp_probs(masked, sampling)
        token = draw_token(i, q)
        probs.append(q)
        if self.confidence > 0:
          confident = jnp.max(q, axis=-1) >= self.confidence
          proposed = proposed.at[:, i].set(proposed[:, i] & confident)
      tokens.append(token)
      rule = rule.after(token)
    probs = jnp.stack(probs, axis=1) if probs else None
    return Proposal(jnp.stack(tokens, axis=1), probs, _leading(proposed), calls=jnp.int32(1))

  def _propose_tree(
    self,
    feature: jax.Array,
    key: jax.Array,
    sampling: SamplingParams,
    constraint: DraftConstraint | None = None,
  ):
    depth = len(trees.levels(self.tree))
    logits = self._logits(self.heads(feature, num_heads=depth))  # [B, depth, V]: head d
    return draft_depth_tree(self.tree, self.tree_mode, sampling, key, logits, constraint)

  def commit(self, feature: jax.Array, commit: Commit) -> jax.Array:
    kept = commit.new_length - commit.old_length  # n + 1; hidden[n] predicted s'[-1]
    new = jnp.take_along_axis(commit.hidden, (kept - 1)[:, None, None], axis=1)[:, 0]
    return jnp.where(commit.goes_on[:, None], new, feature)


def _leading(proposed: jax.Array) -> jax.Array:
  """`[B]` a row's draft length: its leading run of proposed heads (`proposed [B, g]`)."""
  return jnp.sum(jnp.cumprod(proposed, axis=1), axis=1).astype(jnp.int32)
