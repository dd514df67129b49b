"""The compile pool is fair and bounded (issue 73, requirement 4), without a
server: `CompilePool` driven directly on its own event loop, over a byte
vocabulary, and one `CompileWorker` on its own.

* A client past its share (`compile_per_client`) gets 429 while another is
  served: the issue's ten hostile regexes from one client beside a normal one.
* Identical compiles in flight are one compile: the others await it and take
  no worker, no queue place and no share; one leaving stops it for nobody else;
  the last leaving kills it.
* The worker: first in line for the OOM killer, and killed without closing a
  pipe a thread still reads.
"""

import asyncio
import concurrent.futures
import pickle
import subprocess
import sys
import time

import pytest

from specjax import grammar
from specjax.constraints import Automaton
from specjax.serving.compile_worker import CompileWorker
from specjax.serving.compiler import CompilePool, CompileRefused
from specjax.serving.limits import ServerLimits, from_config

EOS = 0
PIECES = [None] + [bytes([i]) for i in range(1, 256)]  # a byte tokenizer's, EOS special
# Passes every cheap measure (1,000 copies, 2,002 states, a count too costly to
# finish), then compiles for far longer than any timeout here.
SLOW = "(.{0,40}){0,25}x"


def _pool(**limits) -> CompilePool:
  return CompilePool(PIECES, [EOS], 256, ServerLimits(**limits), max_states=4095)


async def _outcome(pool: CompilePool, pattern: str, **kwargs):
  """The automaton, or the refusal, of one compile."""
  try:
    return await pool.compile(grammar.Regex(pattern), **kwargs)
  except CompileRefused as refused:
    return refused


async def _until(condition, seconds: float = 10.0) -> None:
  deadline = time.monotonic() + seconds
  while not condition():
    assert time.monotonic() < deadline, "timed out waiting"
    await asyncio.sleep(0.02)


def test_one_client_past_its_share_leaves_the_others_served():
  """The issue's case: ten hostile regexes from one client at once, and a
  normal one from another. Before: each hostile one ran to the 90 s timeout
  and the normal one got 429 at once."""

  async def run():
    pool = _pool()  # the defaults: 2 workers, 8 waiting, 1 per client
    try:
      hostile = [
        _outcome(pool, f"(?x)(?:a{{1000}}) {{100{n}}}", client="10.0.0.1") for n in range(10)
      ]
      start = time.perf_counter()
      *answers, normal = await asyncio.gather(
        *hostile, _outcome(pool, "[0-9]{3}", client="10.0.0.2")
      )
      return answers, normal, time.perf_counter() - start, pool.stats()
    finally:
      pool.close()

  answers, normal, seconds, stats = asyncio.run(run())
  assert isinstance(normal, Automaton), normal.message
  statuses = sorted(a.status for a in answers)
  assert statuses == [400] + [429] * 9, statuses
  assert "max_regex_repeat" in next(a for a in answers if a.status == 400).message
  share = next(a for a in answers if a.status == 429)
  assert "compile_per_client" in share.message and share.retry_after == 1.0
  assert seconds < 20, seconds  # the worker refuses at once (not at the 30 s timeout)
  assert stats["refused_client"] == 9 and stats["clients"] == 0 and stats["running"] == 0


def test_a_share_holds_while_slow_compiles_run_and_none_means_no_share():
  async def run():
    pool = _pool(compile_workers=2, compile_queue=2, compile_per_client=2)
    tasks = []
    try:
      mine = [asyncio.create_task(_outcome(pool, f"{SLOW}{n}", client="a")) for n in range(3)]
      await asyncio.sleep(0)  # the three have asked
      tasks += mine
      assert (await mine[2]).status == 429  # the third is past the share of two
      await _until(lambda: pool.stats()["running"] == 2)
      # Another client is served while "a" holds both workers: it waits its turn.
      other = asyncio.create_task(_outcome(pool, "[0-9]{3}", client="b"))
      tasks.append(other)
      await _until(lambda: pool.stats()["waiting"] == 1)
      # No client given: no share, only the queue (2 running + 2 waiting).
      anyone = asyncio.create_task(_outcome(pool, f"{SLOW}y"))
      tasks.append(anyone)
      await _until(lambda: pool.stats()["waiting"] == 2)
      full = await _outcome(pool, f"{SLOW}z")
      assert full.status == 429 and "compile_queue" in full.message
      for task in tasks:  # the slow ones are killed as their requests go
        task.cancel()
      await asyncio.gather(*tasks, return_exceptions=True)
      await _until(lambda: pool.stats()["running"] == 0)
      return pool.stats()
    finally:
      pool.close()

  stats = asyncio.run(run())
  assert stats["clients"] == 0 and stats["waiting"] == 0 and stats["abandoned"] == 4, stats


def test_identical_compiles_in_flight_are_one():
  async def run():
    pool = _pool(compile_per_client=1)
    try:
      # Five requests for one constraint, two of them from one client: one compile,
      # no share taken by the four that join it.
      clients = ["a", "a", "b", "c", None]
      results = await asyncio.gather(*(_outcome(pool, "[a-c]{4}", client=c) for c in clients))
      return results, pool.stats()
    finally:
      pool.close()

  results, stats = asyncio.run(run())
  assert all(r is results[0] for r in results) and isinstance(results[0], Automaton)
  assert stats["compiled"] == 1 and stats["joined"] == 4 and stats["cached"] == 1, stats


def test_a_waiter_that_leaves_stops_the_compile_for_nobody_else():
  """`a{8000}` compiles in a second or two; of three requests awaiting it, one
  client disconnects and one request is cancelled (its handler ended): the
  third still gets the automaton, from the one compile."""

  async def run():
    pool = CompilePool(PIECES, [EOS], 256, ServerLimits(max_regex_repeat=10_000), 16383)
    try:
      gone = asyncio.Event()

      async def disconnected() -> bool:
        return gone.is_set()

      leaver = asyncio.create_task(_outcome(pool, "a{8000}", disconnected=disconnected))
      cancelled = asyncio.create_task(_outcome(pool, "a{8000}"))
      stayer = asyncio.create_task(_outcome(pool, "a{8000}"))
      await _until(lambda: pool.stats()["running"] == 1)
      gone.set()
      cancelled.cancel()
      left = await leaver
      with pytest.raises(asyncio.CancelledError):
        await cancelled
      return left, await stayer, pool.stats()
    finally:
      pool.close()

  left, automaton, stats = asyncio.run(run())
  assert left.status == 499
  assert isinstance(automaton, Automaton) and len(automaton.class_next) == 8001
  assert stats["compiled"] == 1 and stats["joined"] == 2 and stats.get("abandoned", 0) == 0


def test_the_last_waiter_leaving_kills_the_compile():
  async def run():
    pool = _pool()
    try:
      gone = asyncio.Event()

      async def disconnected() -> bool:
        return gone.is_set()

      waiter = asyncio.create_task(_outcome(pool, SLOW, disconnected=disconnected, client="a"))
      await _until(lambda: pool.stats()["running"] == 1)
      (worker,) = pool._busy
      gone.set()
      assert (await waiter).status == 499
      await _until(lambda: pool.stats()["running"] == 0)
      await _until(lambda: not worker.alive())
      # Its share is back, and the constraint may be asked for afresh.
      again = asyncio.create_task(_outcome(pool, SLOW, client="a"))
      await _until(lambda: pool.stats()["running"] == 1)
      again.cancel()
      await asyncio.gather(again, return_exceptions=True)
      return pool.stats()
    finally:
      pool.close()

  stats = asyncio.run(run())
  assert stats["abandoned"] == 2 and stats.get("refused_client", 0) == 0, stats


def test_compile_per_client_is_checked_where_it_is_set():
  assert ServerLimits().compile_per_client == 1
  for value in (0, 11, 1.5, True):
    with pytest.raises(ValueError, match=r"compile_per_client must be an integer in \[1, 10\]"):
      ServerLimits(compile_per_client=value)
  assert ServerLimits(compile_workers=4, compile_queue=0, compile_per_client=4)
  with pytest.raises(ValueError, match=r"config.compile_per_client must be .* \[1, 1\], got 2"):
    from_config({"compile_workers": 1, "compile_queue": 0, "compile_per_client": 2})


# ------------------------------------------------------------------ the worker


def _hello() -> bytes:
  pieces = grammar.vocabulary_pieces(PIECES, [EOS], 256)
  return pickle.dumps(("vocabulary", ([EOS], pieces, 256)))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/PID/oom_score_adj")
def test_a_worker_is_the_oom_killers_first_choice():
  worker = CompileWorker(_hello(), 1 << 30)
  try:
    assert worker.call(("regex", "[0-9]{3}", 4095, 1024))[0] == "ok"
    with open(f"/proc/{worker.process.pid}/oom_score_adj") as score:
      assert score.read().strip() == "1000"
  finally:
    worker.kill()


def test_a_worker_loads_the_grammar_and_no_jax():
  """A worker runs `grammar.WORKER_SCRIPT` by path under `python -I`: a bare
  `specjax` stands in for the package, whose `__init__` (JAX) never runs; only
  the grammar's modules load."""
  probe = (
    "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__');"
    "print(*sorted(m for m in sys.modules if m.split('.')[0] in ('specjax', 'jax', 'flax')),"
    " file=sys.__stdout__)"  # the worker points sys.stdout at stderr
  )
  loaded = subprocess.run(
    [sys.executable, "-I", "-c", probe, grammar.WORKER_SCRIPT],
    stdin=subprocess.DEVNULL,  # the worker's loop ends at once
    capture_output=True,
    text=True,
    timeout=60,
    check=True,
  ).stdout.split()
  assert "specjax.grammar" in loaded, loaded
  outside = [
    m for m in loaded if m != "specjax" and m.split(".")[1] not in ("grammar", "regex_states")
  ]
  assert outside == [], outside


class _Watched:
  """A pipe whose reads and closing are recorded: closed while a read was in flight?"""

  def __init__(self, pipe):
    self.pipe, self.reading, self.closed_while_reading = pipe, 0, False

  def _read(self, method, *args):
    self.reading += 1
    try:
      return getattr(self.pipe, method)(*args)
    finally:
      self.reading -= 1

  def read(self, *args):
    return self._read("read", *args)

  def readline(self, *args):
    return self._read("readline", *args)

  def readinto(self, buffer):
    return self._read("readinto", buffer)

  def close(self):
    self.closed_while_reading |= self.reading > 0
    self.pipe.close()


def test_killing_a_worker_closes_its_pipe_only_after_the_reader_returns():
  """The event loop kills a worker while a thread waits in `call` for its
  answer: the kill returns at once, the reader sees the pipe end, and only then
  is the pipe closed. Before, the kill closed it under the reading thread."""
  worker = CompileWorker(_hello(), 1 << 30)
  assert worker.call(("regex", "[0-9]{3}", 4095, 1024))[0] == "ok"  # started, vocabulary sent
  watched = worker.process.stdout = _Watched(worker.process.stdout)
  with concurrent.futures.ThreadPoolExecutor(1) as threads:
    answer = threads.submit(worker.call, ("regex", SLOW, 4095, 1024))
    deadline = time.monotonic() + 10
    while not watched.reading:
      assert time.monotonic() < deadline
      time.sleep(0.01)
    time.sleep(0.2)
    start = time.perf_counter()
    worker.kill()
    killed_in = time.perf_counter() - start
    assert answer.result(timeout=20) is None
  while not watched.pipe.closed:
    assert time.monotonic() < deadline + 10, "the reaper never closed the pipe"
    time.sleep(0.01)
  assert not watched.closed_while_reading
  assert killed_in < 1.0, killed_in
  assert worker.process.poll() is not None
