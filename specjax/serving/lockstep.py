"""One engine across processes (`jax.distributed`): process 0 schedules, all step.

Every process of a multi-host job builds the same `Engine` on one mesh over all
of the job's devices, so each of its programs spans every process: they must
all run the same programs in the same order. The engine's scheduling is
deterministic given what happens to it (submissions, cancellations) except for
two things read from the clock: which requests have run out of time, and the
adaptive policy's draft length (from measured step times). So process 0 (the
leader, which takes HTTP) decides those, and before each step broadcasts to the
others (followers) what they need to take the same decisions:

  - the requests submitted and the cancellations (expired requests included)
    since the last step, in order: each process applies them to its engine;
  - the step's draft length, once the leader's policy has chosen it;
  - after warm-up, the verify costs it measured (`EngineConfig.verify_lengths`).

Messages travel with `jax.experimental.multihost_utils.broadcast_one_to_all`,
JAX's own collective, over the devices the engine already uses (pickled: the
peers are this job's own processes). A follower loops in `follow()` until the
leader closes. A process that dies makes the next collective fail on the
others, or JAX's coordination service ends them once its heartbeats stop
(`jax.distributed.initialize(heartbeat_timeout_seconds=...)`): the leader then
fails its requests and its server stops with an error instead of waiting.

  leader:    lockstep = Lockstep(engine); BackgroundEngine(lockstep) behind HTTP
  followers: Lockstep(engine).follow()

It talks to the engine through `LockstepEngine`, the engine's public interface
for it (never its private fields). Constraints hold across processes because
the constraint table interns automata by content
(`specjax.serving.constraint_table`): a follower's unpickled copy of the
leader's cached automaton shares the leader's block.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import threading
import time
from collections.abc import Callable
from typing import Protocol

import jax
import numpy as np
from jax.experimental import multihost_utils

from specjax.serving.request import Event, Request

logger = logging.getLogger(__name__)

# Message payloads are padded to a power of two of at least this many bytes, so
# the broadcast compiles for a few sizes only.
_MIN_PAYLOAD = 1024
# An idle leader sends an empty message this often, so that the followers'
# waiting collective never idles long enough for a transport to time it out.
HEARTBEAT_S = 30.0


class LockstepError(RuntimeError):
  """A collective between the processes failed (a process died or hung)."""


def broadcast(value=None) -> object:
  """`value` from process 0 on every process (the others pass None): a
  pickled message in two collectives, its length then its bytes."""
  leader = jax.process_index() == 0
  data = pickle.dumps(value) if leader else b""
  size = int(multihost_utils.broadcast_one_to_all(np.int64(len(data))))
  padded = max(_MIN_PAYLOAD, 1 << max(0, size - 1).bit_length())
  buffer = np.zeros(padded, np.uint8)
  if leader:
    buffer[:size] = np.frombuffer(data, np.uint8)
  received = np.asarray(multihost_utils.broadcast_one_to_all(buffer))
  return value if leader else pickle.loads(received[:size].tobytes())


class LockstepEngine(Protocol):
  """What `Lockstep` uses of an engine (`specjax.serving.Engine` has it)."""

  # Each step's draft length goes through `agree`, which returns the leader's.
  agree: Callable[[int], int] | None
  # Warm-up's measured verify costs: the followers take the leader's.
  verify_costs: dict

  def submit(self, request: Request) -> int: ...

  def cancel(self, request_id: int, reason: str = "cancelled") -> None: ...

  def late(self) -> list[int]:
    """The requests past their deadline: the clock is read on the leader only."""
    ...

  def has_work(self) -> bool: ...

  def step(self, expire: bool = True) -> list[Event]:
    """With `expire` False, a step that leaves deadlines to `late()`'s caller."""
    ...


class Lockstep:
  """`engine` run by every process of the job in lockstep.

  On the leader (process 0) it has the engine's serving API (`submit`,
  `cancel`, `step`, `has_work`, `metrics`, ...), so a `BackgroundEngine` and
  the HTTP server run on it as on an engine; `close()` releases the
  followers. On the others, `follow()` runs until then.

  Args:
    engine: this process's `Engine`, built like every other process's (same
      models, config and mesh over the job's devices) and warmed up.
    sync_warmup: share the leader's warm-up measurements (verify costs) with
      the followers now (every process must construct its `Lockstep` at the
      same point).
  """

  def __init__(self, engine: LockstepEngine, sync_warmup: bool = True):
    self.engine = engine
    self.leader = jax.process_index() == 0
    self._journal: list[tuple] = []  # leader: ("submit", request) / ("cancel", id, reason)
    self._last = time.monotonic()
    self.broken: str | None = None  # why the processes fell out of step
    self.on_broken: Callable[[], None] | None = None  # called once they did (a server stops)
    self.closed = False
    engine.agree = self._agree
    if sync_warmup:
      engine.verify_costs = self._share(engine.verify_costs)

  # ------------------------------------------------------------ the leader's API

  def submit(self, request: Request) -> int:
    """`Engine.submit`, recorded for the followers (a refused request is not)."""
    self._check()
    request_id = self.engine.submit(request)
    self._journal.append(("submit", request))
    return request_id

  def cancel(self, request_id: int, reason: str = "cancelled") -> None:
    """Recorded; every process cancels at the start of the next step (the
    slot's release is a program all of them run)."""
    self._journal.append(("cancel", request_id, reason))

  def has_work(self) -> bool:
    return bool(self._journal) or self.engine.has_work() or self._heartbeat_due()

  def step(self) -> list[Event]:
    """Sends the step's journal, applies it here too, and steps."""
    self._check()
    for request_id in self.engine.late():  # the clock is read here only
      self._journal.append(("cancel", request_id, "timeout"))
    journal, self._journal = self._journal, []
    self._send(("step", journal))
    cancels = [op[1:] for op in journal if op[0] == "cancel"]
    for request_id, reason in cancels:
      self.engine.cancel(request_id, reason)
    return self._run(self.engine.step, expire=False)

  def close(self) -> None:
    """Releases the followers (their `follow()` returns); idempotent."""
    if self.leader and not self.closed and self.broken is None:
      self._send(("stop", None))
    self.closed = True

  def keep_alive(self, background) -> None:
    """Wakes `background` (the `BackgroundEngine` running this) every
    `HEARTBEAT_S` while idle, so that its loop sends the followers a message."""

    def beat() -> None:
      while not (self.closed or background.closed or self.broken):
        time.sleep(HEARTBEAT_S / 3)
        if self._heartbeat_due():
          with contextlib.suppress(RuntimeError):  # closed meanwhile
            background.call_future(lambda engine: None)

    threading.Thread(target=beat, name="specjax-lockstep-heartbeat", daemon=True).start()

  def __getattr__(self, name):  # metrics, completion, live_requests, config, ...
    return getattr(self.engine, name)

  # --------------------------------------------------------- the followers' loop

  def follow(self) -> None:
    """Runs the leader's steps here until it closes (a follower's main loop)."""
    if self.leader:
      raise RuntimeError("Lockstep.follow runs on the followers (process index > 0).")
    while True:
      kind, journal = self._run(broadcast)
      if kind == "stop":
        self.closed = True
        return
      for op in journal:
        if op[0] == "submit":
          self.engine.submit(op[1])
        else:
          self.engine.cancel(op[1], op[2])
      if kind == "step":
        self._run(self.engine.step, expire=False)

  # ------------------------------------------------------------------ internals

  def _agree(self, gamma: int) -> int:
    """The leader's draft length for this step (the engine asks once a step)."""
    return self._run(broadcast, gamma if self.leader else None)

  def _share(self, value):
    return self._run(broadcast, value if self.leader else None)

  def _send(self, message) -> None:
    self._last = time.monotonic()
    self._run(broadcast, message)

  def _heartbeat_due(self) -> bool:
    return self.leader and time.monotonic() - self._last > HEARTBEAT_S

  def _run(self, fn, *args, **kwargs):
    """`fn(...)`; a failure marks the processes out of step for good."""
    try:
      return fn(*args, **kwargs)
    except LockstepError:
      raise
    except Exception as error:
      self.broken = f"{type(error).__name__}: {error}"
      logger.error("lockstep: the processes fell out of step: %s", self.broken)
      if self.on_broken is not None:
        self.on_broken()
      raise LockstepError(f"the job's processes fell out of step: {self.broken}") from error

  def _check(self) -> None:
    if self.broken is not None:
      raise LockstepError(f"the job's processes fell out of step: {self.broken}")
    if self.closed:
      raise RuntimeError("the lockstep engine is closed")
