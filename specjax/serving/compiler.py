"""The server's constraint compiles: in worker processes it can kill, bounded in
time, memory and number, shared between clients, cached by bytes.

outlines-core compiles in Rust, which a thread cannot interrupt: a hostile
regex would hold a core and its memory for as long as it likes. Here each
compile runs in a worker process (`specjax.serving.compile_worker`) under an
address-space limit, after the worker's cheap measures (`grammar.check_size`:
the copies a repetition makes, and the automaton's states counted up to a
cap); the server kills it past `compile_timeout_s`, once every request
awaiting it has gone, or when the server shuts down, and starts a fresh one for
the next compile. At most `compile_workers` compiles run at once and
`compile_queue` wait their turn, of which one client may have started at most
`compile_per_client`; past either, 429. A request for a constraint that is
compiling awaits that compile: no second worker, no queue place.

  pool = CompilePool(token_bytes, eos_ids, vocab_size, limits, max_states)
  automaton = await pool.compile(constraint, disconnected, client=peer)  # CompileRefused
  pool.close()                                                             # kills the workers
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import json
import logging
import pickle
import threading
from collections.abc import Awaitable, Callable, Hashable

from specjax import grammar
from specjax.constraints import Automaton
from specjax.serving.compile_worker import CompileWorker
from specjax.serving.limits import ServerLimits

logger = logging.getLogger(__name__)
# How often a request awaiting a compile checks that its client is still there.
_POLL_S = 0.25


class CompileRefused(Exception):
  """A compile the server will not run or finish: `status` (400, 429, 499 or 503) and why."""

  def __init__(self, status: int, message: str, retry_after: float | None = None):
    super().__init__(message)
    self.status, self.message, self.retry_after = status, message, retry_after


def automaton_bytes(automaton: Automaton) -> int:
  return sum(a.nbytes for a in (automaton.class_next, automaton.token_class, automaton.accepting))


def cache_key(constraint: grammar.Constraint) -> tuple[str, str]:
  return type(constraint).__name__, json.dumps(dataclasses.asdict(constraint), sort_keys=True)


@dataclasses.dataclass(eq=False)
class _Flight:
  """One compile in flight: the client that started it (whose share it takes),
  its task, whether it still waits for a worker, and the requests awaiting it."""

  key: tuple
  client: Hashable | None
  task: asyncio.Task | None = None
  queued: bool = True
  waiters: int = 0


class CompilePool:
  """Compiles constraints in worker processes for one vocabulary (see the module doc).

  Args:
    token_bytes: each id's bytes (`specjax.vocab_map.token_bytes`), None for specials.
    eos_ids: the engine's EOS ids (a constrained text ends with one).
    vocab_size: the model's vocabulary.
    limits: the server's `ServerLimits` (compile_* fields).
    max_states: the most states an automaton may have to ever fit the engine's
      table; a larger one is refused (and not cached).
  """

  def __init__(self, token_bytes, eos_ids, vocab_size: int, limits: ServerLimits, max_states: int):
    eos = [int(i) for i in eos_ids]
    pieces = grammar.vocabulary_pieces(token_bytes, eos, vocab_size)
    self._hello = pickle.dumps(("vocabulary", (eos, pieces, vocab_size)))
    self.limits, self.max_states = limits, max_states
    self._idle: list[CompileWorker] = []
    self._busy: set[CompileWorker] = set()
    # _idle, _busy, _closed: the loop and close(), which a signal handler may call
    # on the loop's own thread (hence re-entrant).
    self._lock = threading.RLock()
    self._closed = False
    self._slots = asyncio.Semaphore(limits.compile_workers)
    self._flights: dict[tuple, _Flight] = {}  # by cache key, while requests await them
    self._live: set[_Flight] = set()  # started and not ended (running or queued)
    self._shares: collections.Counter = collections.Counter()  # live flights by client
    self._threads = concurrent.futures.ThreadPoolExecutor(
      limits.compile_workers, thread_name_prefix="specjax-compile"
    )
    self.cache: collections.OrderedDict[tuple, Automaton] = collections.OrderedDict()
    self.cache_bytes = 0
    self.counters = collections.Counter()

  async def compile(
    self,
    constraint: grammar.Constraint,
    disconnected: Callable[[], Awaitable[bool]] | None = None,
    *,
    client: Hashable | None = None,
  ) -> Automaton:
    """`constraint`'s automaton (cached); CompileRefused (400, 429, 499, 503) otherwise.

    Args:
      disconnected: whether this request's client has gone (then it stops
        waiting; the compile is killed once no request awaits it).
      client: who asks, for its share of the pool (`compile_per_client`): the
        HTTP side passes the peer's address. None: no share applies.
    """
    key = cache_key(constraint)
    if key in self.cache:
      self.cache.move_to_end(key)
      self.counters["cache_hits"] += 1
      return self.cache[key]
    flight = self._flights.get(key)
    if flight is None:
      flight = self._start(key, constraint, client)
    else:
      self.counters["joined"] += 1
    flight.waiters += 1
    try:
      return await self._await(flight, disconnected)
    finally:
      flight.waiters -= 1
      if not flight.waiters and not flight.task.done():
        # Nobody awaits it: kill it (a later request for it starts afresh).
        self.counters["abandoned"] += 1
        if self._flights.get(key) is flight:
          del self._flights[key]
        flight.task.cancel()

  def _start(self, key: tuple, constraint, client: Hashable | None) -> _Flight:
    """A new compile's flight; CompileRefused (429) when the queue is full, or past
    `client`'s share while it is not."""
    limits = self.limits
    if len(self._live) >= limits.compile_workers + limits.compile_queue:
      self.counters["refused_busy"] += 1
      waiting = sum(f.queued for f in self._live)
      raise CompileRefused(
        429,
        f"{len(self._live) - waiting} constraints are compiling and {waiting} wait "
        "(compile_queue); try again shortly.",
        retry_after=1.0,
      )
    if client is not None and self._shares[client] >= limits.compile_per_client:
      self.counters["refused_client"] += 1
      raise CompileRefused(
        429,
        f"this client has {self._shares[client]} constraints compiling or waiting "
        "(compile_per_client); try again shortly.",
        retry_after=1.0,
      )
    flight = self._flights[key] = _Flight(key, client)
    self._live.add(flight)
    if client is not None:
      self._shares[client] += 1
    flight.task = asyncio.create_task(self._compile_once(flight, constraint))
    flight.task.add_done_callback(lambda task: self._end(flight, task))
    return flight

  def _end(self, flight: _Flight, task: asyncio.Task) -> None:
    """A compile ended (compiled, refused or killed): its place and share are free."""
    self._live.discard(flight)
    if self._flights.get(flight.key) is flight:
      del self._flights[flight.key]
    if flight.client is not None:
      self._shares[flight.client] -= 1
      if not self._shares[flight.client]:
        del self._shares[flight.client]
    if not task.cancelled():
      task.exception()  # retrieved, though every request awaiting it may have gone

  async def _await(self, flight: _Flight, disconnected) -> Automaton:
    """`flight`'s automaton; 499 if this request's client leaves first."""
    while True:
      done, _ = await asyncio.wait({flight.task}, timeout=_POLL_S)
      if done:
        return flight.task.result()
      if disconnected is not None and await disconnected():
        raise CompileRefused(499, "the client went away.")

  async def _compile_once(self, flight: _Flight, constraint) -> Automaton:
    async with self._slots:
      flight.queued = False
      automaton = await self._run(constraint)
    self._keep(flight.key, automaton)
    return automaton

  async def _run(self, constraint) -> Automaton:
    """One compile in a worker, killed past compile_timeout_s (or when cancelled)."""
    worker = self._take()
    kind = {v: k for k, v in grammar.KINDS.items()}[type(constraint)]
    # A tool-call constraint travels as its fields; the others as their one field.
    if kind == "tool_calls":
      value = dataclasses.asdict(constraint)
    else:
      value = dataclasses.astuple(constraint)[0]
    message = (kind, value, self.max_states, self.limits.max_regex_repeat)
    call = asyncio.get_running_loop().run_in_executor(self._threads, worker.call, message)
    answer = None  # the worker is kept for the next compile only if it answered
    try:
      done, _ = await asyncio.wait({call}, timeout=self.limits.compile_timeout_s)
      if not done:
        self.counters["timed_out"] += 1
        raise CompileRefused(
          400,
          f"compiling it took longer than {self.limits.compile_timeout_s:g} s "
          "(compile_timeout_s): simplify it.",
        )
      answer = call.result()
      return self._automaton(answer, worker)
    finally:
      self._give_back(worker, answer is not None)

  def _automaton(self, answer: tuple | None, worker: CompileWorker) -> Automaton:
    """A worker's answer as an automaton; CompileRefused for a refusal or a death."""
    if answer is None:
      if self._closed:
        raise CompileRefused(503, "the server is shutting down.")
      self.counters["crashed"] += 1
      why = worker.last_error()
      if why:
        logger.warning("a constraint compile worker died: %s", why)
      raise CompileRefused(
        400,
        "compiling it ran out of memory or crashed "
        f"(compile_memory_mb={self.limits.compile_memory_mb}): simplify it.",
      )
    if answer[0] != "ok":
      self.counters["refused"] += 1
      raise CompileRefused(400, answer[1])
    self.counters["compiled"] += 1
    return Automaton(*answer[1:])

  def _take(self) -> CompileWorker:
    with self._lock:
      if self._closed:
        raise CompileRefused(503, "the server is shutting down.")
      while self._idle:
        worker = self._idle.pop()
        if worker.alive():
          break
        worker.kill()
      else:
        worker = CompileWorker(self._hello, self.limits.compile_memory_mb << 20)
      self._busy.add(worker)
      return worker

  def _give_back(self, worker: CompileWorker, reusable: bool) -> None:
    with self._lock:
      self._busy.discard(worker)
      if reusable and not self._closed and worker.alive():
        self._idle.append(worker)
        return
    worker.kill()  # timed out, abandoned or dead: its thread's read meets the pipe's end

  def _keep(self, key, automaton: Automaton) -> None:
    """Caches `automaton`, dropping the least recently used past compile_cache_mb."""
    size = automaton_bytes(automaton)
    budget = self.limits.compile_cache_mb << 20
    if size > budget or key in self.cache:
      return
    self.cache[key] = automaton
    self.cache_bytes += size
    while self.cache_bytes > budget:
      _, dropped = self.cache.popitem(last=False)
      self.cache_bytes -= automaton_bytes(dropped)

  def stats(self) -> dict:
    with self._lock:
      running = len(self._busy)
    return {
      "cached": len(self.cache),
      "cache_bytes": self.cache_bytes,
      "running": running,
      "waiting": sum(f.queued for f in self._live),
      "clients": len(self._shares),
      **self.counters,
    }

  def close(self) -> None:
    """Kills every worker (safe from a signal handler's thread); later compiles get 503."""
    with self._lock:
      self._closed = True
      workers = [*self._idle, *self._busy]
      self._idle = []
    for worker in workers:
      worker.kill()
    self._threads.shutdown(wait=False, cancel_futures=True)
