"""The engine's constraint table: the requests' automata at stable offsets.

Every step program takes one `specjax.constraints.ConstraintTable` of a fixed
number of states (`EngineConfig.constraint_states`), so admitting a request
with a new constraint changes the table's contents, never its shape, and
recompiles nothing. A live row's state is an absolute index into the table,
so automata stay where they were placed: a new one is appended after the
others; requests with the same automaton object share its states. Only when
the table is full are the automata no live row follows dropped and the rest
packed to the front, with each live row's state shifted by its automaton's
move (`ConstraintPlacement.place`'s shifts, applied by `slots.shift_constraints`).

The layout is fixed once: dense `[S, V]` while that stays small, else token
classes (`specjax.constraints`) with room for `CLASSES` of them; automata
whose classes together exceed that grow the table (one recompilation).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specjax import constraints
from specjax.constraints import Automaton

# Token classes the class layout's table holds before it grows: a JSON schema
# over a 131k vocabulary takes 179-426 (docs/usage.md), a few live ones share.
CLASSES = 1024


class ConstraintPlacement:
  """Which automata the table holds, where, and the device table itself.

  Args:
    vocab_size: the target's vocabulary.
    num_states: the table's states, the unconstrained state `FREE` included.
  """

  def __init__(self, vocab_size: int, num_states: int):
    self.vocab_size, self.num_states = vocab_size, num_states
    self.placed: list[Automaton] = []  # in table order
    self.offsets: dict[int, int] = {}  # id(automaton) -> its first state
    self.packs = 0  # times the table was packed
    dense = num_states * vocab_size * 4 <= constraints.DENSE_LIMIT_BYTES
    self.layout = "dense" if dense else "sparse"
    self.table = self._build()

  def fits(self, automaton: Automaton) -> bool:
    """Whether `automaton` can ever be placed (alone with FREE)."""
    return 1 + automaton.num_states <= self.num_states

  def _used(self) -> int:
    return 1 + sum(a.num_states for a in self.placed)

  def holds(self, automaton: Automaton) -> bool:
    """Whether `automaton` is in the table now."""
    return id(automaton) in self.offsets

  def _build(self, placed: list[Automaton] | None = None) -> constraints.ConstraintTable:
    """The table of `placed` (default: `self.placed`); sets `offsets` only once
    it is built, so a failed build leaves the placement as it was."""
    placed = self.placed if placed is None else placed
    rules = constraints.row_constraints(
      placed, self.vocab_size, self.num_states, num_classes=CLASSES, layout=self.layout
    )
    starts = np.asarray(rules.start)
    self.offsets = {id(a): int(s) - a.start for a, s in zip(placed, starts)}
    return rules.table

  def place(
    self, automaton: Automaton, live: Sequence[Automaton]
  ) -> tuple[int, dict[int, int]] | None:
    """Puts `automaton` in the table (if it is not there yet).

    Args:
      automaton: the new request's.
      live: the automata live rows follow (kept when the table is packed).

    Returns:
      None when it does not fit beside the live ones now (the request waits);
      else `(start, shifts)`: its start state, and `{id(a): shift}` for every
      live automaton that moved (empty unless the table was packed).
    """
    if id(automaton) in self.offsets:
      return self.offsets[id(automaton)] + automaton.start, {}
    before = dict(self.offsets)
    placed, packed = self.placed, False
    if self._used() + automaton.num_states > self.num_states:  # pack the live ones first
      placed = list({id(a): a for a in live if id(a) in self.offsets}.values())
      if 1 + sum(a.num_states for a in placed) + automaton.num_states > self.num_states:
        return None
      packed = True
    # Built first, committed after: a build that raises leaves placed, offsets and
    # the table as they were (no automaton the table does not hold).
    table = self._build([*placed, automaton])
    self.placed, self.table = [*placed, automaton], table
    self.packs += packed
    shifts = {k: self.offsets[k] - v for k, v in before.items() if self.offsets.get(k, v) != v}
    return self.offsets[id(automaton)] + automaton.start, shifts
