"""The engine's loop in a thread of its own, for callers in other threads.

  background = BackgroundEngine(engine)
  rid = background.submit(request, on_event)   # ValueError here for a bad request
  background.cancel(rid)
  background.close()

`Engine` is single-threaded: every call into it happens in the one daemon thread
started here. Callers hand it work (submit, cancel, a function of the engine)
through a queue of operations; the thread runs them between steps, steps while
the engine has work and otherwise sleeps on a condition variable (no polling).
A submitting thread waits for its operation, so a bad request's ValueError is
raised in the caller's thread, at most one step after the call.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any

from specjax.serving.request import Event, Request

logger = logging.getLogger(__name__)

EventCallback = Callable[[Event], None]

# After `engine.step()` raises, the loop waits before stepping again (doubling up
# to the cap, reset by the next good step), so an engine that keeps failing does
# not spin a core.
_RETRY_S, _MAX_RETRY_S = 0.01, 1.0


class BackgroundEngine:
  """Runs `engine` (a `specjax.serving.Engine`, or anything with its API) in a
  daemon thread; every method is thread-safe.

  Events reach each request's `on_event` callback in the engine thread, in
  order, the finished event last; a callback must be quick (hand the event to
  another thread or event loop) since the next step waits for it.
  """

  def __init__(self, engine, name: str = "specjax-engine"):
    self.engine = engine
    self._cond = threading.Condition()  # guards _operations and _closing
    self._operations: list[Callable[[], None]] = []
    self._closing = False
    # request id -> callback, for requests not finished yet; engine thread only.
    self._callbacks: dict[int, EventCallback] = {}
    self._failures = 0  # consecutive failed steps
    self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
    self._thread.start()

  # -- callers' side -------------------------------------------------------------

  def submit(self, request: Request, on_event: EventCallback) -> int:
    """Queues `request`; returns its id. `on_event(event)` is then called from
    the engine thread for each of its events.

    Raises:
      ValueError: the engine refused the request (the message names the field).
      RuntimeError: the engine was closed.
    """
    return self.call(self._submitter(request, on_event))

  def submit_future(self, request: Request, on_event: EventCallback) -> futures.Future:
    """`submit` without waiting: a future of the request id (or of the
    ValueError), for callers that must not block, such as an event loop
    (`await asyncio.wrap_future(...)`)."""
    return self.call_future(self._submitter(request, on_event))

  def _submitter(self, request: Request, on_event: EventCallback) -> Callable[[Any], int]:
    def submit(engine) -> int:
      rid = engine.submit(request)
      self._callbacks[rid] = on_event  # before the next step can emit its events
      return rid

    return submit

  def cancel(self, request_id: int, reason: str = "cancelled") -> None:
    """Asks the engine to cancel `request_id` (its slot is freed at the next
    step, and it finishes with finish_reason `reason`). Returns at once;
    an unknown or finished id is ignored, and so is a closed engine (closing
    cancels everything)."""
    with contextlib.suppress(RuntimeError):
      self._post(lambda: self._cancel(request_id, reason))

  def metrics(self) -> dict:
    """`engine.metrics()`, read in the engine thread."""
    return self.call(lambda engine: engine.metrics())

  def call(self, fn: Callable[[Any], Any]) -> Any:
    """`fn(engine)` run in the engine thread between steps; returns its result
    or raises its exception here. (Called from the engine thread itself, e.g.
    from a callback, it runs at once.)"""
    if threading.current_thread() is self._thread:
      return fn(self.engine)
    return self._wait(self.call_future(fn))

  def call_future(self, fn: Callable[[Any], Any]) -> futures.Future:
    """`call` without waiting: a future of `fn(engine)`'s result.

    Raises:
      RuntimeError: the engine was closed.
    """
    future: futures.Future = futures.Future()

    def run() -> None:
      if not future.set_running_or_notify_cancel():
        return  # the caller gave up before it ran
      try:
        future.set_result(fn(self.engine))
      except BaseException as e:  # handed to the caller, raised in its thread
        future.set_exception(e)

    self._post(run)
    return future

  def close(self, timeout: float | None = 30.0) -> None:
    """Cancels queued and live requests (their callbacks get their "cancelled"
    events), stops the thread and joins it. Later calls raise RuntimeError;
    closing twice is harmless."""
    with self._cond:
      self._closing = True
      self._cond.notify()
    if threading.current_thread() is not self._thread:
      self._thread.join(timeout)
      if self._thread.is_alive():
        logger.warning("the engine thread did not stop within %s s", timeout)

  @property
  def closed(self) -> bool:
    return self._closing

  def _post(self, operation: Callable[[], None]) -> None:
    with self._cond:
      if self._closing:
        raise RuntimeError("the engine is closed")
      self._operations.append(operation)
      self._cond.notify()

  def _wait(self, future: futures.Future) -> Any:
    """The future's result; raises if the engine thread died before running it."""
    while True:
      try:
        return future.result(timeout=0.5)
      except futures.TimeoutError:  # not the builtin TimeoutError before Python 3.11
        if not self._thread.is_alive():
          raise RuntimeError("the engine thread has stopped") from None

  # -- the engine thread ---------------------------------------------------------

  def _loop(self) -> None:
    while True:
      with self._cond:
        while not (self._operations or self._closing or self.engine.has_work()):
          self._cond.wait()
        operations, self._operations = self._operations, []
        closing = self._closing
      for operation in operations:
        operation()
      if closing:
        self._shut_down()
        return
      if self.engine.has_work():
        self._step()

  def _step(self) -> None:
    try:
      events = self.engine.step()
    except Exception as e:
      self._step_failed(e)
      return
    self._failures = 0
    for event in events:
      self._dispatch(event)

  def _dispatch(self, event: Event) -> None:
    callback = self._callbacks.get(event.request_id)
    if event.finished:
      self._callbacks.pop(event.request_id, None)
    if callback is None:
      return
    try:
      callback(event)
    except Exception:
      # A broken consumer loses its request, nobody else's.
      logger.exception("on_event of request %d raised; cancelling it", event.request_id)
      if not event.finished:
        self._callbacks.pop(event.request_id, None)
        self._cancel(event.request_id)

  def _step_failed(self, error: Exception) -> None:
    """Fails every unfinished request with an "error" event and cancels it in
    the engine (which may not be in a state to resume them), then waits a
    little before the next step."""
    logger.exception("engine.step() raised; failing %d request(s)", len(self._callbacks))
    message = f"engine step failed: {type(error).__name__}: {error}"
    failed, self._callbacks = self._callbacks, {}
    for rid, callback in failed.items():
      self._cancel(rid)
      try:
        callback(Event(rid, (), finished=True, finish_reason="error", error=message))
      except Exception:
        logger.exception("on_event of request %d raised", rid)
    self._failures += 1
    with self._cond:  # woken early by new work or close()
      if not (self._operations or self._closing):
        self._cond.wait(min(_RETRY_S * 2 ** (self._failures - 1), _MAX_RETRY_S))

  def _cancel(self, request_id: int, reason: str = "cancelled") -> None:
    try:
      self.engine.cancel(request_id, reason)
    except Exception as e:  # finished already, or an engine in a bad state
      logger.debug("cancel(%d) ignored: %s", request_id, e)

  def _shut_down(self, max_steps: int = 1000) -> None:
    """Cancels everything, then steps until the engine has delivered the
    "cancelled" events (bounded: a failing engine just drops them)."""
    for rid in list(self._callbacks):
      self._cancel(rid)
    for _ in range(max_steps):
      if not self.engine.has_work():
        break
      try:
        events = self.engine.step()
      except Exception:
        logger.exception("engine.step() raised while closing")
        break
      for event in events:
        self._dispatch(event)
    for rid, callback in self._callbacks.items():  # never heard of again: tell them
      try:
        callback(Event(rid, (), finished=True, finish_reason="cancelled"))
      except Exception:
        logger.exception("on_event of request %d raised", rid)
    self._callbacks = {}
