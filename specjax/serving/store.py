"""Finished requests, kept for their clients and for the engine's metrics.

A client fetches its request's `Completion` by id once the request has
finished (`get`, or `pop` to drop it). A long-running server whose clients
never fetch keeps only the most recent `capacity`; the last `recent` feed the
latency percentiles of `Engine.metrics()`.
"""

from __future__ import annotations

import collections

from specjax.serving.request import Completion


class CompletionStore:
  """Completions by request id (the latest `capacity`) and the last `recent` in order."""

  def __init__(self, capacity: int = 10_000, recent: int = 1000):
    self.capacity = capacity
    self._by_id: collections.OrderedDict[int, Completion] = collections.OrderedDict()
    self._recent: collections.deque[Completion] = collections.deque(maxlen=recent)

  def add(self, completion: Completion) -> None:
    self._by_id[completion.request_id] = completion
    while len(self._by_id) > self.capacity:
      self._by_id.popitem(last=False)
    self._recent.append(completion)

  def get(self, request_id: int) -> Completion:
    """The finished request's `Completion` (KeyError if it has not finished)."""
    return self._by_id[request_id]

  def pop(self, request_id: int) -> Completion:
    """`get`, and forgets it."""
    return self._by_id.pop(request_id)

  def recent(self) -> list[Completion]:
    """The last completions, oldest first."""
    return list(self._recent)
