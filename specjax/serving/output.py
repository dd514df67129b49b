"""The engine's output: each step's events, finished requests, and the counters.

After a step (or an admission) the runner hands the host a `Committed` copy of
the rows; `Output.stream` turns each seated request's new tokens into an
`Event`, and finishes the request (a `Completion` in the store, a final event)
when its row is done: "stop" on a stop or EOS token, "length" at its budget,
"error" when its law was not finite (`NON_FINITE`). The engine's counters
(requests by outcome, tokens, drafted and accepted tokens by position, steps
by draft length) are kept here, as vLLM's output processor keeps its stats.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np

from specjax.serving.batch import RowCounts, StepCounts
from specjax.serving.request import Completion, Event
from specjax.serving.scheduler import Live
from specjax.serving.store import CompletionStore

# A row stopped because its law held NaN or +inf (`SpeculativeStats.non_finite`).
NON_FINITE = (
  "the row's sampling law was not finite (NaN or inf) and no token could be drawn "
  "from it exactly: the model's logits, or settings at float32's edge; the request "
  "was stopped rather than given an arbitrary token."
)


class Committed(NamedTuple):
  """Host copies of what the rows hold after a step or an admission.

  Attributes:
    tokens: `[B, L]` int32, each row's generated tokens.
    num_generated: `[B]` int32.
    done: `[B]` bool.
    counts: each row's `RowCounts` since its admission.
    logprobs: `SlotState.logprobs` when a live request asked for them, else None.
  """

  tokens: np.ndarray
  num_generated: np.ndarray
  done: np.ndarray
  counts: RowCounts
  logprobs: tuple | None


class Output:
  """Streams, finishes and counts the engine's requests.

  Args:
    gamma: the largest draft length (the length of a request's counts by position).
    eos_ids: the model's EOS id(s), or None.
  """

  def __init__(self, gamma: int, eos_ids):
    self.gamma = gamma
    self.eos_ids = None if eos_ids is None else np.atleast_1d(eos_ids)
    self.counters = collections.Counter()
    self.completions = CompletionStore()

  def stream(self, seated: Iterable[tuple[int, Live]], committed: Committed) -> list[Event]:
    """Events for the newly committed tokens of the requests in `seated` (slot,
    request) pairs; a request whose row is done gets its final event."""
    now = time.perf_counter()
    events = []
    for slot, live in seated:
      new = committed.tokens[slot, live.emitted : committed.num_generated[slot]].tolist()
      lp = None
      if live.request.logprobs is not None:
        lp = _logprobs(committed.logprobs, slot, live.emitted, len(new), live.request.logprobs)
      if new and live.first_token_time is None:
        live.first_token_time = now
      live.emitted = int(committed.num_generated[slot])
      live.tokens += new
      self.counters["tokens"] += len(new)
      if committed.counts.non_finite[slot]:  # none of the bad draw was committed
        events.append(self.finish(live, "error", NON_FINITE, new, (committed.counts, slot), lp))
      elif committed.done[slot]:
        reason = self._reason(live)
        events.append(self.finish(live, reason, None, new, (committed.counts, slot), lp))
      elif new:
        events.append(Event(live.request_id, tuple(new), logprobs=lp))
    return events

  def _reason(self, live: Live) -> str:
    """Why a done row stopped: "stop" (a stop or EOS token last) or "length"."""
    last, sampling = live.tokens[-1], live.request.sampling
    eos = not sampling.ignore_eos and self.eos_ids is not None and last in self.eos_ids
    stopped = last == live.request.stop_id or last in sampling.stop_token_ids or eos
    return "stop" if stopped else "length"

  def finish(
    self,
    live: Live,
    reason: str,
    error: str | None = None,
    tokens=(),
    row: tuple[RowCounts | None, int] | None = None,
    logprobs=None,
  ) -> Event:
    """Stores `live`'s `Completion` and returns its final event. `row`: the
    rows' counts as last read and the slot it held, whose counts it reports
    (None: it never ran, or its batch was lost)."""
    counts = _row(*(row or (None, None)), self.gamma)
    completion = Completion(
      request_id=live.request_id,
      prompt_length=len(live.request.prompt),
      tokens=list(live.tokens),
      finish_reason=reason,
      arrival_time=live.arrival_time,
      first_token_time=live.first_token_time,
      finish_time=time.perf_counter(),
      error=error,
      **counts,
    )
    self.completions.add(completion)
    self.counters[reason] += 1
    speculation = completion.speculation
    return Event(live.request_id, tuple(tokens), True, reason, error, logprobs, speculation)

  def count_step(self, gamma: int, counts: StepCounts) -> None:
    """Adds one step's `counts` (host values) to the counters."""
    self.counters[f"steps_gamma_{gamma}"] += 1
    self.counters["accepted"] += int(counts.accepted)
    self.counters["evaluated"] += int(counts.evaluated)
    self.counters["drafted"] += int(counts.drafted)
    self.counters["forced"] += int(counts.forced)
    for i, (drafted, accepted) in enumerate(zip(*np.asarray(counts.at_position).tolist())):
      self.counters[f"drafted_at_{i + 1}"] += drafted
      self.counters[f"accepted_at_{i + 1}"] += accepted


def _row(counts: RowCounts | None, slot: int | None, gamma: int) -> dict:
  """`Completion`'s speculation fields of row `slot` of `counts` (zeros: none)."""
  if counts is None or slot is None:
    positions, fields = np.zeros((2, gamma), np.int64), dict.fromkeys(_COUNTED, 0)
  else:
    positions = counts.positions[slot]
    fields = {name: int(getattr(counts, name)[slot]) for name in _COUNTED}
  return dict(
    fields,
    drafted_at_position=tuple(positions[0].tolist()),
    accepted_at_position=tuple(positions[1].tolist()),
  )


_COUNTED = ("proposed", "accepted", "evaluated", "iterations", "forced")


def _logprobs(buffers, slot: int, start: int, count: int, k: int) -> tuple:
  """`Event.logprobs` of a slot's tokens [start, start + count) (`SlotState.logprobs`)."""
  chosen, ids, top = (b[slot, start : start + count] for b in buffers)
  return tuple(
    (float(c), tuple(zip(i[:k].tolist(), t[:k].tolist()))) for c, i, t in zip(chosen, ids, top)
  )
