"""The drafter protocol: what generation needs from any way of drafting.

A drafter is a pytree (a `flax.struct` dataclass: arrays and modules as
children, settings static and fixed at construction) whose pure methods
`init`, `propose` and `commit` carry a state of its choosing (a KV cache, a
token history) through the loop. `Drafter` below is the one written list of
what generation reads: it never looks at a drafter's class, and
`specjax.drafting.check_drafter` runs the checks a drafter asks for before
anything compiles. `DrafterBase` gives the defaults (a model-free chain
drafter); one `speculative_step` serves every drafter.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax import constraints
from specjax.models.transformer import Transformer
from specjax.sampling import RowSampling, SamplingParams, warp_probs
from specjax.trees import DynamicTree, Tree
from specjax.validation import is_real
from specjax.vocab import pad_vocab


class Proposal(NamedTuple):
  """What a drafter proposes for one iteration.

  Attributes:
    tokens: `[B, g]` int32; entries at or past `lengths[b]` are ignored.
    probs: `[B, g, V]` float32, the distribution each token was drawn from, or
      None for a deterministic proposal (then q is one-hot at the token).
    lengths: `[B]` int32 in [0, g], how many leading tokens are proposed.
      Verification sees q = 0 past them, which every verifier treats as a
      rejection there, so a row with lengths k is verified as a block of k.
    calls: scalar int32, model forward calls spent (for statistics).
    tree: None for a chain (token i continues token i - 1). A token tree
      (`Drafter.tree`) sets the `trees.Tree` of its g nodes (each node's parent,
      -1: it continues s[-1]; one static tree, or a tree per row); `probs[:, i]`
      is then the law node i was drawn from, its parent's q (all zero for a node
      the drafter could not fill), and `lengths` is g.
    confidence: None, or `[B, g]` float32 in [0, 1] for a chain: the drafter's
      estimate that token i is accepted given the tokens before it were (its
      running product is the survival of token i). A drafter with
      `gives_confidence` sets it; generation reads it to choose how many tokens
      to verify (`SpecConfig.verify_lengths`).
  """

  tokens: jax.Array
  probs: jax.Array | None
  lengths: jax.Array
  calls: jax.Array
  tree: Tree | None = None
  confidence: jax.Array | None = None


class Commit(NamedTuple):
  """What one iteration committed, as handed to `Drafter.commit`.

  With s the committed sequence before the iteration:
    emitted: `[B, g+1]` int32, the accepted draft tokens then the verifier's
      token; row b kept `emitted[b, :new_length[b] - old_length[b]]`.
    old_length: `[B]` int32, len(s).
    new_length: `[B]` int32, len(s') for rows that go on.
    goes_on: `[B]` bool; rows that stopped keep old_length.
    hidden: None, or `[B, g+1, F]` the target's features (`forward_cached`'s
      `return_hidden`: the residual stream before the final norm, F = D) at
      the scored positions s[-1], x_1..x_g, only for drafters with
      `target_features` (F = D times the layers chosen); position j
      predicted `emitted[:, j]`. For a tree, the features along s[-1] and
      the accepted path, in that (chain) order.
    path: None for a chain; for a tree `[B, D]` int32, the accepted nodes from
      the top (-1 padded): node path[:, d] holds emitted[:, d]. A drafter that
      wrote the tree into a cache of its own moves these nodes next to the
      prefix (`KVCache.gather_path`).
  """

  emitted: jax.Array
  old_length: jax.Array
  new_length: jax.Array
  goes_on: jax.Array
  hidden: jax.Array | None = None
  path: jax.Array | None = None


class Drafter(Protocol):
  """What generation reads from a drafter, and nothing more (`DrafterBase` has
  the defaults of every member it can default)."""

  vocab_size: int
  """Static: the ids its proposals are drawn from, [0, vocab_size)."""
  tree: tuple[int, ...] | DynamicTree | None
  """Static: None (it drafts chains), the parents of the token tree it drafts
  (`specjax.trees`; its proposals carry it as a `trees.Tree`), or a spec of
  per-row trees (EAGLE-2's `trees.DynamicTree`); gamma is then the tree's
  number of nodes. Default None."""
  tree_mode: str
  """How a tree's siblings are drawn, "iid" or "without_replacement"
  (`specjax.verify.tree_verify`). Default "iid"."""
  prefill_calls: int
  """Model calls `init` spends (statistics). Default 0."""
  target_features: bool | tuple[int, ...]
  """Static: False, True (the target's features before the final norm) or a
  tuple of layer counts (EAGLE-3 fusion): the `return_hidden` of the target's
  calls, whose features `init` and `commit` receive. Default False."""
  constrained_drafts: bool
  """Static: under a constraint (`specjax.constraints`), `propose` takes
  `constraint=` (a `DraftConstraint`) and draws every token among what the
  state its own path reaches allows, so q is masked like p. Default False: the
  drafter drafts as if unconstrained (still exact: verification masks p, and a
  forbidden draft is rejected)."""
  block_size: int
  """Static: B > 0 for a block drafter, whose one call drafts up to B - 1 tokens (gamma
  must be at most B - 1); 0 for the others. Default 0."""
  takes_tree: bool
  """Static: whether `replace(tree=...)` gives the same drafter drafting token trees.
  Default False."""
  max_tree_depth: int | None
  """Static: the deepest token tree it drafts (None: no bound). Default None."""
  preferred_gamma: int
  """Static: the draft length it pays off at (batch 1) when the user names none, or
  0: the library's default by batch size (`default_gamma`). Default 0."""
  gives_confidence: bool
  """Static: its chain proposals carry `Proposal.confidence`, so generation can
  choose how many drafted tokens to verify (`SpecConfig.verify_lengths`). Default
  False."""

  def init(
    self,
    prompts: jax.Array,
    prompt_lengths: jax.Array,
    first: jax.Array,
    capacity: int,
    hidden: jax.Array | None = None,
  ) -> Any:
    """The state for the committed sequence s = prompt + first token.

    `prompts [B, P]`, `prompt_lengths [B]`, `first [B]`; `capacity` the cache
    slots per row. `hidden` is None, or for drafters with `target_features`
    the target's features at the P prompt positions, `[B, P, F]` (position t
    predicted s[t + 1])."""
    ...

  def propose(
    self,
    state: Any,
    recent: jax.Array,
    key: jax.Array,
    limit: jax.Array,
    *,
    gamma: int,
    sampling: SamplingParams | RowSampling,
  ) -> tuple[Proposal, Any]:
    """Up to `gamma` tokens per row continuing s, at most `limit[b]` for row b,
    drawn under the `sampling` warp; `recent [B, 2] = [s[-2], s[-1]]`. A drafter
    with `constrained_drafts` also takes `constraint=None | DraftConstraint`.
    Per-row `sampling` carries the committed text its penalties read
    (`RowSampling.history`): a chain drafter may advance it along its draft
    (`RowSampling.after`) for q closer to p; exactness only needs q to be the
    law each token was drawn from."""
    ...

  def commit(self, state: Any, commit: Commit) -> Any:
    """The state after what the iteration kept (`Commit`); a drafter with
    `target_features` also gets the target's features over the scored block."""
    ...

  def check_capacity(self, prompt_width: int, max_new_tokens: int, gamma: int) -> None:
    """Raises before compiling when the drafter cannot hold a run of this size
    (its cache, its tree's nodes). Default: nothing to check."""
    ...

  def check_target(self, target: Transformer) -> None:
    """Raises before compiling when the drafter cannot serve `target` (e.g. a
    tokenizer mismatch). Default: any target."""
    ...

  def with_confidence(self, threshold: float) -> Drafter:
    """The same drafter with the adaptive "confidence" draft length (a row
    stops once q's top probability falls below `threshold`). Default: a
    ValueError, the drafter has no q to read."""
    ...


def _members(protocol: type) -> tuple[str, ...]:
  """The attributes and methods a protocol class declares, in order."""
  methods = [name for name, value in vars(protocol).items() if callable(value)]
  return (*protocol.__annotations__, *(name for name in methods if not name.startswith("_")))


DRAFTER_MEMBERS = _members(Drafter)


class DrafterBase:
  """The `Drafter` defaults, those of a drafter that runs no model: no prefill
  calls, no features, chains, no capacity or target to check, no
  confidence-based length."""

  prefill_calls = 0
  target_features = False
  constrained_drafts = False
  tree = None
  tree_mode = "iid"
  block_size = 0
  takes_tree = False
  max_tree_depth = None
  preferred_gamma = 0
  gives_confidence = False

  def check_capacity(self, prompt_width: int, max_new_tokens: int, gamma: int) -> None:
    del prompt_width, max_new_tokens, gamma

  def check_target(self, target: Transformer) -> None:
    del target

  def with_confidence(self, threshold: float) -> Drafter:
    raise ValueError(
      "adaptive='confidence' needs a model drafter (a Transformer, "
      f"ModelDrafter or layer_skip), got {type(self).__name__}."
    )


@struct.dataclass
class DraftConstraint:
  """The rows' constraint as a drafter sees it while it drafts: the device table
  and the state each drafted token continues from.

  Attributes:
    table: the `constraints.ConstraintTable` of the batch.
    state: `[B, ...]` int32, the state after the token a draft continues
      (`[B]` for a chain; a tree's nodes carry `[B, m]`).
    forced_tokens, forced_count: None, or (`SpecConfig.forced_drafts`, a
      chain) `[B, g]` and `[B]`: the tokens `state` forces next, row b's first
      `forced_count[b]` (`constraints.forced_chain`). Generation puts them in
      the proposal's first positions whatever the drafter drafts there; a
      drafter may read them to draft after the span, conditioned on it, without
      spending calls on it (`CachedDrafting`).
  """

  table: constraints.ConstraintTable
  state: jax.Array
  forced_tokens: jax.Array | None = None
  forced_count: jax.Array | None = None

  def logits(self, logits: jax.Array) -> jax.Array:
    """`logits [*state.shape, V']` with the tokens `state` forbids at -inf (the
    law q is then masked and renormalised like the target's p). A row whose
    drafter can reach no allowed id (a vocabulary subset, a smaller draft
    vocabulary) keeps its logits: its forbidden drafts are rejected, still exact."""
    masked = constraints.mask_logits(logits, self.table, self.state)
    reachable = jnp.any(masked > -jnp.inf, axis=-1, keepdims=True)
    return jnp.where(reachable, masked, logits)

  def after(self, tokens: jax.Array) -> DraftConstraint:
    """The constraint after `tokens [*state.shape]` (a forbidden token: dead, -1,
    which allows every token after it)."""
    return self.replace(state=constraints.advance(self.table, self.state, tokens))

  def after_forced(self) -> DraftConstraint:
    """The constraint after each row's forced span (a chain's `[B]` state, no
    span left)."""
    state = self.state
    for j in range(self.forced_tokens.shape[1]):  # static, gamma gathers
      moved = constraints.advance(self.table, state, self.forced_tokens[:, j])
      state = jnp.where(j < self.forced_count, moved, state)
    return self.replace(state=state, forced_tokens=None, forced_count=None)

  def at(self, state: jax.Array) -> DraftConstraint:
    """The same table at other states."""
    return self.replace(state=state)


def draw_chain_token(
  i, logits: jax.Array, rule: DraftConstraint | None, sampling, draw_token: Callable | None
) -> tuple[jax.Array, jax.Array | None, DraftConstraint | None]:
  """A chain drafter's token i from its `logits [B, V]`: masked by `rule` (None: no
  constraint), the argmax when `draw_token` is None (greedy), else drawn by
  `draw_token(i, q)` (`coupling.chain_draws`) from q, the warped law. Returns `(token
  [B], q [B, V] or None, the rule after the token)`."""
  if rule is not None:
    logits = rule.logits(logits)
  if draw_token is None:
    token, q = jnp.argmax(logits, axis=-1).astype(jnp.int32), None
  else:
    q = warp_probs(logits, sampling)
    token = draw_token(i, q)
  return token, q, None if rule is None else rule.after(token)


def chain_confidence(
  logits: jax.Array, token: jax.Array, q: jax.Array | None, rule: DraftConstraint | None
) -> jax.Array:
  """`[B]` float32, a cheap estimate of the chance that a chain drafter's `token
  [B]` is accepted: the draft's own probability of it, q(token) when it was drawn
  from `q [B, V]`, else (greedy) the top probability of its `logits [B, V]`
  (masked by `rule` as `draw_chain_token` masks them)."""
  if q is not None:
    return jnp.take_along_axis(q, token[:, None], axis=1)[:, 0]
  if rule is not None:
    logits = rule.logits(logits)
  return jnp.max(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), axis=-1)


def check_confidence(confidence) -> None:
  """ValueError unless `confidence` (a drafter's stopping threshold) is in [0, 1]."""
  if not is_real(confidence) or not 0 <= confidence <= 1:
    raise ValueError(f"confidence must be in [0, 1] (0 = off), got {confidence!r}.")


class ConfidenceLength(DrafterBase):
  """`with_confidence` for drafters with a `confidence` field (a struct dataclass):
  the adaptive "confidence" draft length stops a row once q's top probability
  falls below the threshold."""

  def with_confidence(self, threshold: float) -> Drafter:
    if not is_real(threshold) or not 0 < threshold <= 1:
      raise ValueError(f"confidence_threshold must be in (0, 1], got {threshold!r}.")
    return self.replace(confidence=float(threshold))


class VocabSubset:
  """FR-Spec for drafters that read the target's head (a struct dataclass with
  `target` and `vocab_subset` fields): draft only among K frequent ids."""

  def with_vocab_subset(self, ids: Any) -> Drafter:
    """The same drafter drafting only among `ids` (`[K]` distinct ids in [0, V)),
    e.g. the K most frequent tokens; None drafts over the whole vocabulary.
    Exact either way: q is 0 outside the subset, and q is what verification reads."""
    if ids is None:
      return self.replace(vocab_subset=None)
    v = self.target.cfg.vocab_size
    array = np.asarray(ids)
    if (
      array.ndim != 1
      or not array.size
      or not np.issubdtype(array.dtype, np.integer)
      or array.min() < 0
      or array.max() >= v
      or len(np.unique(array)) != array.size
    ):
      raise ValueError(
        f"vocab_subset must be a non-empty 1-D array of distinct int ids in [0, {v}), "
        f"got shape {array.shape} dtype {array.dtype}."
      )
    return self.replace(vocab_subset=jnp.asarray(array, jnp.int32))

  def _logits(self, features: jax.Array) -> jax.Array:
    return self.target.features_to_logits(features, self.vocab_subset)


# Set while a chunked generation loop traces its step (`fixed_trip_loops`).
_FIXED_TRIP = contextvars.ContextVar("specjax_fixed_trip_loops", default=False)


@contextlib.contextmanager
def fixed_trip_loops():
  """While tracing inside it, `draft_loop` runs every trip (a loop of known trip
  count) instead of stopping once no row drafts: the chunked generation loop's
  setting (`specjax.generation.common.run_loop`), since XLA:GPU waits on the
  host for the predicate of each trip of a while loop of unknown trip count."""
  token = _FIXED_TRIP.set(True)
  try:
    yield
  finally:
    _FIXED_TRIP.reset(token)


def draft_loop(
  body: Callable[[jax.Array, Any], Any],
  carry: Any,
  start: int,
  stop: int,
  going: Callable[[Any], jax.Array],
) -> tuple[jax.Array, Any]:
  """`carry = body(i, carry)` for i = start, start + 1, ... < stop, a drafter's
  loop over draft positions.

  A while loop that stops early once `going(carry)` (a scalar bool, e.g. "some
  row still drafts") is False; under `fixed_trip_loops` every trip runs (trips
  past the point where no row drafts must change nothing the drafter reports).

  Returns:
    `(stop_index, carry)`: the i at which the loop stopped (scalar int32),
    e.g. the number of model calls spent when each trip makes one.
  """
  if _FIXED_TRIP.get():
    return jnp.int32(stop), jax.lax.fori_loop(start, stop, body, carry)

  def cond(state):
    i, carry = state
    return (i < stop) & going(carry)

  return jax.lax.while_loop(
    cond, lambda state: (state[0] + 1, body(state[0], state[1])), (jnp.int32(start), carry)
  )


def proposal_probs(proposal: Proposal, vocab_size: int) -> jax.Array:
  """`[B, g, vocab_size]` q for verification: one-hot for deterministic proposals,
  zero past each row's `lengths` (the "not proposed" convention)."""
  g = proposal.tokens.shape[1]
  if proposal.probs is None:
    probs = jax.nn.one_hot(proposal.tokens, vocab_size, dtype=jnp.float32)
  else:
    # A draft with a smaller vocabulary: its q is 0 on the ids it lacks.
    probs = pad_vocab(proposal.probs.astype(jnp.float32), vocab_size)
  valid = jnp.arange(g)[None, :] < proposal.lengths[:, None]
  return probs * valid[..., None]
