"""The server's constraint compiles: in worker processes it can kill, bounded in
time, memory and number, cached by bytes.

outlines-core compiles in Rust, which a thread cannot interrupt: a hostile
regex would hold a core and its memory for as long as it likes. Here each
compile runs in a worker process (`specjax.grammar`, run by path: it imports no
JAX and starts in a fraction of a second) under an address-space limit; the
server kills it past `compile_timeout_s`, when the client goes away, or when
the server shuts down, and starts a fresh one for the next compile. At most
`compile_workers` compiles run at once and `compile_queue` wait their turn;
past that, 429.

  pool = CompilePool(token_bytes, eos_ids, vocab_size, limits, max_states)
  automaton = await pool.compile(param, constraint, disconnected)  # APIError on refusal
  pool.close()                                                       # kills the workers
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import threading
from collections.abc import Awaitable, Callable

from specjax import grammar
from specjax.constraints import Automaton
from specjax.serving.limits import ServerLimits

logger = logging.getLogger(__name__)
# How often a waiting compile checks that its client is still there.
_POLL_S = 0.25


class CompileRefused(Exception):
  """A compile the server will not run or finish: `status` (400 or 429) and why."""

  def __init__(self, status: int, message: str, retry_after: float | None = None):
    super().__init__(message)
    self.status, self.message, self.retry_after = status, message, retry_after


class _Worker:
  """One compile worker process; `call` sends a message and waits for the answer
  (in a thread: the event loop never blocks on the pipe)."""

  def __init__(self, hello: bytes, memory_bytes: int):
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    # Its stderr goes to a file (a pipe nobody reads could fill and stall it): why
    # a worker died, e.g. it could not import outlines-core.
    self.errors = tempfile.TemporaryFile()  # noqa: SIM115 - the worker's lifetime; kill() closes it
    self.process = subprocess.Popen(
      [sys.executable, "-I", grammar.__file__, str(memory_bytes)],
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      stderr=self.errors,
      env=env,
    )
    self.hello = hello  # the vocabulary, sent before the first compile

  def last_error(self) -> str:
    """The last line its stderr holds (a dead worker's traceback ends with why)."""
    try:
      self.errors.seek(0, os.SEEK_END)
      self.errors.seek(max(0, self.errors.tell() - 2000))
      lines = self.errors.read().decode("utf-8", "replace").strip().splitlines()
    except (OSError, ValueError):
      return ""
    return lines[-1] if lines else ""

  def call(self, message: tuple) -> tuple | None:
    """The worker's answer to `message`, or None if it died (killed, out of memory)."""
    try:
      if self.hello:
        self.process.stdin.write(self.hello)
        self.hello = b""
        self.process.stdin.flush()
        if pickle.load(self.process.stdout) != ("ok",):
          return None
      pickle.dump(("compile", message), self.process.stdin)
      self.process.stdin.flush()
      return pickle.load(self.process.stdout)
    except (EOFError, OSError, pickle.UnpicklingError, ValueError):
      return None

  def alive(self) -> bool:
    return self.process.poll() is None

  def kill(self) -> None:
    """Kills the process without waiting for it: a worker that grew to gigabytes
    takes the kernel a while to tear down, and the event loop must not wait."""
    if self.process.poll() is None:
      self.process.kill()
    for pipe in (self.process.stdin, self.process.stdout, self.errors):
      with contextlib.suppress(OSError):
        pipe.close()
    threading.Thread(target=self.process.wait, name="specjax-compile-reaper", daemon=True).start()


def automaton_bytes(automaton: Automaton) -> int:
  return sum(a.nbytes for a in (automaton.class_next, automaton.token_class, automaton.accepting))


def cache_key(constraint: grammar.Constraint) -> tuple[str, str]:
  return type(constraint).__name__, json.dumps(dataclasses.asdict(constraint), sort_keys=True)


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
    self._idle: list[_Worker] = []
    self._busy: set[_Worker] = set()
    # _idle, _busy, _closed: the loop and close(), which a signal handler may call
    # on the loop's own thread (hence re-entrant).
    self._lock = threading.RLock()
    self._closed = False
    self._slots = asyncio.Semaphore(limits.compile_workers)
    self._waiting = 0
    self._threads = concurrent.futures.ThreadPoolExecutor(
      limits.compile_workers, thread_name_prefix="specjax-compile"
    )
    self.cache: collections.OrderedDict[tuple, Automaton] = collections.OrderedDict()
    self.cache_bytes = 0
    self.counters = collections.Counter()

  async def compile(
    self, constraint: grammar.Constraint, disconnected: Callable[[], Awaitable[bool]] | None = None
  ) -> Automaton:
    """`constraint`'s automaton (cached); CompileRefused (400 or 429) otherwise.
    `disconnected()`: whether the client has gone (then the compile is killed)."""
    key = cache_key(constraint)
    if key in self.cache:
      self.cache.move_to_end(key)
      self.counters["cache_hits"] += 1
      return self.cache[key]
    if self._slots.locked() and self._waiting >= self.limits.compile_queue:
      self.counters["refused_busy"] += 1
      raise CompileRefused(
        429,
        f"{self.limits.compile_workers} constraints are compiling and "
        f"{self._waiting} wait (compile_queue); try again shortly.",
        retry_after=1.0,
      )
    self._waiting += 1
    try:
      await self._slots.acquire()
    finally:
      self._waiting -= 1
    try:
      automaton = await self._run(constraint, disconnected)
    finally:
      self._slots.release()
    self._keep(key, automaton)
    return automaton

  async def _run(self, constraint, disconnected) -> Automaton:
    worker = self._take()
    kind = {v: k for k, v in grammar.KINDS.items()}[type(constraint)]
    # A tool-call constraint travels as its fields; the others as their one field.
    if kind == "tool_calls":
      value = dataclasses.asdict(constraint)
    else:
      value = dataclasses.astuple(constraint)[0]
    message = (
      kind,
      value,
      self.max_states,
      self.limits.max_regex_repeat,
    )
    loop = asyncio.get_running_loop()
    call = loop.run_in_executor(self._threads, worker.call, message)
    deadline = loop.time() + self.limits.compile_timeout_s
    answer = None  # the worker is kept for the next compile only if it answered
    try:
      while True:
        done, _ = await asyncio.wait({call}, timeout=min(_POLL_S, deadline - loop.time()))
        if done:
          break
        if loop.time() >= deadline:
          self.counters["timed_out"] += 1
          raise CompileRefused(
            400,
            f"compiling it took longer than {self.limits.compile_timeout_s:g} s "
            "(compile_timeout_s): simplify it.",
          )
        if disconnected is not None and await disconnected():
          self.counters["abandoned"] += 1
          raise CompileRefused(499, "the client went away.")
      answer = call.result()
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
    finally:
      self._give_back(worker, answer is not None)

  def _take(self) -> _Worker:
    with self._lock:
      if self._closed:
        raise CompileRefused(503, "the server is shutting down.")
      while self._idle:
        worker = self._idle.pop()
        if worker.alive():
          break
        worker.kill()
      else:
        worker = _Worker(self._hello, self.limits.compile_memory_mb << 20)
      self._busy.add(worker)
      return worker

  def _give_back(self, worker: _Worker, reusable: bool) -> None:
    with self._lock:
      self._busy.discard(worker)
      if reusable and not self._closed and worker.alive():
        self._idle.append(worker)
        return
    worker.kill()  # timed out, abandoned or dead: its thread's read ends with the process

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
      "waiting": self._waiting,
      **self.counters,
    }

  def close(self) -> None:
    """Kills every worker (safe from a signal handler's thread); later compiles get 503."""
    with self._lock:
      self._closed = True
      workers = [*self._idle, *self._busy]
      self._idle = []
    for worker in workers:
      if worker.process.poll() is None:
        worker.process.kill()
    self._threads.shutdown(wait=False, cancel_futures=True)
