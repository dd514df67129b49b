"""The engine's constraint table: the requests' automata at stable offsets.

Every step program takes one `specjax.constraints.ConstraintTable` of a fixed
number of states (`EngineConfig.constraint_states`), so admitting a request
with a new constraint changes the table's contents, never its shape, and
recompiles nothing. A live row's state is an absolute index into the table,
so automata stay where they were placed: a new one is appended after the
others. Automata are interned by their content (`content_key`, a hash of the
compiled table), not by object: requests with equal automata share one block,
whichever process unpickled them (`specjax.serving.lockstep`: the leader
reuses its cached object while each follower receives a fresh copy, and both
must take the same decisions). Only when the table is full are the automata
no live row follows dropped and the rest packed to the front, with each live
row's state shifted by its automaton's move: `ConstraintPlacement.plan` says
where everything goes, the engine shifts the rows (`rows.shift_constraints`),
and only then `commit` moves the table, so rows and table move together or
not at all.

The layout is fixed once: dense `[S, V]` while that stays small, else token
classes (`specjax.constraints`) with room for `CLASSES` of them; automata
whose classes together exceed that grow the table (one recompilation).
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from specjax import constraints
from specjax.constraints import Automaton

# Token classes the class layout's table holds before it grows: a JSON schema
# over a 131k vocabulary takes 179-426 (docs/usage.md), a few live ones share.
CLASSES = 1024


def content_key(automaton: Automaton) -> bytes:
  """A hash of `automaton`'s compiled table (its classes, transitions, start and
  accepting states): equal automata have one key in every process."""
  digest = hashlib.blake2b(digest_size=16)
  for array in (automaton.class_next, automaton.token_class, automaton.accepting):
    array = np.ascontiguousarray(array)
    digest.update(f"{array.dtype.str}{array.shape}".encode())
    digest.update(array.tobytes())
  digest.update(str(automaton.start).encode())
  return digest.digest()


class Plan(NamedTuple):
  """Where `ConstraintPlacement.plan` puts a new automaton, before anything moves.

  Attributes:
    start: the new automaton's start state.
    shifts: `{content_key: shift}` for every live automaton that moves (empty
      unless the table is packed): their rows' states move by as much.
    placed, table, offsets: the placement after `commit`.
    packed: whether the table was packed.
  """

  start: int
  shifts: dict[bytes, int]
  placed: list[Automaton]
  table: constraints.ConstraintTable | None
  offsets: dict[bytes, int]
  packed: bool = False


class ConstraintPlacement:
  """Which automata the table holds, where, and the device table itself.

  Args:
    vocab_size: the target's vocabulary.
    num_states: the table's states, the unconstrained state `FREE` included.
  """

  def __init__(self, vocab_size: int, num_states: int):
    self.vocab_size, self.num_states = vocab_size, num_states
    self.placed: list[Automaton] = []  # in table order, one per content
    self.offsets: dict[bytes, int] = {}  # content key -> its first state
    # Each automaton object's key, hashed once (a waiting request asks every step).
    self._keys: weakref.WeakKeyDictionary[Automaton, bytes] = weakref.WeakKeyDictionary()
    self.packs = 0  # times the table was packed
    dense = num_states * vocab_size * 4 <= constraints.DENSE_LIMIT_BYTES
    self.layout = "dense" if dense else "sparse"
    self.table, self.offsets = self._build([])

  def key(self, automaton: Automaton) -> bytes:
    """`content_key(automaton)`, remembered for the object."""
    key = self._keys.get(automaton)
    if key is None:
      key = self._keys[automaton] = content_key(automaton)
    return key

  def fits(self, automaton: Automaton) -> bool:
    """Whether `automaton` can ever be placed (alone with FREE)."""
    return 1 + automaton.num_states <= self.num_states

  def holds(self, automaton: Automaton) -> bool:
    """Whether `automaton` (or an equal one) is in the table now."""
    return self.key(automaton) in self.offsets

  def _build(self, placed: list[Automaton]) -> tuple[constraints.ConstraintTable, dict]:
    """The table of `placed` and each one's first state, by content key."""
    rules = constraints.row_constraints(
      placed, self.vocab_size, self.num_states, num_classes=CLASSES, layout=self.layout
    )
    starts = np.asarray(rules.start)
    offsets = {self.key(a): int(s) - a.start for a, s in zip(placed, starts)}
    return rules.table, offsets

  def plan(self, automaton: Automaton, live: Sequence[Automaton]) -> Plan | None:
    """Where `automaton` goes, without moving anything (`commit` does).

    Args:
      automaton: the new request's.
      live: the automata live rows follow (kept when the table is packed).

    Returns:
      None when it does not fit beside the live ones now (the request waits),
      else the `Plan` (no shifts, nothing to build when an equal automaton is
      in the table already). A failed build raises and changes nothing.
    """
    key = self.key(automaton)
    if key in self.offsets:
      return Plan(self.offsets[key] + automaton.start, {}, self.placed, self.table, self.offsets)
    placed, packed = self.placed, False
    used = 1 + sum(a.num_states for a in placed)
    if used + automaton.num_states > self.num_states:  # pack the live ones first
      # One per content, in the order of the rows that follow them (the same in every
      # process), the object already in the table.
      by_key = {self.key(a): a for a in self.placed}
      placed = [by_key[k] for k in dict.fromkeys(self.key(a) for a in live) if k in by_key]
      if 1 + sum(a.num_states for a in placed) + automaton.num_states > self.num_states:
        return None
      packed = True
    placed = [*placed, automaton]
    table, offsets = self._build(placed)
    shifts = {k: offsets[k] - v for k, v in self.offsets.items() if offsets.get(k, v) != v}
    return Plan(offsets[key] + automaton.start, shifts, placed, table, offsets, packed)

  def commit(self, plan: Plan) -> None:
    """The table becomes `plan`'s (once the live rows' states were shifted by it)."""
    self.placed, self.table, self.offsets = plan.placed, plan.table, plan.offsets
    self.packs += plan.packed
