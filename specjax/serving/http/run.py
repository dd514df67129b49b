"""One HTTP request's choices in the engine: submitted from the event loop,
their events turned into text as they come, cancelled when the answer ends or
the client leaves, their speculation figures summed into `usage`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time

from specjax.serving.background import BackgroundEngine
from specjax.serving.engine import QueueFull
from specjax.serving.http.errors import APIError, finish_error
from specjax.serving.http.fields import field_error
from specjax.serving.http.metrics import Prometheus
from specjax.serving.http.text import ChoiceText
from specjax.serving.request import Event, Request, SpeculationCounts

logger = logging.getLogger(__name__)

# How often a request's handler checks that its client is still connected.
DISCONNECT_POLL_S = 0.25
_DISCONNECTED = object()  # queued by the disconnect watcher


class Run:
  """One HTTP request's choices in the engine (`ChoiceText` each): their text as it
  comes. A choice is closed once answered (a stop string stops its engine row);
  whatever still runs when the answer ends, or the client leaves, is cancelled."""

  def __init__(self, background, http_request, stop, tokenizer, prometheus: Prometheus):
    self.background, self.http_request, self.prometheus = background, http_request, prometheus
    self.stop, self.tokenizer = stop, tokenizer
    self.queue: asyncio.Queue = asyncio.Queue()
    self.ids: dict[int, int] = {}  # open choice -> engine request id
    self.disconnected, self.watcher = False, None
    self.start_time = time.perf_counter()
    zeros = (0,) * background.engine.config.gamma  # one entry per draft position
    self.no_counts = SpeculationCounts(drafted_at_position=zeros, accepted_at_position=zeros)

  async def start(self, requests: list[Request]) -> None:
    loop = asyncio.get_running_loop()
    self.choices = [ChoiceText(self.tokenizer, self.stop) for _ in requests]
    # Each choice's speculation figures, from its engine request's finished event.
    self.counts = [self.no_counts] * len(requests)
    self.running = set(range(len(requests)))  # choices whose engine request has not finished

    def on_event(i: int, event: Event) -> None:  # engine thread -> this event loop
      with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is listening
        loop.call_soon_threadsafe(self.queue.put_nowait, (i, event))

    try:
      for i, request in enumerate(requests):
        self.ids[i] = await submit(self.background, request, functools.partial(on_event, i))
    except BaseException:
      self.close()
      raise
    self.watcher = asyncio.create_task(self._watch())

  async def chunks(self):
    """`(choice, text, [(token, logprob entry)])` as events add to the choices;
    APIError for a choice that failed."""
    try:
      while self.ids:
        item = await self.queue.get()
        if item is _DISCONNECTED:
          self.disconnected = True
          return
        i, event = item
        if event.finished:
          self._finished(i, event)
        if i not in self.ids:
          continue
        if event.finish_reason == "timeout":  # its text so far is its answer
          if not self.choices[i].tokens and not event.tokens:
            raise APIError(
              429, "the request waited past request_timeout_s for a slot.", retry_after=1
            )
          event = dataclasses.replace(event, finish_reason="length")
        error = finish_error(event) if event.finished else None
        if error is not None:
          raise error
        choice = self.choices[i]
        text, counted = choice.add(event)
        if choice.finish_reason is not None:
          del self.ids[i]
          self.background.cancel(event.request_id, "stop")  # a stop string (else a no-op)
          self.prometheus.observe(self.start_time, choice)
        if text or counted or choice.finish_reason:
          yield i, text, counted
    finally:
      self.close()

  def close(self) -> None:
    if self.watcher is not None:
      self.watcher.cancel()
    for rid in self.ids.values():
      self.background.cancel(rid)
    self.ids.clear()

  def _finished(self, i: int, event: Event) -> None:
    self.running.discard(i)
    if event.speculation is not None:
      self.counts[i] = event.speculation

  async def settle(self, timeout_s: float = 10.0) -> None:
    """Waits for the finished events of the choices answered before their engine
    request ended (a stop string stops its row at the engine's next step), so that
    usage counts every step their rows took part in, as the engine's counters do."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while self.running:
      try:
        item = await asyncio.wait_for(self.queue.get(), max(deadline - loop.time(), 0))
      except asyncio.TimeoutError:
        logger.warning("no finished event for choices %s; their usage counts 0", self.running)
        return
      if item is not _DISCONNECTED and item[1].finished:
        self._finished(*item)

  def usage(self, prompt: int) -> dict:
    """OpenAI's usage, and `speculation`: the choices' drafted and accepted tokens
    summed (with n > 1 each choice's own under `choices`); docs/serving.md."""
    n = sum(c.tokens for c in self.choices)
    total = functools.reduce(lambda a, b: a + b, self.counts)
    speculation = total.as_dict()
    if len(self.counts) > 1:
      speculation["choices"] = [{"index": i, **c.as_dict()} for i, c in enumerate(self.counts)]
    return {
      "prompt_tokens": prompt,
      "completion_tokens": n,
      "total_tokens": prompt + n,
      "speculation": speculation,
    }

  async def _watch(self) -> None:
    """Wakes the reader once the client has gone."""
    while not await self.http_request.is_disconnected():
      await asyncio.sleep(DISCONNECT_POLL_S)
    self.queue.put_nowait(_DISCONNECTED)


async def submit(background: BackgroundEngine, request: Request, on_event) -> int:
  """`background.submit` without blocking the event loop; a refused request
  becomes a 400 naming the field."""
  try:
    future = background.submit_future(request, on_event)
  except RuntimeError:
    raise APIError(503, "the server is shutting down.") from None
  try:
    return await asyncio.wrap_future(future)
  except QueueFull as e:
    raise APIError(429, str(e), retry_after=1) from None
  except ValueError as e:
    raise field_error(e) from None
  except RuntimeError:
    raise APIError(503, "the server is shutting down.") from None
  except asyncio.CancelledError:
    # Cancelling the wrapper cancels the submission unless the engine thread
    # has begun it; then cancel the request once it has an id.
    def cancel_submitted(f) -> None:
      if not f.cancelled() and f.exception() is None:
        background.cancel(f.result())

    future.add_done_callback(cancel_submitted)
    raise
