"""The compile worker's protocol: a vocabulary once, then compiles, each
answered with the automaton's arrays or an error's message (`worker_main`,
`compile_message`). The server runs it as `python -I WORKER_SCRIPT
MEMORY_BYTES` (`specjax.serving.compile_worker`), a process it may kill.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from specjax.grammar.bounds import check_size
from specjax.grammar.index import compile_arrays
from specjax.grammar.kinds import KINDS, ToolCalls
from specjax.grammar.outlines import _outlines, _uncaught
from specjax.grammar.regex import to_regex

# The file a compile worker process runs (`python -I WORKER_SCRIPT MEMORY_BYTES`).
WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "__main__.py")


def compile_message(vocabulary, eos_ids, vocab_size, message) -> tuple:
  """One worker answer: `("ok", arrays...)` or `("error", message)` for
  `message = (kind, value, max_states, max_repeat)`; `check_size` first."""
  kind, value, max_states, max_repeat = message
  try:
    if kind == "tool_calls":  # its fields, by name
      constraint = ToolCalls(**value)
    else:
      constraint = KINDS[kind](tuple(value) if kind == "choice" else value)
    regex = to_regex(constraint)
    check_size(regex, kind, max_states, max_repeat)
    return ("ok", *compile_arrays(regex, vocabulary, eos_ids, vocab_size, max_states))
  except MemoryError:
    return ("error", "compiling it ran out of memory (the server's compile memory limit).")
  except BaseException as e:
    if _uncaught(e):
      raise
    return ("error", str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}")


def worker_main(argv: Sequence[str]) -> None:
  """The compile worker's loop: `("vocabulary", (eos_ids, pieces, vocab_size))`
  once, then `("compile", message)` answered by `compile_message`, until stdin
  closes. argv[0]: the address-space limit in bytes (0: none)."""
  import contextlib
  import pickle
  import resource
  import signal
  import sys

  signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server stops its workers itself
  os.nice(10)  # a compile yields the CPU to serving (the event loop, the engine's steps)
  # Out of memory, the kernel kills the process it scores highest: a compile
  # worker, never the server (Linux; raising one's own score needs no privilege).
  with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as score:
    score.write("1000")
  sys.setrecursionlimit(10_000)  # regex_states recurses once per nested group (at most 250)
  limit = int(argv[0]) if argv else 0
  if limit > 0:
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
  outlines_core, _ = _outlines()
  reader, writer = sys.stdin.buffer, os.fdopen(os.dup(sys.stdout.fileno()), "wb")
  sys.stdout = sys.stderr  # nothing else may write into the answers
  vocabulary = None
  while True:
    try:
      op, payload = pickle.load(reader)
    except EOFError:
      return
    if op == "vocabulary":
      eos_ids, pieces, vocab_size = payload
      vocabulary = outlines_core.Vocabulary(eos_ids[0], pieces)
      answer: tuple = ("ok",)
    else:
      answer = compile_message(vocabulary, eos_ids, vocab_size, payload)
    pickle.dump(answer, writer, protocol=pickle.HIGHEST_PROTOCOL)
    writer.flush()
