"""Rows of the engine's batch: which fields are per row, and the programs that move them.

The engine keeps live rows in front so that a light load runs a small batch
(`specjax.serving.scheduler`); these are the pieces that take rows apart and
put them back, leaf by leaf over a `specjax.serving.slots.SlotState`:

  map_rows           a function applied to every per-row leaf (leading axis B)
  prefix, put_prefix the rows a step at width W runs on, and writing them back
  set_row, get_row   one row written or read at a traced index
  move               one slot's row copied into another
  release            slots marked done (cancelled requests stop committing)
  shift_constraints  constrained rows' states moved with their automata
                     (`specjax.serving.constraint_table` packed the table)

On a mesh (rows over `data`) a row is written and read by a mask, never by a
dynamic index into the sharded axis, and a step at width W runs on the first
W / D rows of each of the D row blocks (`specjax.serving.mesh.row_order`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from specjax import constraints
from specjax.serving.mesh import constrain_slots

if TYPE_CHECKING:
  from specjax.serving.batch import SlotState

# SpecState fields that hold one entry per row (the rest are batch-wide).
ROW_FIELDS = (
  "target_cache",
  "drafter_state",
  "recent",
  "draft_limit",
  "tokens",
  "num_generated",
  "done",
  "budget",
  "stop",
  "sampling",
  "constraint_state",
  "history",
)
ROW_STATS = (
  "proposed",
  "accepted",
  "evaluated",
  "row_iterations",
  "generated",
  "forced",
  "non_finite",
)
SLOT_FIELDS = ("prompts", "prompt_lengths", "row_keys", "logprobs", "positions")


def map_rows(fn, *states: SlotState) -> SlotState:
  """Applies `fn` to every per-row leaf (leading axis B) of `states`, leaf by
  leaf; the batch-wide leaves (keys, step counters) come from the first."""
  first = states[0]

  def rows(get):
    return jax.tree.map(fn, *(get(s) for s in states))

  stats = first.spec.stats.replace(
    **{f: rows(lambda s, f=f: getattr(s.spec.stats, f)) for f in ROW_STATS}
  )
  spec = first.spec.replace(
    **{f: rows(lambda s, f=f: getattr(s.spec, f)) for f in ROW_FIELDS}, stats=stats
  )
  return first.replace(
    spec=spec,
    **{f: rows(lambda s, f=f: getattr(s, f)) for f in SLOT_FIELDS},
  )


def _blocked(x: jax.Array, blocks: int) -> jax.Array:
  """`[B, ...]` as `[D, B / D, ...]`: each row block (one `data` device's) apart."""
  return x.reshape(blocks, x.shape[0] // blocks, *x.shape[1:])


def prefix(state: SlotState, width: int, blocks: int = 1) -> SlotState:
  """The rows a step at `width` runs on: the first `width / D` of each row block
  (on one device, simply the first `width`)."""
  if width == state.prompts.shape[0]:
    return state
  if blocks == 1:
    return map_rows(lambda x: x[:width], state)
  return map_rows(
    lambda x: _blocked(x, blocks)[:, : width // blocks].reshape(width, *x.shape[1:]), state
  )


def put_prefix(state: SlotState, part: SlotState, width: int, blocks: int = 1) -> SlotState:
  """`state` with its `prefix` rows (and the batch-wide leaves) from `part`."""
  if width == state.prompts.shape[0]:
    return part
  if blocks == 1:
    return map_rows(lambda new, full: full.at[:width].set(new), part, state)

  def put(new, full):
    rows = _blocked(full, blocks).at[:, : width // blocks].set(_blocked(new, blocks))
    return rows.reshape(full.shape)

  return map_rows(put, part, state)


def _row_mask(x: jax.Array, row: jax.Array) -> jax.Array:
  """`[B, 1, ...]` bool, True at row `row` (broadcasts against `x [B, ...]`)."""
  return (jnp.arange(x.shape[0]) == row).reshape(-1, *(1,) * (x.ndim - 1))


def set_row(full: jax.Array, new: jax.Array, row: jax.Array, mesh: Mesh | None) -> jax.Array:
  """`full [B, ...]` with row `row` (traced) replaced by `new [1, ...]`. On a
  mesh by a mask: a dynamic update of an axis split over devices would have
  XLA gather the whole array (a cache) to each device first."""
  if mesh is None:
    return full.at[row].set(new[0])
  return jnp.where(_row_mask(full, row), new, full)


def get_row(x: jax.Array, row: jax.Array, mesh: Mesh | None) -> jax.Array:
  """`x[row]` (traced row); on a mesh a masked sum over the rows, which moves
  one row between devices (an all-reduce of its size), not the array."""
  if mesh is None:
    return x[row]
  picked = jnp.where(_row_mask(x, row), x, jnp.zeros((), x.dtype))
  return jnp.any(picked, axis=0) if x.dtype == jnp.bool_ else jnp.sum(picked, axis=0, dtype=x.dtype)


def placed(state: SlotState, mesh: Mesh | None) -> SlotState:
  """`state` where the engine keeps it (`specjax.serving.mesh.constrain_slots`)."""
  return constrain_slots(state, mesh, state.prompts.shape[0])


def _move(state: SlotState, source: jax.Array, dest: jax.Array, mesh: Mesh | None = None):
  state = map_rows(lambda x: set_row(x, get_row(x, source, mesh)[None], dest, mesh), state)
  return placed(state, mesh)


def _shift_constraints(state: SlotState, shift: jax.Array, mesh: Mesh | None = None):
  """Each constrained row's state moved by `shift [B]` (its automaton moved in
  the table: `specjax.serving.constraint_table`); unconstrained rows stay FREE."""
  states = state.spec.constraint_state
  moved = jnp.where(states > constraints.FREE, states + shift, states)
  return placed(state.replace(spec=state.spec.replace(constraint_state=moved)), mesh)


def _release(state: SlotState, slots: jax.Array, mesh: Mesh | None = None) -> SlotState:
  """Slots `slots [B]` (bool) stop: marked done, they commit nothing more."""
  return placed(state.replace(spec=state.spec.replace(done=state.spec.done | slots)), mesh)


# The batch state is donated: a row move rewrites the caches in place.
move = jax.jit(_move, static_argnames=("mesh",), donate_argnames=("state",))
release = jax.jit(_release, static_argnames=("mesh",), donate_argnames=("state",))
shift_constraints = jax.jit(
  _shift_constraints, static_argnames=("mesh",), donate_argnames=("state",)
)


def check_per_row(tree: Any, batch: int, what: str) -> None:
  """Raises unless every leaf of `tree` has leading axis `batch` (the engine moves
  rows between slots leaf by leaf)."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    if getattr(leaf, "ndim", 0) < 1 or leaf.shape[0] != batch:
      raise ValueError(
        f"{what}: every leaf must have one row per slot (leading axis {batch}) for the "
        f"engine to move rows; {jax.tree_util.keystr(path)} has shape "
        f"{getattr(leaf, 'shape', ())}."
      )
