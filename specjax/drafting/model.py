"""Drafting with a model: a small draft model, or the target's own first layers.

`ModelDrafter(model)` samples gamma tokens from a small model with the target's
warp; `layer_skip(target, k)` runs the target's first k layers, final norm and
head (self-speculation) with a k-layer cache of its own.

Cache invariant (as in `SpecState`): the drafter's cache holds s[:-2]; each
iteration first feeds `recent = [s[-2], s[-1]]`, which re-syncs it after a
fully accepted block (the last drafted token was never fed) with one static
shape. On an accelerator a `ModelDrafter` feeds it inside its draft loop, at
width 2 on every trip (`CachedDrafting._propose_one_width`), so an iteration
compiles one call site of the model; on the CPU, before a width-1 loop.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from specjax import compiler_options
from specjax.coupling import chain_draws
from specjax.drafting.base import (
  DRAFTER_MEMBERS,
  Commit,
  ConfidenceLength,
  DraftConstraint,
  Drafter,
  Proposal,
  chain_confidence,
  check_confidence,
  draft_loop,
  draw_chain_token,
)
from specjax.models.kv_cache import KVCache, check_capacity
from specjax.models.transformer import Transformer
from specjax.sampling import RowSampling, SamplingParams
from specjax.validation import is_int
from specjax.vocab import fit_ids


class CachedDrafting(ConfidenceLength):
  """`init`/`propose`/`commit` of any drafter that samples one token per cached call.

  A subclass gives `_new_state`, `_forward(tokens [B, T], state, logit_indices)
  -> (logits [B, R, V], state)`, `_with_lengths`, `confidence` and `vocab_size`.
  """

  prefill_calls = 1  # init runs the prompt through the drafter once
  target_features = False
  constrained_drafts = True
  # Whether `propose` feeds a constraint's forced span in its first call
  # (`_feed_span`, which needs `_lengths`); else it drafts on from its own tokens.
  feeds_forced = False
  gives_confidence = True  # chains: the draft's own probability of its token

  def init(self, prompts, prompt_lengths, first, capacity, hidden=None):
    b = prompts.shape[0]
    # No logits are needed here; one position keeps the head cheap.
    _, state = self._forward(prompts, self._new_state(b, capacity), jnp.zeros((b, 1), jnp.int32))
    return self._with_lengths(state, prompt_lengths - 1)

  def propose(
    self,
    state,
    recent: jax.Array,
    key: jax.Array,
    limit: jax.Array,
    *,
    gamma: int,
    sampling: SamplingParams,
    constraint: DraftConstraint | None = None,
  ):
    """Samples up to min(gamma, limit[b]) tokens per row, stopping once no row
    needs more (unless `draft_loop` runs every trip). Greedy drafts build no
    `[B, g, V]` law (`Proposal.probs` None, q one-hot). Under a `constraint`
    every token is drawn among what the state its predecessors reach allows;
    with per-row penalties (`RowSampling.history`) from the warp of the text
    its predecessors extend (`RowSampling.after`), as the target's p is.
    `Proposal.confidence [B, g]`: the draft's probability of each token it
    drew (greedy: its top probability), `chain_confidence`.
    """

    b, g = recent.shape[0], gamma
    # One random-bit computation for the whole proposal: a uniform per draw
    # (or, coupled, the rows' noise at the drafted positions).
    draw_token = None if sampling.greedy else chain_draws(key, g, b)
    warp = sampling if isinstance(sampling, RowSampling) else None
    spans = self.feeds_forced and constraint is not None and constraint.forced_count is not None
    if not spans and self._runs_one_width():
      draw = self._drawer(jnp.zeros((b,), jnp.int32), limit, g, sampling, draw_token)
      empty = _empty_draws(b, g, self.vocab_size, sampling.greedy)
      return self._propose_one_width(state, recent, g, draw, (*empty, (constraint, warp)))
    forced = jnp.zeros((b,), jnp.int32)
    if spans:
      # The forced span (`DraftConstraint.forced_tokens`) goes in with s[-2], s[-1]
      # in one call, and row b draws its own tokens from position forced[b] on, so
      # the drafter is conditioned on the span without one call per forced token.
      forced = jnp.minimum(constraint.forced_count, g)
      logits, state = jax.lax.cond(
        jnp.any(forced > 0),
        lambda: self._feed_span(recent, constraint.forced_tokens, forced, state),
        lambda: self._feed_recent(recent, state, g),
      )
      if warp is not None and warp.history is not None:  # penalties count the span
        warp = warp.replace(history=warp.history.after(constraint.forced_tokens, forced))
      constraint = constraint.after_forced()
    else:
      logits, state = self._feed_recent(recent, state, g)
    draw = self._drawer(forced, limit, g, sampling, draw_token)
    empty = _empty_draws(b, g, logits.shape[-1], sampling.greedy)
    return self._draft_on(
      state, logits, forced, limit, g, draw, (*empty, (constraint, warp)), spans
    )

  def _draft_on(self, state, logits, forced, limit, g: int, draw, drawn, spans: bool):
    """The two-call-site form after its first call (`_feed_recent` or `_feed_span`,
    whose `logits [B, 1, V]` give row b's first draw, at position `forced[b]`): a
    width-1 loop, one call per token; `drawn`: `_empty_draws`, `(rule, warp)`.
    Returns `propose`'s `(Proposal, state)`."""
    token, *drawn = draw(0, logits, *drawn)
    lengths = forced + drawn[3].astype(jnp.int32)  # drawn: tokens, probs, sure, active, rule

    def body(i, carry):
      token, state, tokens, probs, sure, active, lengths, rule = carry
      logits, state = self._forward(token[:, None], state)
      token, tokens, probs, sure, active, rule = draw(i, logits, tokens, probs, sure, active, rule)
      return token, state, tokens, probs, sure, active, lengths + active, rule

    # One call per trip: the loop's stop index is the calls spent (feeding `recent` was one).
    carry = (token, state, *drawn[:4], lengths, drawn[4])
    going = lambda c: jnp.any(c[5])
    if spans:  # rows start at their own positions: stop before a trip no row drafts in
      going = lambda c: jnp.any(c[5] & (c[6] < jnp.minimum(limit, g)))
    i, (_, state, tokens, probs, sure, _, lengths, _) = draft_loop(body, carry, 1, g, going)
    return Proposal(tokens, probs, lengths, calls=i, confidence=sure), state

  def _drawer(self, forced: jax.Array, limit: jax.Array, g: int, sampling, draw_token):
    """`draw(i, logits [B, 1, V], tokens, probs, sure, active, (rule, warp))`: row
    b's token at its draft position `forced[b] + i`, recorded in `tokens [B, g]`,
    `probs [B, g, V]` (None: greedy) and `sure [B, g]`; `active [B]` turns off at
    `limit[b]`, g or (with `confidence`) a low top probability. Returns `(token
    [B], tokens, probs, sure, active, (rule, warp))`."""
    rows = jnp.arange(forced.shape[0])

    def draw(i, logits, tokens, probs, sure, active, rule):
      rule, warp = rule  # warp: the rows' own (carried: its counts advance), or None
      at = forced + i  # each row's draft position (past the forced span)
      active = active & (at < limit) & (at < g)
      before = rule
      token, q, rule = draw_chain_token(
        jnp.minimum(at, g - 1), logits[:, 0], rule, warp or sampling, draw_token
      )
      # Positions past g (a long span) are dropped, not clipped onto position g - 1.
      sure = sure.at[rows, at].set(chain_confidence(logits[:, 0], token, q, before), mode="drop")
      if warp is not None:  # the penalties' counts advance along the chain
        warp = warp.after(token)
      if q is not None:  # greedy: a one-hot q, its top probability 1, above any threshold
        probs = probs.at[rows, at].set(q, mode="drop")
        if self.confidence > 0:
          active = active & (jnp.max(q, axis=-1) >= self.confidence)
      tokens = tokens.at[rows, at].set(token, mode="drop")
      return token, tokens, probs, sure, active, (rule, warp)

    return draw

  def _runs_one_width(self) -> bool:
    """Whether `propose` runs the drafter at one width (`_propose_one_width`): its
    `one_width` (False for drafters without one), None meaning on every platform
    but the CPU."""
    one_width = getattr(self, "one_width", False)
    if one_width is None:
      return compiler_options.current_platform() != "cpu"
    return bool(one_width)

  def _propose_one_width(self, state, recent: jax.Array, g: int, draw, drawn):
    """`propose` (no forced span) with one call site of the drafter, at width 2.

    Trip i feeds the last two tokens of s + the i tokens drafted so far (trip 0:
    `recent [B, 2]`; then the token before and the one just drawn) at their slots
    and draws from the logits of the second. The first slot rewrites what the
    trip before wrote there, so after every trip the cache holds all but the last
    two tokens, the state invariant. A compiled iteration then holds one cache
    layout, where a width-2 call before a width-1 loop made XLA:GPU transpose the
    draft's keys between the two every iteration. The same draws, lengths and
    calls (one per trip) as the two call sites; `drawn`: `_empty_draws`, `(rule,
    warp)`. Only for drafters with `_lengths`."""
    b = recent.shape[0]
    second = jnp.ones((b, 1), jnp.int32)

    def body(i, carry):
      state, tokens, probs, sure, active, lengths, rule = carry
      # Trip i's pair from s[-2], s[-1] and the tokens drawn (every row's draw is written,
      # active or not): no pair carried, so no copy of one per trip.
      pair = jax.lax.dynamic_slice_in_dim(jnp.concatenate([recent, tokens], axis=1), i, 2, 1)
      logits, state = self._forward(pair, state, second)
      state = self._with_lengths(state, self._lengths(state) - 1)  # the pair's second is last
      _, tokens, probs, sure, active, rule = draw(i, logits, tokens, probs, sure, active, rule)
      return state, tokens, probs, sure, active, lengths + active, rule

    *empty, rule = drawn
    carry = (state, *empty, jnp.zeros((b,), jnp.int32), rule)
    i, (state, tokens, probs, sure, _, lengths, _) = draft_loop(
      body, carry, 0, g, lambda c: jnp.any(c[4])
    )
    # Past the last pair's second, as the two-site form leaves it (`commit` sets it anyway).
    state = self._with_lengths(state, self._lengths(state) + 1)
    return Proposal(tokens, probs, lengths, calls=i, confidence=sure), state

  def _feed_span(self, recent: jax.Array, span: jax.Array, count: jax.Array, state):
    """The first call of an iteration with forced spans: feeds `[s[-2], s[-1],
    span[:, :g - 1]]` (`span [B, g]`, row b's first `count[b]` forced), returns
    the logits after row b's last forced token, `[B, 1, V]`, and the state holding
    s[:-2] and those tokens (the feeding of `recent` and the span's draws in one).
    Only drafters with `feeds_forced` (`_lengths`)."""
    g = span.shape[1]
    fed = jnp.minimum(count, g - 1)  # the span's tokens whose successors are drafted
    start = self._lengths(state)
    block = jnp.concatenate([recent, span[:, : g - 1]], axis=1)  # [B, g + 1]
    logits, state = self._forward(block, state, (1 + fed)[:, None])
    return logits, self._with_lengths(state, start + 2 + fed)

  def _feed_recent(self, recent: jax.Array, state, gamma: int):
    """The first call of an iteration: feeds `recent [B, 2]`, returns the logits
    after s[-1], `[B, 1, V]` (and the state)."""
    del gamma
    return self._forward(recent, state, jnp.ones((recent.shape[0], 1), jnp.int32))

  def commit(self, state, commit: Commit):
    # Holds s'[:-2] for rows that go on; stopped rows keep s[:-2] (in bounds).
    return self._with_lengths(
      state, jnp.where(commit.goes_on, commit.new_length - 2, commit.old_length - 2)
    )


def _empty_draws(b: int, g: int, vocab: int, greedy: bool):
  """A proposal's records before its first draw: `tokens [B, g]`, `probs [B, g, V]`
  (None when greedy), `sure [B, g]`, every row `active [B]`."""
  probs = None if greedy else jnp.zeros((b, g, vocab), jnp.float32)
  zeros = jnp.zeros((b, g), jnp.int32)
  return zeros, probs, jnp.zeros((b, g), jnp.float32), jnp.ones((b,), bool)


@struct.dataclass
class ModelDrafter(CachedDrafting):
  """Proposes tokens by sampling a `Transformer` (optionally its first `num_layers`).

  Attributes:
    model: the draft model (or the target itself, for layer skipping).
    num_layers: layers to run; None runs all of them.
    confidence: stop drafting a row when the draft's top probability falls
      below this (0 disables it): the adaptive "confidence" draft length.
    one_width: whether `propose` calls the model at one width on every trip
      (`CachedDrafting._propose_one_width`: fewer kernels on an accelerator) or
      feeds `recent` before a width-1 loop (faster on a CPU); None (the default)
      chooses by the platform compiled for. The same tokens either way.
  """

  model: Transformer
  num_layers: int | None = struct.field(pytree_node=False, default=None)
  confidence: float = struct.field(pytree_node=False, default=0.0)
  one_width: bool | None = struct.field(pytree_node=False, default=None)

  def __post_init__(self):
    check_confidence(self.confidence)

  @property
  def vocab_size(self) -> int:
    return self.model.cfg.vocab_size

  def check_capacity(self, prompt_width: int, max_new_tokens: int, gamma: int) -> None:
    check_capacity("draft", self.model.cfg.max_seq_len, prompt_width, max_new_tokens, gamma)

  def _new_state(self, batch: int, capacity: int) -> KVCache:
    return self.model.init_cache(batch, capacity, num_layers=self.num_layers)

  feeds_forced = True

  def _with_lengths(self, cache: KVCache, lengths: jax.Array) -> KVCache:
    return cache.with_lengths(lengths)

  def _lengths(self, cache: KVCache) -> jax.Array:
    return cache.lengths

  def _forward(self, tokens, cache, logit_indices=None):
    return self.model.forward_cached(
      fit_ids(tokens, self.vocab_size),
      cache,
      logit_indices=logit_indices,
      num_layers=self.num_layers,
    )


def layer_skip(target: Transformer, num_layers: int, confidence: float = 0.0) -> ModelDrafter:
  """Self-speculation: the target's first `num_layers` layers + final norm + head."""
  if not is_int(num_layers) or not 1 <= num_layers < target.cfg.n_layers:
    raise ValueError(
      f"num_layers must be an int in [1, {target.cfg.n_layers - 1}] "
      f"(fewer than the target's {target.cfg.n_layers} layers), "
      f"got {num_layers!r}."
    )
  return ModelDrafter(target, num_layers=int(num_layers), confidence=confidence)


def as_drafter(draft) -> Drafter:
  """A `Transformer` becomes a `ModelDrafter`; anything with every `Drafter`
  member passes through; anything else is a ValueError naming `draft`."""
  if isinstance(draft, Transformer):
    return ModelDrafter(draft)
  missing = [name for name in DRAFTER_MEMBERS if not hasattr(draft, name)]
  if not missing:
    return draft
  raise ValueError(
    "draft must be a specjax.Transformer or a specjax.drafting.Drafter, got "
    f"{type(draft).__name__} (missing {', '.join(missing)})."
  )


def check_drafter(
  draft,
  target: Transformer,
  *,
  prompt_width: int,
  max_new_tokens: int,
  gamma: int,
  verifier: Any = "auto",
  adaptive: str | None = None,
) -> Drafter:
  """`as_drafter(draft)`, checked for a run before anything compiles.

  The drafter's `check_capacity` and `check_target`; a tree drafter also needs
  `verifier` "auto" or "coupled" (`coupled_tree_verify`) and `adaptive` None.


  Raises:
    ValueError naming the argument that cannot serve the run.
  """
  drafter = as_drafter(draft)
  drafter.check_capacity(prompt_width, max_new_tokens, gamma)
  drafter.check_target(target)  # e.g. a draft with a tokenizer of its own
  if drafter.tree is not None and (verifier not in ("auto", "coupled") or adaptive is not None):
    raise ValueError(
      f"{type(drafter).__name__} drafts a token tree, which tree verification checks "
      f"(specjax.verify.tree_verify): verifier must be 'auto' or 'coupled' (got "
      f"{verifier!r}) and adaptive None (got {adaptive!r})."
    )
  return drafter
