"""Drafting with a model of another tokenizer: token-level intersection (TLI).

Timor et al. 2025 (arXiv 2502.05202): the draft's law restricted to the tokens
whose text both vocabularies hold, renormalised, is a law over target ids
(`specjax.vocab_map`), so verification stays exact at any temperature.

The draft reads the committed sequence s as D(s), each target id's expansion in
draft ids (`VocabMap.expansion`). Its cache holds D(s[:-2]) (`base` slots);
each iteration first feeds D(s[-2]) D(s[-1]) (at most 2L ids, L =
`VocabMap.max_expansion`, one static shape). The cache gets `cache_ratio` draft
slots per target slot plus 2L (at most max_seq_len); a row whose next iteration
would not fit stops drafting (the output is unchanged). Why D(s) rather than a
canonical re-tokenisation, and the measurements: docs/cross_tokenizer.md.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.drafting.base import Commit, Proposal, check_confidence
from specjax.drafting.model import CachedDrafting
from specjax.models.kv_cache import KVCache, check_capacity
from specjax.models.transformer import Transformer
from specjax.validation import is_real
from specjax.vocab_map import VocabMap, backend_of, build_vocab_map, check_size


@struct.dataclass
class CrossTokenizerState:
  """The draft's cache of D(s[:-2]) and the bookkeeping that keeps it in step.

  Attributes:
    cache: the draft's `KVCache` over draft ids.
    base: `[B]` int32, len(D(s[:-2])): where the next iteration's first call writes.
    fed: `[B, 2]` int32, draft ids of s[-2] and s[-1] that call fed.
  """

  cache: KVCache
  base: jax.Array
  fed: jax.Array


@struct.dataclass
class VocabTables:
  """`VocabMap` as device arrays, plus one fallback row for ids past the target
  tokenizer (a target model's padding rows)."""

  logit_index: jax.Array  # [V_t] the draft id of each target id; V_d (an extra -inf) off it
  expansion: jax.Array  # [V_t + 1, L]
  expansion_lengths: jax.Array  # [V_t + 1]

  @classmethod
  def from_map(cls, vocab_map: VocabMap) -> VocabTables:
    t2d = vocab_map.target_to_draft
    fallback = np.full_like(vocab_map.expansion[:1], vocab_map.fallback)
    return cls(
      logit_index=jnp.asarray(np.where(t2d >= 0, t2d, vocab_map.draft_to_target.size)),
      expansion=jnp.asarray(np.concatenate([vocab_map.expansion, fallback])),
      expansion_lengths=jnp.asarray(np.append(vocab_map.expansion_lengths, 1).astype(np.int32)),
    )


@struct.dataclass
class CrossTokenizerDrafter(CachedDrafting):
  """A draft `Transformer` with its own tokenizer, drafting through the shared tokens.

    drafter = CrossTokenizerDrafter(draft, draft_tokenizer, target_tokenizer)
    specjax.speculative_generate(target, drafter, prompts, lengths, gamma=4, ...)

  Attributes:
    model: the draft model; its vocab_size must cover `draft_tokenizer`.
    draft_tokenizer, target_tokenizer: static, hashed by identity.
    tables: built from the tokenizers when None (`specjax.vocab_map`).
    confidence: the adaptive "confidence" threshold (0 = off).

    cache_ratio: draft cache slots per target cache slot (> 0), static.

  """

  model: Transformer
  draft_tokenizer: Any = struct.field(pytree_node=False)
  target_tokenizer: Any = struct.field(pytree_node=False)
  tables: VocabTables | None = None
  confidence: float = struct.field(pytree_node=False, default=0.0)
  cache_ratio: float = struct.field(pytree_node=False, default=2.0)
  vocab_size: int = struct.field(pytree_node=False, default=0)
  shared: int = struct.field(pytree_node=False, default=0)
  report: tuple = struct.field(pytree_node=False, default=())

  def __post_init__(self):
    if self.tables is not None:  # an unflattened copy: already checked
      return
    if not isinstance(self.model, Transformer):
      raise ValueError(f"draft must be a specjax.Transformer, got {type(self.model).__name__}.")
    check_confidence(self.confidence)
    if not is_real(self.cache_ratio) or not self.cache_ratio > 0:
      raise ValueError(f"cache_ratio must be a number > 0, got {self.cache_ratio!r}.")
    for name in ("draft_tokenizer", "target_tokenizer"):
      try:
        backend_of(getattr(self, name))
      except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    vocab_map = build_vocab_map(
      self.draft_tokenizer, self.target_tokenizer, draft_vocab_size=self.model.cfg.vocab_size
    )
    object.__setattr__(self, "tables", VocabTables.from_map(vocab_map))
    object.__setattr__(self, "vocab_size", int(vocab_map.target_to_draft.size))
    object.__setattr__(self, "shared", vocab_map.shared)
    object.__setattr__(self, "report", tuple(vocab_map.report().items()))

  def vocab_report(self) -> dict[str, Any]:
    """`VocabMap.report()` of the pair: shared ids, expansion lengths, coverage."""
    return dict(self.report)

  @property
  def max_expansion(self) -> int:
    return int(self.tables.expansion.shape[1])

  def check_target(self, target: Transformer) -> None:
    """ValueError unless the target model has a row for every target-tokenizer id."""
    check_size("target_tokenizer", self.vocab_size, target.cfg.vocab_size)

  def check_capacity(self, prompt_width: int, max_new_tokens: int, gamma: int) -> None:
    # The target's capacity is the least the draft needs (rows may still run out
    # of draft slots later, see the module docstring).
    check_capacity("draft", self.model.cfg.max_seq_len, prompt_width, max_new_tokens, gamma)

  # -- the draft's view of target ids ------------------------------------------------

  def _rows(self, tokens: jax.Array) -> jax.Array:
    """Rows of the expansion table: ids past the target tokenizer use the last one."""
    return jnp.clip(tokens, 0, self.vocab_size)

  def _pack(self, tokens: jax.Array, lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
    """D of each row's first `lengths[b]` target ids, left-packed.

    Args:
      tokens: `[B, T]` target ids; lengths `[B]` in [0, T].

    Returns:
      `(draft_ids [B, T * L], per_token [B, T])`: the draft ids (padding after
      them), and how many each target id became (0 past `lengths`).
    """
    b, t = tokens.shape
    width = t * self.max_expansion
    rows = self._rows(tokens)
    counts = self.tables.expansion_lengths[rows] * (jnp.arange(t)[None, :] < lengths[:, None])
    start = jnp.cumsum(counts, axis=1) - counts
    slot = start[:, :, None] + jnp.arange(self.max_expansion)[None, None, :]
    slot = jnp.where(jnp.arange(self.max_expansion) < counts[:, :, None], slot, width)
    ids = jnp.zeros((b, width), jnp.int32)
    ids = jax.vmap(lambda row, s, x: row.at[s.ravel()].set(x.ravel(), mode="drop"))(
      ids, slot, self.tables.expansion[rows]
    )
    return ids, counts

  # -- CachedDrafting's hooks --------------------------------------------------------------

  def _new_state(self, batch: int, capacity: int) -> CrossTokenizerState:
    # The target's capacity already has one iteration's slack; 2L more for the
    # first call of an iteration.
    slots = math.ceil(self.cache_ratio * capacity) + 2 * self.max_expansion
    slots = min(slots, self.model.cfg.max_seq_len)
    zeros = jnp.zeros((batch,), jnp.int32)
    return CrossTokenizerState(
      self.model.init_cache(batch, slots), zeros, jnp.zeros((batch, 2), jnp.int32)
    )

  def _with_lengths(self, state: CrossTokenizerState, lengths: jax.Array):
    return state.replace(cache=state.cache.with_lengths(lengths))

  def _forward(self, tokens, state: CrossTokenizerState, logit_indices=None):
    """Feeds drafted (shared) target ids, one draft id each; logits over target ids."""
    draft_ids = self.tables.expansion[self._rows(tokens), 0]
    logits, cache = self.model.forward_cached(draft_ids, state.cache, logit_indices)
    return self._target_logits(logits), state.replace(cache=cache)

  def _target_logits(self, logits: jax.Array) -> jax.Array:
    """`[..., V_d]` draft logits -> `[..., V_t]`: the shared ids' logits at their target
    ids, -inf elsewhere (so any warp of them is the restricted, renormalised law)."""
    # A gather (one per target id), not a scatter: cheaper on every backend.
    padded = jnp.pad(logits, [(0, 0)] * (logits.ndim - 1) + [(0, 1)], constant_values=-jnp.inf)
    return jnp.take(padded, self.tables.logit_index, axis=-1)

  def _fits(self, state: CrossTokenizerState, gamma: int) -> jax.Array:
    """`[B]` rows whose next iteration's writes fit in the draft's cache."""
    return state.base + 2 * self.max_expansion + gamma <= state.cache.capacity

  def _feed_recent(self, recent: jax.Array, state: CrossTokenizerState, gamma: int):
    b = recent.shape[0]
    ids, counts = self._pack(recent, jnp.full((b,), 2, jnp.int32))
    fed = counts.sum(axis=1)
    # A row that no longer fits writes at slot 0 (in bounds); it drafts nothing.
    start = jnp.where(self._fits(state, gamma), state.base, 0)
    logits, cache = self.model.forward_cached(
      ids, state.cache.with_lengths(start), (fed - 1)[:, None]
    )
    state = CrossTokenizerState(cache.with_lengths(start + fed), state.base, counts)
    return self._target_logits(logits), state

  # -- the Drafter protocol ------------------------------------------------------------------

  def init(self, prompts, prompt_lengths, first, capacity, hidden=None):
    del first, hidden
    b = prompts.shape[0]
    state = self._new_state(b, capacity)
    ids, counts = self._pack(prompts, prompt_lengths)
    # A prompt longer than the draft's cache in draft ids is cut (that row then
    # never fits, so it never drafts).
    ids = ids[:, : state.cache.capacity]
    _, cache = self.model.forward_cached(ids, state.cache, jnp.zeros((b, 1), jnp.int32))
    # D(s[:-2]) with s = prompt + first: all but the prompt's last token.
    base = counts.sum(axis=1) - jnp.take_along_axis(counts, (prompt_lengths - 1)[:, None], 1)[:, 0]
    return CrossTokenizerState(cache.with_lengths(base), base, state.fed)

  def propose(self, state, recent, key, limit, *, gamma, sampling, constraint=None):
    """`CachedDrafting.propose` over the shared ids (its logits are over target ids,
    so a `constraint` masks them as it masks the target's); rows whose cache is
    full, and every row when the tokenizers share no token, propose nothing."""
    if not self.shared:
      b = recent.shape[0]
      zeros = jnp.zeros((b, gamma), jnp.int32)
      empty = jnp.zeros((b,), jnp.int32)
      return Proposal(
        zeros, None, empty, jnp.int32(0), confidence=jnp.zeros((b, gamma), jnp.float32)
      ), state
    limit = jnp.where(self._fits(state, gamma), limit, 0)
    return super().propose(
      state, recent, key, limit, gamma=gamma, sampling=sampling, constraint=constraint
    )

  def commit(self, state: CrossTokenizerState, commit: Commit) -> CrossTokenizerState:
    """base += draft ids of s[-2], s[-1] and the accepted tokens before the last two
    of s' (the new s[:-2]); rows that stopped keep theirs."""

    kept = commit.new_length - commit.old_length  # n + 1 for rows that go on
    counts = jnp.concatenate(
      [state.fed, self.tables.expansion_lengths[self._rows(commit.emitted)]], axis=1
    )
    grown = jnp.sum(counts * (jnp.arange(counts.shape[1])[None, :] < kept[:, None]), axis=1)
    base = jnp.where(commit.goes_on, state.base + grown, state.base)
    return CrossTokenizerState(state.cache.with_lengths(base), base, state.fed)
