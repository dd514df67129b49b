"""Constraints compiled to token automata on the host, with no JAX: what a
request asks for (`Regex`, `JsonSchema`, `Choice`, `ToolCalls`), its regular
expression, the outlines-core index over a vocabulary as numpy arrays, and the
cheap measures a server bounds before compiling (`regex_repeat`, `json_depth`,
and in the worker `check_size`: the automaton's states, counted up to a cap).

  kinds.py     what a request may ask for; `KINDS`, `CompileError`
  regex.py     a constraint's regular expression (`to_regex`, `text_without`)
  bounds.py    the cheap measures (`regex_repeat`, `json_depth`, `check_size`)
  index.py     outlines-core's index as arrays (`END`, `vocabulary_pieces`,
               `compile_arrays`, `token_classes`)
  outlines.py  outlines-core, imported when first needed
  worker.py    the compile worker's protocol (`compile_message`, `worker_main`)
  __main__.py  the compile worker's entry

This package imports only numpy (and outlines-core when it compiles, and
`specjax.regex_states`, which needs only the standard library), so that the
server can run it as a separate process that it may kill (a compile in Rust
cannot be interrupted from a thread): `python -I specjax/grammar/__main__.py
MEMORY_BYTES` (`WORKER_SCRIPT`) reads pickled `(op, payload)` messages on stdin
and answers each on stdout (`worker_main`). `specjax.constraints` builds its
`Automaton` from the same arrays, in process. Its modules import one another
as `specjax.grammar.*`, in the worker too (see `__main__.py`).
"""

from specjax.grammar.bounds import STATE_MARGIN, check_size, json_depth, regex_repeat
from specjax.grammar.index import END, compile_arrays, token_classes, vocabulary_pieces
from specjax.grammar.kinds import (
  KINDS,
  Choice,
  CompileError,
  Constraint,
  JsonSchema,
  Regex,
  ToolCalls,
)
from specjax.grammar.outlines import _outlines as _outlines  # specjax.constraints uses it
from specjax.grammar.regex import text_without, to_regex
from specjax.grammar.worker import WORKER_SCRIPT, compile_message, worker_main

__all__ = [
  "END",
  "KINDS",
  "STATE_MARGIN",
  "WORKER_SCRIPT",
  "Choice",
  "CompileError",
  "Constraint",
  "JsonSchema",
  "Regex",
  "ToolCalls",
  "check_size",
  "compile_arrays",
  "compile_message",
  "json_depth",
  "regex_repeat",
  "text_without",
  "to_regex",
  "token_classes",
  "vocabulary_pieces",
  "worker_main",
]
