"""Loop states, statistics and outputs of the generation loops (all pytrees)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.models.kv_cache import KVCache
from specjax.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class SpecConfig:
  """Static settings of speculative decoding (hashable: a jit static argument).

  Attributes:
    gamma: drafted tokens per iteration, >= 1.
    max_new_tokens: generation budget per row, >= 1.
    sampling: the shared warp; None when each row has its own (`SpecState.sampling`).
    verifier: a name in `verify.VERIFIERS` or a verifier function; "tree" for
      a tree drafter (`verify.tree_verify`).
    eos_id: an id or a tuple of ids that stop a row; None: none.
    pad_id: the value written to `tokens` past each row's `num_generated`.
    adaptive: None or "schedule" ("confidence" lives in the drafter).
    loop, loop_chunk: `generation.common.run_loop`'s.
    coupled: draw with the rows' Gumbel noise (`specjax.coupling`): drafting,
      verification (a chain's "coupled" verifier or `coupled_tree_verify`) and
      the first token; the rows' keys are `SpecState.row_keys`.
    verify_lengths: None (verify every drafted token), or the compiled verify
      lengths, sorted, each in [1, gamma] (`speculative_generate` checks that
      gamma is among them): per iteration, when the proposal carries
      `confidence`, the batch verifies its drafts cut to the length with the
      most expected tokens per cost (`verify_length.choose_verify_length`).
      A single length k is verified every iteration (what
      `measure_verify_costs` times).
    verify_costs: with `verify_lengths`, the relative cost of an iteration
      verifying each length (one per length, positive; their scale does not
      matter), e.g. `specjax.bench.verify_costs.measure_verify_costs`.
  """

  gamma: int
  max_new_tokens: int
  sampling: SamplingParams | None
  verifier: Any = "token"
  eos_id: int | tuple[int, ...] | None = None
  pad_id: int = 0
  adaptive: str | None = None
  loop: str = "while"
  loop_chunk: int = 8
  coupled: bool = False
  verify_lengths: tuple[int, ...] | None = None
  verify_costs: tuple[float, ...] | None = None
  forced_drafts: bool = True


@struct.dataclass
class SpeculativeStats:
  """Counters of one `speculative_generate` call.

  Attributes:
    iterations: scalar, speculative iterations the loop ran (batch-wide).
    target_calls: scalar, target forward calls including the prefill.
    draft_calls: scalar, draft model forward calls including the prefill (0
      per iteration for model-free drafters).
    proposed: `[B]` drafted tokens offered per row (a tree: its nodes).
    accepted: `[B]` drafted tokens accepted per row (a tree: the accepted
      paths' nodes, so accepted / evaluated is the chance of going one level
      deeper).
    evaluated: `[B]` accepted + the row's iterations with a rejection;
      accepted / evaluated is the unbiased estimate of alpha.
    row_iterations: `[B]` iterations in which the row was still generating.
    generated: `[B]` tokens the iterations committed (not the prefill's).
    accepted_at_position: `[gamma]`, entry i counts (row, iteration) pairs in
      which drafted token i + 1 (a tree: a node at depth i + 1) was accepted.
    forced: `[B]` of the accepted drafted tokens, those the row's constraint
      forced (`SpecConfig.forced_drafts`): counted in `proposed` and `accepted`
      too, so the drafter's own acceptance is (accepted - forced) /
      (evaluated - forced).
    non_finite: `[B]` int32, 1 where the row met a law that was not finite (NaN
      or +inf: a broken model, or settings at float32's edge) and was stopped
      there, with none of that draw's tokens committed (`specjax.sampling.
      finite_rows`); a server answers such a row with an error.
  """

  iterations: jax.Array
  target_calls: jax.Array
  draft_calls: jax.Array
  proposed: jax.Array
  accepted: jax.Array
  evaluated: jax.Array
  row_iterations: jax.Array
  generated: jax.Array
  accepted_at_position: jax.Array
  forced: jax.Array | None = None
  non_finite: jax.Array | None = None

  @classmethod
  def zeros(cls, batch: int, gamma: int, draft_calls: int = 1) -> SpeculativeStats:
    """Counters before the first iteration: the prefill's target call and
    `draft_calls` draft calls."""

    z = jnp.zeros((batch,), jnp.int32)
    return cls(
      iterations=jnp.int32(0),
      target_calls=jnp.int32(1),
      draft_calls=jnp.int32(draft_calls),
      proposed=z,
      accepted=z,
      evaluated=z,
      row_iterations=z,
      generated=z,
      accepted_at_position=jnp.zeros((gamma,), jnp.int32),
      forced=z,
      non_finite=z,
    )

  def record(
    self,
    *,
    active: jax.Array,
    proposed: jax.Array,
    accepted: jax.Array,
    generated: jax.Array,
    draft_calls: jax.Array,
    forced: jax.Array | None = None,
    non_finite: jax.Array | None = None,
  ) -> SpeculativeStats:
    """The counters after one iteration: `active [B]` the rows still generating
    when it began (only they count), then `proposed`, `accepted`, `generated`
    `[B]`, the iteration's `draft_calls`, `forced [B]` (None: 0) the accepted
    tokens the constraint forced, and `non_finite [B]` bool (None: none) the
    rows whose law was not finite."""
    counted = active.astype(jnp.int32)
    rejected = (accepted < proposed).astype(jnp.int32)
    gamma = self.accepted_at_position.shape[0]
    at_position = (jnp.arange(gamma)[None, :] < accepted[:, None]) & active[:, None]
    return self.replace(
      iterations=self.iterations + 1,
      target_calls=self.target_calls + 1,
      draft_calls=self.draft_calls + draft_calls,
      proposed=self.proposed + counted * proposed,
      accepted=self.accepted + counted * accepted,
      evaluated=self.evaluated + counted * (accepted + rejected),
      row_iterations=self.row_iterations + counted,
      generated=self.generated + generated,
      accepted_at_position=self.accepted_at_position
      + jnp.sum(at_position, axis=0, dtype=jnp.int32),
      forced=self.forced if forced is None else self.forced + counted * forced,
      non_finite=_flagged(self.non_finite, non_finite, active),
    )

  @property
  def acceptance_rate(self) -> jax.Array:
    """alpha estimate over the batch: sum(accepted) / sum(evaluated)."""
    return jnp.sum(self.accepted) / jnp.maximum(jnp.sum(self.evaluated), 1)

  @property
  def tokens_per_iteration(self) -> jax.Array:
    """Generated tokens per (row, iteration): sum(generated) / sum(row_iterations)."""

    return jnp.sum(self.generated) / jnp.maximum(jnp.sum(self.row_iterations), 1)

  def summary(self) -> dict[str, Any]:
    """Plain Python numbers for logs and JSON."""
    return {
      "iterations": int(self.iterations),
      "target_calls": int(self.target_calls),
      "draft_calls": int(self.draft_calls),
      "proposed": np.asarray(self.proposed).tolist(),
      "accepted": np.asarray(self.accepted).tolist(),
      "evaluated": np.asarray(self.evaluated).tolist(),
      "generated": np.asarray(self.generated).tolist(),
      "acceptance_rate": float(self.acceptance_rate),
      "tokens_per_iteration": float(self.tokens_per_iteration),
      "accepted_at_position": np.asarray(self.accepted_at_position).tolist(),
    }


@struct.dataclass
class AutoregressiveStats:
  """Counters of one `autoregressive_generate` call.

  Attributes:
    iterations: scalar, decode steps after the prefill.
    target_calls: scalar, model calls including the prefill.
    non_finite: `[B]` int32, as `SpeculativeStats.non_finite`.
  """

  iterations: jax.Array
  target_calls: jax.Array
  non_finite: jax.Array | None = None


@struct.dataclass
class GenerateOutput:
  """Result of a generation call.

  Attributes:
    tokens: `[B, max_new_tokens]` int32; entries at index >= num_generated[b]
      hold the pad id (`pad_id`, default 0).
    num_generated: `[B]` int32 in [1, max_new_tokens]; an EOS, when hit, is
      the last generated token and is counted. 0 only for a row whose first
      token's law was not finite (`stats.non_finite`).
    stats: `SpeculativeStats` or `AutoregressiveStats`.
  """

  tokens: jax.Array
  num_generated: jax.Array
  stats: Any


def _flagged(before: jax.Array | None, now: jax.Array | None, active: jax.Array):
  """`SpeculativeStats.non_finite` after an iteration that flagged `now [B]`."""
  if now is None:
    return before
  now = (now & active).astype(jnp.int32)
  return now if before is None else jnp.maximum(before, now)


@struct.dataclass
class SpecState:
  """Everything `speculative_step` carries from one iteration to the next.

  With s a row's committed sequence: target_cache holds s[:-1]; drafter_state
  is the drafter's own (a model drafter's cache holds s[:-2]); recent =
  [s[-2], s[-1]] `[B, 2]`, fed to the drafter next (docs/how_it_works.md).
  Attributes besides those:
    draft_limit: `[B]` int32 in [1, gamma], the most tokens each row may draft next.
    tokens: `[B, max_new_tokens + gamma + 1]` output buffer (a block's slack).
    num_generated: `[B]` int32.
    done: `[B]` bool, the row hit EOS or its budget.
    budget: `[B]` int32, the most tokens each row generates (a server's differ).
    stop: `[B]` int32, a row's own stop id besides the config's EOS ids (-1: none).
    keys: `[max_new_tokens, 2]` PRNG keys, row i the (draft, verify) keys
      of iteration i, split once before the loop.
    stats: `SpeculativeStats`.
    sampling: None (the config's static warp), or the rows' own `RowSampling`.
    row_keys: None, or `[B]` typed keys, each row's own (`SpecConfig.coupled`).
    coupled_rows: None (every row is coupled when `SpecConfig.coupled`), or `[B]`
      bool, the rows drawn with their own key's noise (a server's seeded rows);
      the others draw from `keys` as without coupling.
    constraint_state: None, or `[B]` int32, each row's state in its constraint
      after s[-1] (`specjax.constraints`; -1 never happens for committed text).
    history: None (a static warp), or with `sampling` the rows' committed text
      as its penalties read it (`specjax.sampling.TokenHistory`: counts `[B, V]`
      of the generated tokens, the prompt's tokens, the tokens generated).
  """

  target_cache: KVCache
  drafter_state: Any
  recent: jax.Array
  draft_limit: jax.Array
  tokens: jax.Array
  num_generated: jax.Array
  done: jax.Array
  budget: jax.Array
  stop: jax.Array
  keys: jax.Array
  stats: SpeculativeStats
  sampling: Any = None
  row_keys: Any = None
  coupled_rows: Any = None
  constraint_state: Any = None
  history: Any = None


@struct.dataclass
class ARState:
  """Autoregressive loop state: cache holds s[:-1], `last` = s[-1] `[B]`; `tokens`
  `[B, max_new_tokens + 1]`; `uniforms [max_new_tokens, B]`, step i's in row i
  (`[0, B]` when greedy or coupled); `row_keys` None or `[B]` typed keys, each
  row's own for coupled draws (`specjax.coupling`); `constraint_state` None or
  `[B]` int32, each row's state in its constraint (`specjax.constraints`);
  `history` None or the rows' `TokenHistory` (per-row warps, as `SpecState`'s)."""

  cache: KVCache
  last: jax.Array
  tokens: jax.Array
  num_generated: jax.Array
  done: jax.Array
  uniforms: jax.Array
  stats: AutoregressiveStats
  row_keys: Any = None
  constraint_state: Any = None
  history: Any = None
