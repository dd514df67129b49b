"""Speculative decoding: one pure `speculative_step` inside one jitted while-loop.

An iteration (Leviathan et al. 2023, Chen et al. 2023): draft up to gamma tokens
with their q (a chain or a token tree), `score` them in one target call over
gamma + 1 positions, `verify_block` (keep n, draw one more), `commit_step`
(outputs, cache lengths, EOS / budget, drafter, draft limit, statistics). Rows
accept different numbers of tokens in one program. The guide: docs/how_it_works.md.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from specjax import compiler_options
from specjax import constraints as constraints_lib
from specjax import coupling as coupling_lib
from specjax import verify as verify_lib
from specjax.coupling import Coupling
from specjax.drafting import (
  Commit,
  DraftConstraint,
  Drafter,
  Proposal,
  as_drafter,
  check_drafter,
  proposal_probs,
)
from specjax.generation import validation, verify_length
from specjax.generation.common import (
  bind_history,
  ends_row,
  finalize,
  prefill_first,
  run_loop,
  zero_padding,
)
from specjax.generation.state import GenerateOutput, SpecConfig, SpecState, SpeculativeStats
from specjax.models.kv_cache import KVCache, cache_capacity, write_rows
from specjax.models.transformer import Transformer
from specjax.sampling import RowSampling, SamplingParams, finite_rows, warp_probs
from specjax.trees import DynamicTree, Tree, levels
from specjax.validation import check_loop, check_positive_int
from specjax.vocab import fit_ids, pad_vocab

ADAPTIVE = (None, "schedule", "confidence")


def speculative_step(
  target: Transformer,
  drafter: Drafter | Transformer,
  state: SpecState,
  config: SpecConfig,
  *,
  with_logits: bool = False,
  table: constraints_lib.ConstraintTable | None = None,
) -> SpecState | tuple[SpecState, jax.Array, jax.Array]:
  """One pure speculative iteration for every row: draft, score, verify, commit.
  Done rows run along but commit nothing; a row that proposed k < gamma tokens
  is verified as a block of k (q = 0 past them); with `config.verify_lengths`
  the rows' proposals are cut to one chosen length (`verify_length`).
  `with_logits` (static): returns `(state, logits [B, g+1, V], emitted
  [B, g+1])` (serving's logprobs). `table`: the rows' constraints
  (`state.constraint_state`); the output then follows the constrained law
  exactly (`_draft_constraint`, `_constraint_mask`)."""
  drafter = as_drafter(drafter)
  draft_key, verify_key = _iteration_keys(state, drafter, target.cfg.vocab_size, config)
  sampling = step_sampling(state, config)
  # 1. Draft up to gamma tokens per row (a chain or a tree), with the laws q they were drawn
  # from; under a constraint, q masked like p where the drafter can (`constrained_drafts`),
  # and the tokens the constraint forces first, at no drafter cost (`_forced_drafts`).
  forced = _forced_drafts(drafter, table, state, config)
  proposal, drafter_state = drafter.propose(
    state.drafter_state,
    state.recent,
    draft_key,
    state.draft_limit,
    gamma=config.gamma,
    sampling=sampling,
    **_draft_constraint(drafter, table, state, forced),
  )
  proposal = splice_forced(proposal, forced, max(target.cfg.vocab_size, drafter.vocab_size))
  # 2-3. Score s[-1] and the drafted tokens in one target call (logits at g + 1 positions,
  # masked by the constraint's state before each), then verify: keep n drafted tokens (a
  # tree: the nodes of one path) and the verifier's token. With `verify_lengths`, the
  # chain is first cut to the length its confidence makes worth verifying.
  proposal, logits, path_states, verified = _score_and_verify(
    target, drafter, state, proposal, verify_key, sampling, config, table, with_logits
  )
  # 4. Commit: outputs, lengths (rollback is bookkeeping), drafter, draft limit, statistics,
  # and the constraint's state after the kept tokens.
  new = commit_step(state, drafter, drafter_state, proposal, verified, config, forced)
  new = new.replace(constraint_state=_constraint_after(table, state, path_states, verified))
  if with_logits:
    return new, logits, emitted_tokens(verified.drafted, verified.n, verified.next_token)
  return new


def _score_and_verify(
  target: Transformer,
  drafter: Drafter,
  state: SpecState,
  proposal: Proposal,
  key: jax.Array | Coupling,
  sampling: SamplingParams | RowSampling,
  config: SpecConfig,
  table: constraints_lib.ConstraintTable | None,
  with_logits: bool,
) -> tuple[Proposal, jax.Array | None, jax.Array | None, Verified]:
  """`score`, `_constraint_mask` and `verify_block` of the proposal, or, with
  `config.verify_lengths` and a proposal with confidence, of the proposal cut to
  the length `choose_verify_length` picks (one `lax.switch` branch per compiled
  length; the outputs padded back to gamma).

  Returns:
    `(proposal as verified (lengths min(lengths, k)), logits [B, g+1, V] or None
    unless with_logits, path_states [B, g+1] or None, Verified with drafted
    [B, g] and hidden [B, g+1, F])`.
  """
  gamma = config.gamma
  vocab = max(target.cfg.vocab_size, drafter.vocab_size)  # both laws over one vocabulary

  def at(k: int, proposal: Proposal):
    cut = verify_length.cut_proposal(proposal, k) if k < gamma else proposal
    block = jnp.concatenate([state.recent[:, 1:], cut.tokens], axis=1)  # [B, k+1]
    logits, cache, hidden = score(
      target, block, state.target_cache, drafter.target_features, cut.tree
    )
    logits, path_states = _constraint_mask(table, state, cut, logits)
    scored = scored_sampling(sampling, state, cut, config)  # p's warp: each row's own counts
    verified = verify_block(
      key, cut, logits, cache, hidden, scored, vocab, drafter.tree_mode, config
    )
    if k < gamma:  # static shapes whatever the length: pad the block's axis back to gamma
      pad = lambda x, rows: None if x is None else _pad_axis1(x, rows)
      verified = verified._replace(
        drafted=pad(verified.drafted, gamma), hidden=pad(verified.hidden, gamma + 1)
      )
      logits, path_states = pad(logits, gamma + 1), pad(path_states, gamma + 1)
    return cut.lengths, logits if with_logits else None, path_states, verified

  lengths = config.verify_lengths
  if not lengths or proposal.confidence is None:
    lengths = (gamma,)
  if len(lengths) == 1:
    verified_lengths, logits, path_states, verified = at(lengths[0], proposal)
  else:
    index = verify_length.choose_verify_length(
      proposal.confidence, proposal.lengths, ~state.done, lengths, config.verify_costs
    )
    branches = [functools.partial(at, k) for k in lengths]
    verified_lengths, logits, path_states, verified = jax.lax.switch(index, branches, proposal)
  return proposal._replace(lengths=verified_lengths), logits, path_states, verified


def _pad_axis1(x: jax.Array, size: int) -> jax.Array:
  """`x [B, k, ...]` zero-padded to `[B, size, ...]`."""
  return jnp.pad(x, [(0, 0), (0, size - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def _iteration_keys(
  state: SpecState, drafter: Drafter, vocab_size: int, config: SpecConfig
) -> tuple[jax.Array | Coupling, jax.Array | Coupling]:
  """`(draft_key, verify_key)` of this iteration: its pair of typed keys, or with
  `config.coupled` two `Coupling`s of the same noise, the rows' Gumbel noise
  `[B, S, V]` (V = `vocab_size`) at this block's generated indices num_generated
  ... + S - 1 (S = `noise_positions`), drawn once so that the drafter and the
  verifier read the same; each keeps its own key for the rows not coupled."""
  draft_key, verify_key = state.keys[jnp.minimum(state.stats.iterations, len(state.keys) - 1)]
  if not config.coupled:
    return draft_key, verify_key
  positions = noise_positions(drafter, config.gamma)
  coupling = Coupling.of(
    state.row_keys, state.num_generated, positions, vocab_size, draft_key, state.coupled_rows
  )
  return coupling, coupling.replace(key=verify_key)


def _draft_constraint(
  drafter: Drafter,
  table: constraints_lib.ConstraintTable | None,
  state: SpecState,
  forced: tuple[jax.Array, jax.Array] | None = None,
) -> dict[str, DraftConstraint]:
  """The `constraint` argument of `drafter.propose`: the table and the rows' states
  after s[-1] (`[B]` int32) when there is a constraint and the drafter masks its q
  (`constrained_drafts`), with the `forced` span when there is one; else nothing
  (drafters without the mask take no such argument)."""
  if table is None or not drafter.constrained_drafts:
    return {}
  tokens, count = (None, None) if forced is None else forced
  return {"constraint": DraftConstraint(table, state.constraint_state, tokens, count)}


def _forced_drafts(
  drafter: Drafter,
  table: constraints_lib.ConstraintTable | None,
  state: SpecState,
  config: SpecConfig,
) -> tuple[jax.Array, jax.Array] | None:
  """`(tokens [B, g], count [B])`, the tokens the rows' constraint states force
  next (`constraints.forced_chain`; done rows none), or None: forced drafts off,
  no constraint, or a token tree (a tree's nodes are drafted by its drafter)."""
  if not config.forced_drafts or table is None or drafter.tree is not None:
    return None
  tokens, count, _ = constraints_lib.forced_chain(table, state.constraint_state, config.gamma)
  return tokens, jnp.where(state.done, 0, count)


def splice_forced(
  proposal: Proposal, forced: tuple[jax.Array, jax.Array] | None, vocab_size: int
) -> Proposal:
  """The proposal with row b's first `count[b]` tokens the forced ones (`forced =
  (tokens [B, g], count [B])`), q one-hot there (`probs` padded to `vocab_size`),
  confidence 1, and at least `count[b]` tokens proposed.

  Exact for every verifier: a forced token's constrained p is one-hot at it, so is
  its q, and it is accepted with probability 1 (greedy: it is the argmax). The
  drafter's tokens after the span were drawn from the laws `probs` reports, which
  is all verification needs, whether or not the drafter saw the span (a drafter
  that reads `DraftConstraint.forced_tokens` drafts after it; another drafts on
  from its own tokens there, which a constrained drafter makes the same ones)."""
  if forced is None:
    return proposal
  tokens, count = forced
  at = jnp.arange(tokens.shape[1])[None, :] < count[:, None]  # [B, g]
  probs = proposal.probs
  if probs is not None:
    one_hot = jax.nn.one_hot(tokens, vocab_size, dtype=probs.dtype)
    probs = jnp.where(at[..., None], one_hot, pad_vocab(probs, vocab_size))
  confidence = proposal.confidence
  if confidence is not None:
    confidence = jnp.where(at, 1.0, confidence)
  return proposal._replace(
    tokens=jnp.where(at, tokens, proposal.tokens),
    probs=probs,
    lengths=jnp.maximum(proposal.lengths, count),
    confidence=confidence,
  )


def _constraint_mask(
  table: constraints_lib.ConstraintTable | None,
  state: SpecState,
  proposal: Proposal,
  logits: jax.Array,
) -> tuple[jax.Array, jax.Array | None]:
  """`(logits [B, g+1, V], path_states [B, g+1] or None)`: without a constraint the
  target's logits as they are; with one, the constraint's state before each scored
  row (`constrained_path`: the state the drafted tokens before it reach, a tree's
  along the node's own path) and the logits with the tokens it forbids there at
  -inf, so that verification is exact for the constrained law."""
  if table is None:
    return logits, None
  path_states = constrained_path(table, state.constraint_state, proposal.tokens, proposal.tree)
  return constraints_lib.mask_logits(logits, table, path_states), path_states


def _constraint_after(
  table: constraints_lib.ConstraintTable | None,
  state: SpecState,
  path_states: jax.Array | None,
  verified: Verified,
) -> jax.Array | None:
  """`[B]` int32, the constraint's state after the kept tokens and the verifier's
  token (`path_states [B, g+1]` from `_constraint_mask`); done rows keep theirs.
  Without a constraint, `state.constraint_state` (None)."""
  if table is None:
    return state.constraint_state
  # The block row of the last kept token: a chain's row n, a tree's deepest
  # accepted node (`path_rows`; the root's row 0 when none was kept).
  row = verified.n[:, None]
  if verified.path is not None:
    row = jnp.take_along_axis(path_rows(verified.path), row, axis=1)
  kept = jnp.take_along_axis(path_states, row, axis=1)[:, 0]
  after = constraints_lib.advance(table, kept, verified.next_token)
  return jnp.where(state.done, state.constraint_state, after)


class Verified(NamedTuple):
  """What verification kept of a drafted block, laid out as a chain.

  Attributes:
    n: `[B]` int32, drafted tokens accepted.
    next_token: `[B]` int32, the token the verifier drew after them.
    drafted: `[B, D]` the drafted tokens along what was accepted (a chain's
      `[B, g]`, or a tree's accepted path, D its depth).
    path: None for a chain; for a tree `[B, D]` the accepted nodes.
    cache: the target's cache, a tree's accepted path moved next to the prefix.
    hidden: None, or `[B, D + 1, F]` the features along s[-1] and the accepted
      tokens.
    finite: `[B]` bool, whether the row's laws (the target's and the draft's)
      were finite (`specjax.sampling.finite_rows`); a row's tokens are
      committed only then.
  """

  n: jax.Array
  next_token: jax.Array
  drafted: jax.Array
  path: jax.Array | None
  cache: KVCache
  hidden: jax.Array | None
  finite: jax.Array


def verify_block(
  key: jax.Array,
  proposal: Proposal,
  logits: jax.Array,
  cache: KVCache,
  hidden: jax.Array | None,
  sampling: SamplingParams | RowSampling,
  vocab_size: int,
  tree_mode: str,
  config: SpecConfig,
) -> Verified:
  """Verifies a proposal against `score`'s `logits [B, g+1, V]`, `cache` and
  `hidden`: the config's verifier for a chain, `tree_verify` for a tree."""
  if proposal.tree is None:
    verifier = verify_lib.get_verifier(config.verifier)
    argmax_only = verifier is verify_lib.greedy_verify
    inputs = verifier_inputs(proposal, logits, sampling, vocab_size, argmax_only)
    n, next_token = verifier(key, *inputs)
    finite = finite_rows(inputs[2])
    if inputs[1] is not None:
      finite &= finite_rows(inputs[1])
    return Verified(n, next_token, proposal.tokens, None, cache, hidden, finite)
  path, n, next_token, finite = verify_tree(key, proposal, logits, sampling, vocab_size, tree_mode)
  drafted = jnp.take_along_axis(proposal.tokens, jnp.maximum(path, 0), axis=1)
  # The accepted path's keys and values move next to the prefix, after s[-1] (a
  # tree call left the lengths at the prefix).
  cache = cache.gather_path(path, cache.lengths + 1)
  if hidden is not None:  # features along s[-1], then the path: a chain's layout
    hidden = jnp.take_along_axis(hidden, path_rows(path)[:, :, None], axis=1)
  return Verified(n, next_token, drafted, path, cache, hidden, finite)


def commit_step(
  state: SpecState,
  drafter: Drafter,
  drafter_state: Any,
  proposal: Proposal,
  verified: Verified,
  config: SpecConfig,
  forced: tuple[jax.Array, jax.Array] | None = None,
) -> SpecState:
  """The state after an iteration: n + 1 tokens appended (cut at EOS and budget),
  the target's cache rolled to s'[:-1], the drafter's commit, limit and stats
  (`forced`: `_forced_drafts`'s span, whose accepted tokens are counted apart)."""
  n = verified.n
  emitted = emitted_tokens(verified.drafted, n, verified.next_token)
  tokens, num_generated, done, count = commit_tokens(state, emitted, n, config)
  broken, num_generated, done, count = stop_broken(
    state, verified.finite, num_generated, done, count
  )
  history = None if state.history is None else state.history.after(emitted, count)
  old_length = state.target_cache.lengths + 1  # len(s)
  commit = Commit(emitted, old_length, old_length + n + 1, ~done, verified.hidden, verified.path)
  return state.replace(
    target_cache=commit_cache(verified.cache, commit),
    drafter_state=drafter.commit(drafter_state, commit),
    recent=next_recent(state.recent, emitted, n, commit.goes_on),
    draft_limit=next_draft_limit(state.draft_limit, n, proposal.lengths, ~state.done, config),
    tokens=tokens,
    num_generated=num_generated,
    done=done,
    history=history,
    stats=state.stats.record(
      active=~state.done,
      proposed=proposal.lengths,
      accepted=n,
      generated=count,
      draft_calls=proposal.calls,
      forced=None if forced is None else jnp.minimum(n, forced[1]),
      non_finite=broken,
    ),
  )


def constrained_path(
  table: constraints_lib.ConstraintTable,
  start: jax.Array,
  tokens: jax.Array,
  tree: Tree | None = None,
) -> jax.Array:
  """`[B, g + 1]` the constraint states at the scored block's rows, from `start
  [B]` (the state after s[-1]): for a chain `tokens [B, g]`, column i is the
  state x_1..x_i reach; for a tree, column c + 1 the state node c's path from
  the root reaches (column 0: the root). -1 once a token is not allowed: what
  follows it is never accepted."""
  states = [start]
  for c in range(tokens.shape[1]):
    if tree is None:
      before = states[-1]
    else:  # the parent's column: -1 (the root) is column 0; a malformed parent reads the root
      parent = jnp.broadcast_to(jnp.asarray(tree.parents[:, c]), start.shape)
      above = jnp.stack(states, axis=1)
      before = jnp.take_along_axis(above, jnp.clip(parent + 1, 0, c)[:, None], axis=1)[:, 0]
    states.append(constraints_lib.advance(table, before, tokens[:, c]))
  return jnp.stack(states, axis=1)


def noise_positions(drafter: Drafter, gamma: int) -> int:
  """How many generated indices an iteration may draw at: a chain's gamma + 1,
  a tree's depth + 1."""
  if drafter.tree is None:
    return gamma + 1
  if isinstance(drafter.tree, DynamicTree):
    return drafter.tree.depth + 1
  return len(levels(drafter.tree)) + 1


def step_sampling(state: SpecState, config: SpecConfig) -> SamplingParams | RowSampling:
  """The warp of this iteration: the config's static one, or the rows' own with
  their committed text (`SpecState.history`): a drafter's first token's law."""
  if config.sampling is not None:
    return config.sampling
  return bind_history(state.sampling, state.history, config.eos_id)


def scored_sampling(
  sampling: SamplingParams | RowSampling, state: SpecState, proposal: Proposal, config: SpecConfig
) -> SamplingParams | RowSampling:
  """The warp of the target's p at each row of the scored block `[B, g + 1]`:
  the step's `sampling` (`step_sampling`), per row with the text before that row,
  the committed text and the drafted tokens before it (a tree's: its path from
  the root), as the warp of the draft at that position reads it
  (`TokenHistory.along`)."""
  if state.history is None:
    return sampling
  parents = None if proposal.tree is None else proposal.tree.parents
  return sampling.with_history(state.history.along(proposal.tokens, parents), config.eos_id)


def score(
  target: Transformer,
  block: jax.Array,
  cache: KVCache,
  return_hidden: bool | tuple[int, ...] = False,
  tree: Tree | None = None,
) -> tuple[jax.Array, KVCache, jax.Array | None]:
  """The target's logits at every position of `block [B, g+1]` in one call (with
  `tree`: s[-1] and a token tree, tree attention, lengths unchanged).

  Returns:
    `(logits [B, g+1, V_target] float32, cache, hidden [B, g+1, F] or None)`,
    the features of `Drafter.target_features`; ids the target lacks read as 0.
  """
  layout = None if tree is None else (tree.with_root(), 0)  # s[-1] is the block's root
  out = target.forward_cached(
    fit_ids(block, target.cfg.vocab_size), cache, return_hidden=return_hidden, tree=layout
  )
  return out[0], out[1], out[2] if return_hidden is not False else None


def verify_tree(
  key: jax.Array,
  proposal: Proposal,
  logits: jax.Array,
  sampling: SamplingParams | RowSampling,
  vocab_size: int,
  mode: str,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`tree_verify` of a drafted tree against the target's `logits [B, N+1, V]`:
  greedy at temperature 0, else `mode` ("iid" or "without_replacement"), or
  `coupled_tree_verify` when `key` is a `Coupling`.

  Returns:
    `(path [B, D], n [B], next_token [B], finite [B])`, finite whether the row's
    laws were (`specjax.sampling.finite_rows`).
  """
  if sampling.greedy:
    logits = pad_vocab(logits, vocab_size, fill=-jnp.inf)  # ids the target lacks: never argmax
    q = None if proposal.probs is None else proposal_probs(proposal, vocab_size)
    verified = verify_lib.tree_verify(None, proposal.tokens, proposal.tree, q, logits, "greedy")
    return (*verified, finite_rows(logits))
  p = pad_vocab(warp_probs(logits, sampling), vocab_size)
  q = proposal_probs(proposal, vocab_size)
  finite = finite_rows(p) & finite_rows(q)
  if isinstance(key, Coupling):
    verified = verify_lib.coupled_tree_verify(key, proposal.tokens, proposal.tree, q, p, mode)
  else:
    verified = verify_lib.tree_verify(key, proposal.tokens, proposal.tree, q, p, mode)
  return (*verified, finite)


def path_rows(path: jax.Array) -> jax.Array:
  """`[B, D + 1]` block rows of s[-1] (row 0) then the accepted path (node i is row
  i + 1; rows past the path repeat row 0, which nothing reads)."""
  return jnp.pad(path + 1, ((0, 0), (1, 0)))


def verifier_inputs(
  proposal: Proposal,
  logits: jax.Array,
  sampling: SamplingParams | RowSampling,
  vocab_size: int,
  argmax_only: bool,
) -> tuple[jax.Array, jax.Array | None, jax.Array]:
  """What the verifier reads, over one vocabulary of `vocab_size` ids.

  Returns:
    `(draft_tokens [B, g], draft_probs [B, g, V] or None, target [B, g+1, V])`:
    for sampling verifiers q (zero past each row's proposal) and the warped p;
    for greedy the logits (missing ids at -inf), q only if built, and tokens -1
    past each row's proposal (the same tokens are accepted either way).
  """
  if not argmax_only:
    p = pad_vocab(warp_probs(logits, sampling), vocab_size)
    return proposal.tokens, proposal_probs(proposal, vocab_size), p
  g = proposal.tokens.shape[1]
  proposed = jnp.arange(g)[None, :] < proposal.lengths[:, None]
  tokens = jnp.where(proposed, proposal.tokens, -1)
  logits = pad_vocab(logits, vocab_size, fill=-jnp.inf)
  q = None if proposal.probs is None else proposal_probs(proposal, vocab_size)
  return tokens, q, logits


def emitted_tokens(draft_tokens: jax.Array, n: jax.Array, next_token: jax.Array) -> jax.Array:
  """`[B, g+1]`: x_1..x_n, then the verifier's token, then junk up to g + 1 slots."""
  slots = jnp.arange(draft_tokens.shape[1] + 1)[None, :]
  return jnp.where(
    slots == n[:, None], next_token[:, None], jnp.pad(draft_tokens, ((0, 0), (0, 1)))
  )


def stop_broken(
  state: SpecState, finite: jax.Array, num_generated: jax.Array, done: jax.Array, count: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """`commit_tokens`' `(num_generated, done, count)` [B] with each active row
  whose law was not `finite` [B] stopped, keeping none of this draw; returns
  `(broken [B], num_generated, done, count)` (`SpeculativeStats.non_finite`)."""
  broken = ~finite & ~state.done
  num_generated = jnp.where(broken, state.num_generated, num_generated)
  return broken, num_generated, done | broken, jnp.where(broken, 0, count)


def commit_tokens(
  state: SpecState, emitted: jax.Array, n: jax.Array, config: SpecConfig
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Appends each active row's n + 1 new tokens, cut at EOS (the config's ids,
  unless the row's `ignore_eos`; the row's `stop` or `stop_token_ids`) and at its
  budget: `(tokens, num_generated [B], done [B], count [B])`, count the tokens
  committed (0 if done before)."""
  active = ~state.done
  count = n + 1
  slots = jnp.arange(emitted.shape[1])[None, :]
  eos = (emitted == state.stop[:, None]) | ends_row(
    emitted, config.eos_id, step_sampling(state, config)
  )
  eos = eos & (slots < count[:, None])
  hit_eos = jnp.any(eos, axis=1)
  count = jnp.where(hit_eos, jnp.argmax(eos, axis=1) + 1, count)
  count = jnp.minimum(count, state.budget - state.num_generated)
  count = jnp.where(active, count, 0)
  tokens = write_rows(state.tokens, emitted, state.num_generated)
  num_generated = state.num_generated + count
  done = state.done | (num_generated >= state.budget) | (active & hit_eos)
  return tokens, num_generated, done, count


def commit_cache(cache: KVCache, commit: Commit) -> KVCache:
  """The target cache holds s'[:-1] for rows that go on; rows that stopped keep
  their old lengths so later (discarded) writes stay in bounds."""
  return cache.with_lengths(jnp.where(commit.goes_on, commit.new_length - 1, commit.old_length - 1))


def next_recent(
  recent: jax.Array, emitted: jax.Array, n: jax.Array, goes_on: jax.Array
) -> jax.Array:
  """`[B, 2]` = the last two tokens of s' for rows that go on (others keep theirs)."""
  history = jnp.concatenate([recent[:, 1:], emitted], axis=1)  # s[-1], emitted
  new = jnp.take_along_axis(history, jnp.stack([n, n + 1], axis=1), axis=1)
  return jnp.where(goes_on[:, None], new, recent)


def next_draft_limit(
  limit: jax.Array, n: jax.Array, proposed: jax.Array, active: jax.Array, config: SpecConfig
) -> jax.Array:
  """Adaptive "schedule": +2 after a fully accepted block, -1 otherwise, within
  [1, gamma]."""
  if config.adaptive != "schedule":
    return limit
  longer = jnp.minimum(limit + 2, config.gamma)
  shorter = jnp.maximum(limit - 1, 1)
  return jnp.where(active, jnp.where(n >= proposed, longer, shorter), limit)


def init_state(
  target: Transformer,
  drafter: Drafter | Transformer,
  prompts: jax.Array,
  prompt_lengths: jax.Array,
  key: jax.Array,
  config: SpecConfig,
  rows: RowSampling | None = None,
  rules: constraints_lib.RowConstraints | None = None,
) -> SpecState:
  """Prefills the target and the drafter and samples the first token from the target.

  Args:
    prompts: `[B, P]` right-padded (padding already zeroed); prompt_lengths `[B]`.
    rows: the rows' own sampling settings when `config.sampling` is None.
    rules: None, or the rows' constraints (`specjax.constraints`).
  """
  b, width = prompts.shape
  key, keys = coupling_lib.split_keys(key, b, config.coupled)
  key, first_key = jax.random.split(key)
  return prefill_state(
    target,
    as_drafter(drafter),
    prompts,
    prompt_lengths,
    first_key,
    config,
    capacity=cache_capacity(width, config.max_new_tokens, config.gamma),
    budget=jnp.full((b,), config.max_new_tokens, jnp.int32),
    stop=jnp.full((b,), -1, jnp.int32),
    # At most max_new_tokens - 1 iterations follow the prefill's token: one
    # split before the loop gives each its (draft, verify) keys.
    keys=jax.random.split(key, (config.max_new_tokens, 2)),
    rows=rows,
    row_keys=keys,
    rules=rules,
  )


def prefill_state(
  target: Transformer,
  drafter: Drafter | None,
  prompts: jax.Array,
  prompt_lengths: jax.Array,
  first_key: jax.Array,
  config: SpecConfig,
  *,
  capacity: int,
  budget: jax.Array,
  stop: jax.Array,
  keys: jax.Array,
  rows: RowSampling | None = None,
  row_keys: jax.Array | None = None,
  coupled_rows: jax.Array | None = None,
  rules: constraints_lib.RowConstraints | None = None,
) -> SpecState:
  """`init_state` with each row's budget, stop id and the capacity given (a
  server's rows differ); `drafter` None keeps no drafter state.

  Args:
    prompts: `[B, P]` right-padded (padding already zeroed); prompt_lengths,
      budget, stop `[B]` (stop -1: none).
    first_key: the key of the first token's draw.
    keys: `[K, 2]` the iterations' (draft, verify) keys.
    row_keys, coupled_rows: `SpecState`'s, when `config.coupled` (the first
      token is then the coupled draw at generated index 0).
    rules: None, or the rows' constraints: the first token among what their
      start states allow; `SpecState.constraint_state` the state after it.
  """
  b = prompts.shape[0]
  if config.coupled:  # each row's draw at generated index 0
    zero = jnp.zeros((b,), jnp.int32)
    first_key = Coupling.of(row_keys, zero, 1, target.cfg.vocab_size, first_key, coupled_rows)
  sampling = rows if config.sampling is None else config.sampling
  first, broken, history, constraint_state, target_cache, drafter_state = _prefill_models(
    target, drafter, prompts, prompt_lengths, capacity, first_key, sampling, config, rules
  )
  done = (budget <= 1) | (first == stop) | ends_row(first, config.eos_id, sampling) | broken
  last_prompt = jnp.take_along_axis(prompts, (prompt_lengths - 1)[:, None], axis=1)
  return SpecState(
    target_cache=target_cache,
    drafter_state=drafter_state,
    recent=jnp.concatenate([last_prompt, first[:, None]], axis=1),
    draft_limit=jnp.full((b,), config.gamma, jnp.int32),
    tokens=jnp.zeros((b, config.max_new_tokens + config.gamma + 1), jnp.int32).at[:, 0].set(first),
    num_generated=jnp.where(broken, 0, 1).astype(jnp.int32),
    done=done,
    budget=budget,
    stop=stop,
    keys=keys,
    stats=SpeculativeStats.zeros(
      b, config.gamma, draft_calls=0 if drafter is None else drafter.prefill_calls
    ).replace(non_finite=broken.astype(jnp.int32)),
    sampling=rows,
    row_keys=row_keys,
    coupled_rows=coupled_rows,
    constraint_state=constraint_state,
    history=history,
  )


def _prefill_models(
  target: Transformer,
  drafter: Drafter | None,
  prompts: jax.Array,
  prompt_lengths: jax.Array,
  capacity: int,
  first_key: jax.Array | Coupling,
  sampling: SamplingParams | RowSampling,
  config: SpecConfig,
  rules: constraints_lib.RowConstraints | None,
) -> tuple:
  """The target's prefill and first token (`prefill_first`, with the prompt's
  features when the drafter reads them), then the drafter's over the prompt and
  that token (`()` without a drafter).

  Returns:
    `(first, broken, history, constraint_state, target_cache, drafter_state)`.
  """
  features = drafter is not None and drafter.target_features
  first, broken, history, constraint_state, target_cache, hidden = prefill_first(
    target, prompts, prompt_lengths, capacity, first_key, sampling, config.eos_id, rules, features
  )
  drafter_state = (
    ()
    if drafter is None
    else drafter.init(prompts, prompt_lengths, first, capacity, hidden[0] if hidden else None)
  )
  return first, broken, history, constraint_state, target_cache, drafter_state


@functools.partial(compiler_options.jit, static_argnames=("config",))
def _speculative_program(
  target, drafter, prompts, prompt_lengths, key, rows=None, rules=None, *, config: SpecConfig
) -> GenerateOutput:
  prompts = zero_padding(prompts, prompt_lengths)
  state = init_state(target, drafter, prompts, prompt_lengths, key, config, rows, rules)
  table = None if rules is None else rules.table
  state = run_loop(
    lambda s: speculative_step(target, drafter, s, config, table=table),
    state,
    config.loop,
    config.loop_chunk,
  )
  return GenerateOutput(
    tokens=finalize(state.tokens, state.num_generated, config.max_new_tokens, config.pad_id),
    num_generated=state.num_generated,
    stats=state.stats,
  )


def speculative_generate(
  target: Transformer,
  draft: Transformer | Drafter,
  prompts: jax.Array,
  prompt_lengths: jax.Array,
  *,
  gamma: int,
  max_new_tokens: int,
  sampling: SamplingParams | RowSampling = SamplingParams(),
  key: jax.Array | None = None,
  eos_id: int | list[int] | None = None,
  verifier: str | verify_lib.Verifier = "auto",
  pad_id: int = 0,
  adaptive: str | None = None,
  confidence_threshold: float = 0.5,
  loop: str = "while",
  loop_chunk: int = 8,
  constraints: constraints_lib.RowConstraints | None = None,
  verify_lengths: tuple[int, ...] | None = None,
  verify_costs: tuple[float, ...] | None = None,
  forced_drafts: bool = True,
) -> GenerateOutput:
  """Exact speculative decoding of up to `max_new_tokens` tokens per row.

  The output has the target's own distribution under `sampling` (token
  verification), and at temperature 0 equals the target's greedy decoding.

  Args:
    target: the `specjax.Transformer` whose distribution the output follows.
    draft: a `Transformer` over the same tokenizer (vocabulary sizes may differ;
      the target itself is a perfect draft), or any `specjax.drafting` drafter
      (`CrossTokenizerDrafter` for another tokenizer).
    prompts: `[B, P]` int32, right-padded; prompt_lengths `[B]` int32 in [1, P].
    gamma: drafted tokens per iteration (>= 1, static); a tree drafter's nodes.
    max_new_tokens: budget per row (>= 1, static).
    sampling: the warp shared by draft and target; temperature 0 is greedy.
      One that sets penalties, logit_bias, min_p or the stop settings runs as
      `RowSampling` rows, each warp reading its row's text up to the position
      (drafted tokens included: `specjax.sampling`).
      `RowSampling` gives each row its own ("auto" is then "token", or
      "coupled" with per-row keys).
    key: one PRNG key, or one per row (typed keys `[B]`); required unless
      sampling is greedy (every row). With the "coupled" verifier row b's
      tokens depend on its key (`fold_in(key, b)` from one key) and prompt only.
    eos_id: stop a row after this id, or any of a list (kept and counted).
    verifier: "auto" (greedy at temperature 0, else "coupled" with per-row
      keys, else "token"), "token", "block", "greedy", "coupled" (Gumbel-max:
      the text of `autoregressive_generate(sampler="coupled")` with the same
      keys, for every drafter; docs/usage.md), or a `specjax.verify` function;
      "auto" or "coupled" for token trees (`tree_verify`, `coupled_tree_verify`).
    pad_id: value of `tokens` past each row's `num_generated` (an int32).
    adaptive: per-row draft length within `gamma`: None, "schedule" (+2 after a
      fully accepted block, -1 otherwise) or "confidence" (a model drafter stops
      below `confidence_threshold` top probability). Exactness is unchanged.

    confidence_threshold: in (0, 1], for adaptive="confidence".
    loop: "while" tests for finished rows after every iteration; "chunked"
      after every `loop_chunk` (docs/performance.md, "Loop modes"). Same tokens
      and statistics, but a drafter's own loop runs all gamma calls (counted
      in draft_calls).

    loop_chunk: iterations per test of loop="chunked" (>= 1, static).
    constraints: None, or `specjax.constraints.RowConstraints` (a regex, JSON
      schema or choice per row, or none): the target's law at every scored
      position is masked by the state the drafted tokens before it reach, so
      the output has the constrained target's law (greedy: constrained greedy
      decoding); for a token tree, each node's path from the root.
    verify_lengths: None (verify every drafted token), or the few verify lengths
      to compile (distinct ints in [1, gamma], sorted, gamma among them): each
      iteration verifies the rows' chains cut to the one whose expected tokens
      per cost is best by the drafter's confidence (a chain drafter with
      `gives_confidence`; `specjax.generation.verify_length`). Exact for every
      verifier; `stats.proposed` then counts the tokens verified.
    verify_costs: one relative cost per verify length, positive
      (`specjax.bench.verify_costs.measure_verify_costs` measures them on this machine).
    forced_drafts: under `constraints`, draft the tokens the rows' states force
      (a state allowing one token, and the chain of such states) first, with no
      drafter call, the drafter drafting after them (`SpecConfig.forced_drafts`;
      exact for every verifier; chains only). `stats.forced` counts them.

  Returns:
    `GenerateOutput(tokens [B, max_new_tokens], num_generated [B],
    stats: SpeculativeStats)`.
  """
  sampling = validation.as_rows(sampling, target.cfg.vocab_size, prompts)
  drafter, config = _checked_run(
    target,
    draft,
    prompts,
    prompt_lengths,
    per_row_keys=validation.per_row_keys(key),
    gamma=gamma,
    max_new_tokens=max_new_tokens,
    sampling=sampling,
    eos_id=eos_id,
    verifier=verifier,
    pad_id=pad_id,
    adaptive=adaptive,
    confidence_threshold=confidence_threshold,
    loop=loop,
    loop_chunk=loop_chunk,
    verify_lengths=verify_lengths,
    verify_costs=verify_costs,
    forced_drafts=forced_drafts,
  )
  key = validation.check_key(key, sampling, batch=jnp.shape(prompts)[0])
  rules = constraints_lib.check_rows(constraints, jnp.shape(prompts)[0], target.cfg.vocab_size)
  # Modules (and drafters) are passed as pytrees, as in autoregressive_generate.
  return _speculative_program(
    target,
    drafter,
    jnp.asarray(prompts, jnp.int32),
    jnp.asarray(prompt_lengths, jnp.int32),
    key,
    sampling if isinstance(sampling, RowSampling) else None,
    rules,
    config=config,
  )


def _checked_run(
  target,
  draft,
  prompts,
  prompt_lengths,
  *,
  gamma,
  adaptive,
  confidence_threshold,
  loop="while",
  loop_chunk=8,
  per_row_keys=False,
  verify_lengths=None,
  verify_costs=None,
  forced_drafts=True,
  **settings,
) -> tuple[Drafter, SpecConfig]:
  """`speculative_generate`'s checks before compiling: `(drafter, config)`."""

  drafter = as_drafter(draft)
  gamma = check_positive_int("gamma", gamma)
  verifier, sampling = settings.pop("verifier"), settings["sampling"]
  args = validation.check_generate_args(
    target.cfg, "target", prompts, prompt_lengths, gamma=gamma, **settings
  )
  if adaptive not in ADAPTIVE:
    raise ValueError(f"adaptive must be one of {ADAPTIVE}, got {adaptive!r}.")
  loop, loop_chunk = check_loop(loop, loop_chunk)
  if not isinstance(forced_drafts, bool):
    raise ValueError(f"forced_drafts must be True or False, got {forced_drafts!r}.")
  drafter = check_drafter(
    drafter,
    target,
    prompt_width=args.width,
    max_new_tokens=args.max_new_tokens,
    gamma=gamma,
    verifier=verifier,
    adaptive=adaptive,
  )
  if adaptive == "confidence":
    drafter = drafter.with_confidence(confidence_threshold)
  verify_lengths, verify_costs = verify_length.check_verify_lengths(
    verify_lengths, verify_costs, gamma, drafter
  )
  rule = validation.resolve_verifier(
    "auto" if drafter.tree is not None and verifier == "auto" else verifier,
    sampling,
    per_row_keys=per_row_keys,
  )
  config = SpecConfig(
    gamma=gamma,
    max_new_tokens=args.max_new_tokens,
    sampling=None if isinstance(sampling, RowSampling) else sampling,
    # A tree is verified as the proposal's tree says (`verify_block`).
    verifier="tree" if drafter.tree is not None else rule,
    coupled=rule == "coupled",
    eos_id=args.eos_id,
    pad_id=args.pad_id,
    adaptive=adaptive,
    loop=loop,
    loop_chunk=loop_chunk,
    verify_lengths=verify_lengths,
    verify_costs=verify_costs,
    forced_drafts=forced_drafts,
  )
  return drafter, config
