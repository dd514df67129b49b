"""The engine's batch of slots: its state, its static settings, and the counts it reports.

`SlotState` is `speculative_step`'s own `SpecState` for B slots plus each slot's
prompt (`specjax.serving.slots` holds the programs that change it, and
`specjax.serving.rows` those that move its rows). A step hands back its
`StepCounts`, summed over its rows; each row's own counts since admission are
`RowCounts.of(state)`: named fields, so that the host reads them by name.
"""

from __future__ import annotations

import dataclasses

import jax
from flax import struct
from jax.sharding import Mesh

from specjax.generation.state import SpecConfig, SpecState
from specjax.serving.mesh import data_size


@struct.dataclass
class SlotState:
  """The engine's batch: `spec` (rows = slots) and each slot's prompt.

  Attributes:
    spec: `SpecState` with `sampling` a `RowSampling` (every slot its own) and
      `keys` `[1, 2]` (the step's keys, given per call).
    prompts: `[B, P_max]` int32, each slot's prompt, zero-padded.
    prompt_lengths: `[B]` int32.
    row_keys: `[B, 2]` uint32, a seeded row's own key data (zeros: none).
    logprobs: None, or `(logprob [B, L], top_ids [B, L, K], top_logprobs [B, L, K])`
      laid out as `spec.tokens`.
    positions: `[B, 2, G]` int32 (G = the largest draft length), each row's
      counts since its admission: `[:, 0, i]` the steps that drafted a token at
      position i + 1 for it, `[:, 1, i]` those whose drafted token i + 1 was
      accepted (the request's `drafted_at_position` / `accepted_at_position`).
  """

  spec: SpecState
  prompts: jax.Array
  prompt_lengths: jax.Array
  row_keys: jax.Array
  logprobs: tuple | None = None
  positions: jax.Array | None = None


@struct.dataclass
class StepCounts:
  """One step's counts summed over its rows: the policy's acceptance and the
  engine's counters.

  Attributes:
    accepted: drafted tokens accepted (int32 scalar).
    evaluated: drafted tokens the verifier evaluated (alpha's denominator).
    drafted: tokens drafted.
    forced: drafted tokens the grammar forced (`SpecConfig.forced_drafts`).
    at_position: `[2, G]` int32, the rows that drafted (`[0, i]`) and those
      that had accepted (`[1, i]`) a token at position i + 1.
  """

  accepted: jax.Array
  evaluated: jax.Array
  drafted: jax.Array
  forced: jax.Array
  at_position: jax.Array


@struct.dataclass
class RowCounts:
  """Each row's counts since its admission (its request's `Completion` figures).

  Attributes:
    proposed, accepted, evaluated, iterations, forced: `[B]` int32, the
      `SpeculativeStats` fields of the row (`iterations`: its `row_iterations`).
    non_finite: `[B]` bool, the row stopped on a law that was not finite.
    positions: `[B, 2, G]` int32, `SlotState.positions`.
  """

  proposed: jax.Array
  accepted: jax.Array
  evaluated: jax.Array
  iterations: jax.Array
  forced: jax.Array
  non_finite: jax.Array
  positions: jax.Array

  @classmethod
  def of(cls, state: SlotState) -> RowCounts:
    s = state.spec.stats
    return cls(
      s.proposed, s.accepted, s.evaluated, s.row_iterations, s.forced, s.non_finite, state.positions
    )


@dataclasses.dataclass(frozen=True)
class SlotConfig:
  """Static settings of the engine's programs (hashable).

  Attributes:
    spec: the `SpecConfig` of `speculative_step` (`gamma` the largest draft
      length, `max_new_tokens` the per-request cap, `sampling` None: per row).
    capacity: KV-cache slots per row.
    max_prompt_len: P_max.
    logprobs: K, the alternatives recorded per token (0: no log-probabilities).
    mesh: None (one device), or the engine's mesh: every program hands the batch
      back placed by `specjax.serving.mesh.slot_shardings`, rows are written
      and read by masks (no dynamic index into a sharded axis), and a step at
      width W runs on the first W / D rows of each of the D row blocks
      (`specjax.serving.mesh.row_order`).
  """

  spec: SpecConfig
  capacity: int
  max_prompt_len: int
  logprobs: int = 0
  mesh: Mesh | None = None

  @property
  def blocks(self) -> int:
    """D, the row blocks (the mesh's `data` size; 1 without a mesh)."""
    return data_size(self.mesh)
