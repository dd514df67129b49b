"""The engine's scheduler: which request runs in which slot, and when.

It keeps the queue and the request each slot holds, and decides, before each
step (after vLLM's v1 scheduler, which keeps the same apart from its runner):

  admission    queued requests into free slots, in arrival order; a request
               whose constraint does not fit the table beside the live ones
               waits (`place`), without holding back unconstrained requests
  placement    a request's automaton in the constraint table
               (`specjax.serving.constraint_table`): the table is committed
               only once the live rows' states moved with it
  expiry       the requests past their deadline (`late`)
  compaction   live rows moved into the first slots, so that a light load
               runs the smallest compiled width (`compact`)

It asks the runner (`specjax.serving.runner`) to prefill, move, release and
shift rows; the engine streams and finishes requests (`specjax.serving.output`).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import numpy as np

from specjax import constraints
from specjax.serving.config import EngineConfig
from specjax.serving.constraint_table import ConstraintPlacement
from specjax.serving.mesh import row_order
from specjax.serving.request import Request


@dataclasses.dataclass
class Live:
  """Host bookkeeping of a request that holds a slot (or waits for one)."""

  request_id: int
  request: Request
  arrival_time: float
  emitted: int = 0  # tokens streamed so far
  tokens: list[int] = dataclasses.field(default_factory=list)
  first_token_time: float | None = None

  @property
  def deadline(self) -> float | None:
    timeout = self.request.timeout_s
    return None if timeout is None else self.arrival_time + timeout


class TableStart(NamedTuple):
  """Where an admitted request's constraint starts in the table.

  Attributes:
    state: its start state (`FREE` without a constraint); None when the engine
      has no table (its programs take no start states).
    waits: its automaton does not fit beside the live rows' yet (`state` None).
  """

  state: int | None
  waits: bool = False


NO_TABLE = TableStart(None)
WAIT = TableStart(None, waits=True)


class Scheduler:
  """The queue, the slots' requests, and the decisions on them.

  Args:
    config: the engine's (fitted) `EngineConfig`.
    runner: the engine's `Runner`, which runs the row programs decided here.
    placement: the constraint table's placement, or None (no table).
    counters: the engine's counters (waits, moves, table packs are counted here).
  """

  def __init__(
    self,
    config: EngineConfig,
    runner,
    placement: ConstraintPlacement | None,
    counters: collections.Counter,
  ):
    self.config, self.runner, self.placement = config, runner, placement
    self.queue: collections.deque[Live] = collections.deque()
    self.queued: dict[int, Live] = {}
    self.slots: list[Live | None] = [None] * config.slots  # None: free
    # The order slots fill in: each step's rows spread evenly over `data`.
    self.order = row_order(config.slots, config.data)
    self.counters = counters
    self._ids = itertools.count()

  # ------------------------------------------------------------------ requests

  def enqueue(self, request: Request) -> int:
    """Queues `request` (checked); returns its id."""
    live = Live(next(self._ids), request, time.perf_counter())
    self.queue.append(live)
    self.queued[live.request_id] = live
    return live.request_id

  def dequeue(self, request_id: int) -> Live | None:
    """Takes a queued request out of the queue (None: it is not queued)."""
    live = self.queued.pop(request_id, None)
    if live is not None:
      self.queue.remove(live)
    return live

  def slot_of(self, request_id: int) -> int | None:
    return next((i for i, s in self.seated() if s.request_id == request_id), None)

  def release(self, slot: int) -> Live:
    """Frees `slot` now (its row stops committing); returns its request."""
    mask = np.zeros(self.config.slots, bool)
    mask[slot] = True
    self.runner.release(mask)
    live, self.slots[slot] = self.slots[slot], None
    return live

  def leave(self, request_ids: Iterable[int]) -> None:
    """Frees the slots of the requests `request_ids` (they finished)."""
    gone = set(request_ids)
    for slot, live in self.seated():
      if live.request_id in gone:
        self.slots[slot] = None

  def evict(self) -> list[Live]:
    """Empties every slot (their batch was lost); returns their requests."""
    lost = [live for _, live in self.seated()]
    self.slots = [None] * self.config.slots
    return lost

  def seated(self, only: Iterable[int] | None = None) -> Iterator[tuple[int, Live]]:
    """`(slot, request)` of the held slots (of `only`, if given), in slot order."""
    for slot in range(self.config.slots) if only is None else only:
      if self.slots[slot] is not None:
        yield slot, self.slots[slot]

  @property
  def running(self) -> int:
    return sum(live is not None for live in self.slots)

  def late(self) -> list[int]:
    """The ids of the requests past their deadline (`Request.timeout_s`)."""
    now = time.perf_counter()
    return [
      live.request_id
      for live in (*self.queue, *(live for _, live in self.seated()))
      if live.deadline is not None and now >= live.deadline
    ]

  def asked(self) -> bool:
    """Whether a live request asked for log-probabilities (else none are computed)."""
    return any(live.request.logprobs is not None for _, live in self.seated())

  def capped(self, gamma: int) -> int:
    """The policy's draft length, no longer than any live request lets a step
    draft for it (`Request.max_draft_tokens`), among the compiled lengths. Each
    row's own cap is its `draft_limit`, set at admission."""
    caps = [live.request.max_draft_tokens for _, live in self.seated()]
    bound = max(gamma if cap is None else min(gamma, cap) for cap in caps)
    fits = [g for g in self.config.draft_lengths if g <= bound]
    return max(fits) if fits else min(self.config.draft_lengths)

  # ----------------------------------------------------------------- admission

  def admit(self, target_only: bool) -> tuple[list[int], list[tuple[Live, str]]]:
    """Prefills queued requests into the free slots in fill order, in arrival
    order (`target_only`: the target's prefill alone, after plain steps).

    A constrained request whose automaton does not fit beside the live ones
    waits, and does not hold back the unconstrained requests behind it (they
    need no table room); constrained ones behind it wait too, so the live
    automata drain and it is not starved. A request that fails to be placed or
    prefilled fails alone, unless the batch was lost with it.

    Returns:
      the slots admitted into, and the requests that failed with their errors
      (every live one when the batch was lost: the runner has a fresh one).
    """
    admitted, failed = [], []
    blocked = False  # a constrained request waits for table room
    for live in list(self.queue):
      if None not in self.slots:
        break
      if blocked and live.request.constraint is not None:
        continue
      try:
        start = self.place(live.request.constraint)
        if start.waits:
          blocked = True
          self.counters["constraint_waits"] += 1
          continue
        self.dequeue(live.request_id)
        slot = self._free_slot()
        self.runner.admit(slot, live.request, self.runner.admission_key(), start.state, target_only)
      except Exception as error:  # one request's failure is its own
        self.dequeue(live.request_id)
        failed.append((live, f"{type(error).__name__}: {error}"))
        if self.runner.lost():  # it failed after the batch was donated: the batch is gone
          failed += [(s, f"admission failed: {failed[-1][1]}") for s in self.evict()]
          self.runner.reset()
          admitted = []
        continue
      self.slots[slot] = live
      admitted.append(slot)
      self.counters["admitted_target_only"] += target_only
    return admitted, failed

  def place(self, automaton: constraints.Automaton | None) -> TableStart:
    """The start state of a request's constraint, placed in the table. When
    placing it packs the table, the live rows' states are shifted first and the
    table committed after: if the shift fails, neither moved."""
    if self.placement is None:
      return NO_TABLE
    if automaton is None:
      return TableStart(constraints.FREE)
    live = [s.request.constraint for _, s in self.seated() if s.request.constraint is not None]
    plan = self.placement.plan(automaton, live)
    if plan is None:
      return WAIT
    if plan.shifts:
      shift = np.zeros(self.config.slots, np.int32)
      for slot, s in self.seated():
        if s.request.constraint is not None:
          shift[slot] = plan.shifts.get(self.placement.key(s.request.constraint), 0)
      self.runner.shift_constraints(shift)
    self.placement.commit(plan)
    self.counters["constraint_table_packs"] = self.placement.packs
    return TableStart(plan.start)

  def _free_slot(self) -> int:
    """The first free slot in fill order (`specjax.serving.mesh.row_order`)."""
    return next(i for i in self.order if self.slots[i] is None)

  # ---------------------------------------------------------------- compaction

  def compact(self) -> int:
    """Moves live rows into the first slots (in fill order) when that lets the
    step run at a smaller width; returns the width of the next step."""
    live = [slot for slot, _ in self.seated()]
    width = next(w for w in self.config.step_widths if w >= len(live))
    inside = set(self.order[:width])  # the rows a step at `width` runs on
    for source in [i for i in live if i not in inside]:
      dest = self._free_slot()
      self.runner.move(source, dest)
      self.slots[dest], self.slots[source] = self.slots[source], None
      self.counters["moves"] += 1
    return width
