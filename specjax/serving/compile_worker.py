"""One constraint compile worker: a process running `specjax/grammar/__main__.py`
(it imports no JAX and starts in a fraction of a second), spoken to in pickled
messages over its pipes, and killed without waiting for it.

  worker = CompileWorker(hello, memory_bytes)  # hello: the pickled vocabulary
  answer = worker.call(message)                # in a thread; None if it died
  worker.kill()                                # returns at once
"""

from __future__ import annotations

import contextlib
import os
import pickle
import subprocess
import sys
import tempfile
import threading

from specjax import grammar


class CompileWorker:
  """One compile worker process; `call` sends a message and waits for the answer
  (in a thread: the event loop never blocks on the pipe)."""

  def __init__(self, hello: bytes, memory_bytes: int):
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    # Its stderr goes to a file (a pipe nobody reads could fill and stall it): why
    # a worker died, e.g. it could not import outlines-core.
    self.errors = tempfile.TemporaryFile()  # noqa: SIM115 - the worker's lifetime; kill() closes it
    self.process = subprocess.Popen(
      [sys.executable, "-I", grammar.WORKER_SCRIPT, str(memory_bytes)],
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      stderr=self.errors,
      env=env,
    )
    self.hello = hello  # the vocabulary, sent before the first compile
    # Held while a thread talks to the process: its pipes are closed only after
    # (closing a buffered pipe that a thread reads waits on the reader's lock, and
    # a closed descriptor's number may be reused under the reader).
    self._talking = threading.Lock()
    self._killed = False

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
    with self._talking:
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
    """Kills the process and returns at once (safe from a signal handler): a
    thread reading its answer then meets the end of the pipe, and a reaper
    thread closes the pipes once the process has gone and no thread reads them.
    The event loop never waits, for a reader nor for the kernel to tear down a
    worker that grew to gigabytes."""
    if self.process.poll() is None:
      self.process.kill()
    if not self._killed:
      self._killed = True
      threading.Thread(target=self._reap, name="specjax-compile-reaper", daemon=True).start()

  def _reap(self) -> None:
    self.process.wait()
    with self._talking:
      for pipe in (self.process.stdin, self.process.stdout, self.errors):
        with contextlib.suppress(OSError):
          pipe.close()
