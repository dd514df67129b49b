"""The block drafter's drafter: `DFlashDrafter` drafts a chain (or a token tree) of up to
B - 1 tokens with one `DFlashHead` call, keeping the head's context cache (`DFlashState`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specjax import trees
from specjax.coupling import chain_draws
from specjax.drafting.base import (
  Commit,
  DraftConstraint,
  DrafterBase,
  Proposal,
  VocabSubset,
  draw_chain_token,
)
from specjax.drafting.tree import (
  check_tree_depth,
  check_tree_gamma,
  check_tree_mode,
  draft_depth_tree,
)
from specjax.heads.dflash.model import DFlashHead
from specjax.models.kv_cache import KVCache, check_capacity
from specjax.models.transformer import Transformer
from specjax.sampling import RowSampling, SamplingParams
from specjax.vocab import fit_ids

DRAFT_MODES = ("sample", "argmax")


@struct.dataclass
class DFlashState:
  """The head's context cache: keys and values of s[:-1] (lengths len(s) - 1)."""

  cache: KVCache


@struct.dataclass
class DFlashDrafter(DrafterBase, VocabSubset):
  """Drafts a block of up to B - 1 tokens per iteration with one `DFlashHead` call.

  Attributes:
    target: the target (its embedding and head are shared).
    head: the trained `DFlashHead` for this target's shape.
    draft: "sample" (each token drawn from its position's warped law, q that law)
      or "argmax" (each position's most likely token, q one-hot). At temperature
      0 both draft the argmax.
    vocab_subset: None, or `[K]` ids to draft among (FR-Spec; `with_vocab_subset`).
    tree: None (a chain of gamma tokens), or a static breadth-first token tree
      of depth <= block_size - 1 (`specjax.trees`); then gamma is its number of
      nodes and `draft` does not apply (siblings follow `tree_mode`).
    tree_mode: how a tree's siblings are drawn, "without_replacement" or "iid".
  """

  target: Transformer
  head: DFlashHead
  draft: str = struct.field(pytree_node=False, default="sample")
  vocab_subset: jax.Array | None = None
  tree: tuple[int, ...] | None = struct.field(pytree_node=False, default=None)
  tree_mode: str = struct.field(pytree_node=False, default="without_replacement")

  prefill_calls = 1
  constrained_drafts = True
  takes_tree = True

  def __post_init__(self):
    self.head.cfg.check_target(self.target.cfg)
    if self.draft not in DRAFT_MODES:
      raise ValueError(f"draft must be one of {DRAFT_MODES}, got {self.draft!r}.")
    check_tree_mode(self.tree_mode)
    if self.tree is not None:
      object.__setattr__(self, "tree", trees.check_drafting_tree(self.tree))
      check_tree_depth(self.tree, self.max_tree_depth, "block_size - 1: one block position")

  @property
  def vocab_size(self) -> int:
    return self.target.cfg.vocab_size

  @property
  def target_features(self) -> tuple[int, ...]:
    return self.head.cfg.target_features

  @property
  def block_size(self) -> int:
    """In the `Drafter` protocol's terms (one call drafts block_size - 1 tokens): the
    head's block size B, or B + 1 for a head whose block of B drafts B (anchor-first)."""
    return self.head.drafts_per_call + 1

  @property
  def max_tree_depth(self) -> int:
    """The deepest tree it drafts: one block position per depth."""
    return self.head.drafts_per_call

  def check_capacity(self, prompt_width: int, max_new_tokens: int, gamma: int) -> None:
    most = self.head.drafts_per_call
    if self.tree is not None:
      check_tree_gamma(self.tree, gamma)
    elif not 1 <= gamma <= most:
      raise ValueError(
        f"gamma must be in [1, {most}] for a block drafter of block_size "
        f"{self.head.cfg.block_size} (one call drafts {most} tokens), got {gamma}."
      )
    check_capacity("dflash head", self.target.cfg.max_seq_len, prompt_width, max_new_tokens, gamma)

  def init(self, prompts, prompt_lengths, first, capacity, hidden=None) -> DFlashState:
    del first  # s[-1] enters each block; the context is s[:-1] = the prompt
    if hidden is None:
      raise ValueError("DFlashDrafter.init needs the target's features at the prompt (hidden).")
    b = prompts.shape[0]
    cache = self.head.init_cache(b, capacity)
    cache = self.head.write_context(hidden, cache, jnp.zeros((b,), jnp.int32))
    return DFlashState(cache.with_lengths(prompt_lengths))

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
    if self.tree is not None:
      return self._propose_tree(state, last, key, sampling, constraint), state
    logits = self.head.draft_logits(self.target, state.cache, last, self.vocab_subset, gamma)
    b = logits.shape[0]
    argmax = sampling.greedy or self.draft == "argmax"
    draw = None if argmax else chain_draws(key, gamma, b)
    tokens, probs, rule = [], [], constraint
    for i in range(gamma):  # a static loop over positions: the masks advance in order
      token, q, rule = draw_chain_token(i, logits[:, i], rule, sampling, draw)
      tokens.append(token)
      if q is not None:
        probs.append(q)
    proposal = Proposal(
      jnp.stack(tokens, axis=1),
      jnp.stack(probs, axis=1) if probs else None,
      jnp.minimum(limit, gamma).astype(jnp.int32),
      jnp.int32(1),
    )
    return proposal, state

  def _propose_tree(self, state, last, key, sampling, constraint) -> Proposal:
    depth = len(trees.levels(self.tree))
    # [B, depth, V]: block position d + 1's law gives every depth-d node's children
    logits = self.head.draft_logits(self.target, state.cache, last, self.vocab_subset, depth)
    return draft_depth_tree(self.tree, self.tree_mode, sampling, key, logits, constraint)

  def commit(self, state: DFlashState, commit: Commit) -> DFlashState:
    start = commit.old_length - 1  # the slot of s[-1], the first scored position
    cache = self.head.write_context(commit.hidden, state.cache, start)
    kept = commit.new_length - commit.old_length
    return DFlashState(cache.with_lengths(jnp.where(commit.goes_on, start + kept, start)))
