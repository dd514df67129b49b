"""Constraints compiled to token automata on the host, with no JAX: what a
request asks for (`Regex`, `JsonSchema`, `Choice`), its regular expression, the
outlines-core index over a vocabulary as numpy arrays, and the cheap measures a
server bounds before compiling (`regex_repeat`, `json_depth`, and in the worker
`check_size`: the automaton's states, counted up to a cap).

This package imports only numpy (and outlines-core when it compiles, and
`specjax.regex_states`, which needs only the standard library), so that the
server can run it as a separate process that it may kill (a compile in Rust
cannot be interrupted from a thread): `python -I specjax/grammar/__main__.py
MEMORY_BYTES` (`WORKER_SCRIPT`) reads pickled `(op, payload)` messages on stdin
and answers each on stdout (`worker_main`). `specjax.constraints` builds its
`Automaton` from the same arrays, in process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from specjax import regex_states


@dataclasses.dataclass(frozen=True)
class Regex:
  """Text matching `pattern` (outlines-core's regex syntax), then EOS."""

  pattern: str


@dataclasses.dataclass(frozen=True)
class JsonSchema:
  """JSON text valid under `schema` (a dict or its JSON string), then EOS."""

  schema: Any


@dataclasses.dataclass(frozen=True)
class Choice:
  """Exactly one of `options` (non-empty strings), then EOS."""

  options: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class ToolCalls:
  """Tool calls in a chat template's format, then EOS: each call is `open`,
  `{"name": NAME, "arguments": ARGS}` (ARGS valid under that function's
  parameters schema) and `close`; calls follow one another after `separator`
  (`parallel`), or there is one. `required=False` ("auto") allows text instead,
  or text and then calls: text that never holds `open`'s first line.

  Attributes:
    functions: `(name, parameters schema as JSON text)` per function offered.
  """

  functions: tuple[tuple[str, str], ...]
  required: bool = True
  parallel: bool = True
  open: str = "<tool_call>\n"
  close: str = "\n</tool_call>"
  separator: str = "\n"


Constraint = Regex | JsonSchema | Choice | ToolCalls  # what a request may ask for


class CompileError(ValueError):
  """A constraint that cannot be compiled (the message says why)."""


def _outlines():
  try:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema
  except ImportError as e:  # pragma: no cover - the test extra installs it
    raise ImportError("constraints need outlines-core: pip install 'specjax[structured]'") from e
  return outlines_core, build_regex_from_schema


def _uncaught(error: BaseException) -> bool:
  """Whether `error` must propagate: outlines-core's PanicException derives from
  BaseException, so a bare `except Exception` misses it; only these are real exits."""
  return isinstance(error, (KeyboardInterrupt, SystemExit, GeneratorExit))


def to_regex(constraint: Constraint) -> str:
  """The regular expression a constraint stands for (ValueError naming the field
  when it is malformed)."""
  _, build_regex_from_schema = _outlines()
  if isinstance(constraint, Regex):
    if not isinstance(constraint.pattern, str) or not constraint.pattern:
      raise ValueError(f"regex must be a non-empty string, got {constraint.pattern!r}.")
    return constraint.pattern
  if isinstance(constraint, Choice):
    options = tuple(constraint.options)
    if not options or not all(isinstance(o, str) and o for o in options):
      raise ValueError(f"choice must be a non-empty list of non-empty strings, got {options!r}.")
    return "|".join(_escape(o) for o in options)
  if isinstance(constraint, JsonSchema):
    schema = constraint.schema
    try:
      text = schema if isinstance(schema, str) else json.dumps(schema)
      json.loads(text)
      return build_regex_from_schema(text)
    except BaseException as e:  # outlines-core raises its own types, panics included
      if _uncaught(e):
        raise
      raise ValueError(f"json_schema is not a schema outlines-core can compile: {e}") from None
  if isinstance(constraint, ToolCalls):
    return _tool_calls_regex(constraint)
  raise ValueError(
    f"constraint must be a Regex, JsonSchema, Choice or ToolCalls, got {type(constraint).__name__}."
  )


def _escape(text: str) -> str:
  """`text` as a literal in outlines-core's regex syntax (a newline as \\n)."""
  out = "".join("\\" + c if c in r".^$*+?{}[]\|()" else c for c in text)
  return out.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")


def _not_in_class(chars: str) -> str:
  return "[^" + "".join("\\" + c if c in "\\]-[^&~" else c for c in chars) + "]"


def text_without(word: str) -> str:
  """A regex of the texts that never hold `word` (whose first character occurs
  only first): a run without word[0], then pieces each beginning with word[0]
  whose next characters leave `word` before its end. Unambiguous: each next
  character picks one branch."""
  first = word[:1]
  if not word or first in word[1:]:
    raise ValueError(f"word must be characters whose first occurs once, got {word!r}.")
  rest = _not_in_class(first)
  if len(word) == 1:
    return f"{rest}*"
  piece = f"(?:{_not_in_class(first + word[-1])}{rest}*)?"
  for c in word[-2:0:-1]:
    piece = f"(?:{_not_in_class(first + c)}{rest}*|{_escape(c)}{piece})?"
  return f"{rest}*(?:{_escape(first)}{piece})*"


def _tool_calls_regex(constraint: ToolCalls) -> str:
  _, build_regex_from_schema = _outlines()
  if not constraint.functions:
    raise ValueError("tools must offer at least one function.")
  calls = []
  for name, schema in constraint.functions:
    try:
      json.loads(schema)
      arguments = build_regex_from_schema(schema)
    except BaseException as e:  # outlines-core raises its own types, panics included
      if _uncaught(e):
        raise
      raise ValueError(
        f"the parameters of function {name!r} are not a schema outlines-core can compile: {e}"
      ) from None
    head = _escape(json.dumps({"name": name, "arguments": 0})[:-2])  # up to ARGS
    calls.append(f"{head}{arguments}\\}}")
  block = f"{_escape(constraint.open)}(?:{'|'.join(calls)}){_escape(constraint.close)}"
  blocks = f"{block}(?:{_escape(constraint.separator)}{block})*" if constraint.parallel else block
  if constraint.required:
    return blocks
  return f"{text_without(constraint.open.strip())}(?:{blocks})?"


_COUNT = re.compile(r"\{(\d+)(,(\d*))?\}")
_COUNT_VERBOSE = re.compile(r"\{\s*(\d+)\s*(,\s*(\d*)\s*)?\}")  # (?x) allows spaces inside
_GROUP_FLAGS = re.compile(r"\(\?([a-zA-Z-]*)([:)])")  # (?x) or (?x:...)
_HUGE = 10**9  # a count written with more digits than this is simply "too many"


def _verbose_after(letters: str, verbose: bool) -> bool:
  """Whether verbose mode holds after a flag group's letters (`x` sets it, `-x` clears it)."""
  on, _, off = letters.partition("-")
  return False if "x" in off else True if "x" in on else verbose


def _skipped(pattern: str, i: int) -> int:
  """Where the escape or bracketed class at `i` ends (`\\p{Greek}`, `[a-z&&[^aeiou]]`)."""
  n = len(pattern)
  if pattern[i] == "\\":
    i += 2
    if i <= n and pattern[i - 1] in "pPxuU" and i < n and pattern[i] == "{":
      i = pattern.find("}", i) + 1 or n  # \p{Greek}, \x{10FFFF}
    return i
  depth, i = 1, i + 1
  if i < n and pattern[i] == "^":
    i += 1
  if i < n and pattern[i] == "]":
    i += 1
  while i < n and depth:
    if pattern[i] == "\\":
      i += 1
    elif pattern[i] == "[":
      depth += 1
    elif pattern[i] == "]":
      depth -= 1
    i += 1
  return i


def regex_repeat(pattern: str) -> int:
  """The largest number of copies a counted repetition makes of one piece of
  `pattern`, nested counts multiplied: 300000 for `a{300000}`, 6 for
  `(a{2}){3}`, 1 for `a*b+` (a loop adds no states). In verbose mode (`(?x)`,
  for the rest of its group, or `(?x:...)`) whitespace and `#` comments are no
  pieces: `(?x)(?:a{1000}) {1000}` makes a million. An automaton grows with
  this, so a server bounds it before compiling. Linear in the pattern; a rough
  parse (Rust regex syntax: escapes, classes, groups, flags), not a validator."""
  stack = [[1, None, False]]  # per open group: [largest finished piece, last piece, verbose]

  def piece(value: int | None = 1) -> None:  # the last piece is finished; `value` follows
    top = stack[-1]
    if top[1] is not None:
      top[0] = max(top[0], top[1])
    top[1] = value

  i, n = 0, len(pattern)
  while i < n:
    c, top = pattern[i], stack[-1]
    if top[2] and (c.isspace() or c == "#"):  # verbose: no piece (a comment runs to the line's end)
      end = pattern.find("\n", i) if c == "#" else i
      i = n if end < 0 else end + 1
    elif c in "\\[":
      piece()
      i = _skipped(pattern, i)
    elif c == "(":
      piece(None)
      flags = _GROUP_FLAGS.match(pattern, i)
      verbose = _verbose_after(flags.group(1), top[2]) if flags else top[2]
      if flags and flags.group(2) == ")":  # (?x): flags for the rest of this group
        top[2] = verbose
      else:
        stack.append([1, None, verbose])
      i = flags.end() if flags else i + 1
    elif c == ")" and len(stack) > 1:
      piece(None)
      piece(stack.pop()[0])
      i += 1
    elif (
      c == "{"
      and top[1] is not None
      and (count := (_COUNT_VERBOSE if top[2] else _COUNT).match(pattern, i))
    ):
      low, high = count.group(1), count.group(3) or count.group(1)
      top[1] *= max(max(_HUGE if len(d) > 9 else int(d) for d in (low, high)), 1)
      i = count.end()
    else:
      piece(None if c in ")|" else top[1] if c in "*+?" else 1)
      i += 1
  while len(stack) > 1:  # unclosed groups: outlines-core will refuse the pattern
    piece(None)
    piece(stack.pop()[0])
  piece(None)
  return stack[0][0]


def json_depth(value: Any, limit: int) -> int:
  """The nesting depth of a parsed JSON value (0 for a scalar), counted without
  recursion and only up to `limit + 1` (enough to refuse it)."""
  deepest, todo = 0, [(value, 0)]
  while todo:
    item, depth = todo.pop()
    if isinstance(item, (dict, list)):
      depth += 1
      deepest = max(deepest, depth)
      if deepest > limit:
        return deepest
      todo.extend((v, depth) for v in (item.values() if isinstance(item, dict) else item))
  return deepest


# The end of a text, as compiled: outlines-core (0.2) drops a token that leaves a
# final state for a non-final one one byte later (its DFA reports a match one byte
# late, and the index reads that byte's state as "neither intermediate nor a full
# match"): `x(ya)?` over single bytes loses "xya", text-or-tool-call loses every
# call. So a regex R is compiled as R followed by END, a character no text holds,
# spelled by a token of its own (id `vocab_size`): no state before END is final,
# none is dropped, and a state is accepting where END leads to a final state
# (w + END matches R + END exactly when w matches R, END being one character).
END = "\U0010ffff"


def vocabulary_pieces(
  token_bytes: Sequence[bytes | None], eos_ids: Sequence[int], vocab_size: int
) -> dict[bytes, list[int]]:
  """What outlines-core's `Vocabulary` takes: the ids of each byte string, EOS
  and special ids (None) left out, and the `END` token (id `vocab_size`)."""
  eos = set(eos_ids)
  pieces: dict[bytes, list[int]] = {}
  for i, piece in enumerate(token_bytes[:vocab_size]):
    if piece and i not in eos:
      pieces.setdefault(piece, []).append(i)
  pieces.setdefault(END.encode(), []).append(int(vocab_size))
  return pieces


def compile_arrays(
  regex: str, vocabulary, eos_ids: Sequence[int], vocab_size: int, max_states: int | None = None
) -> tuple[np.ndarray, np.ndarray, int, np.ndarray]:
  """`(class_next [S, C], token_class [V], start, accepting [S])` of `regex`'s
  token automaton over an outlines-core `vocabulary` (`specjax.constraints.Automaton`'s
  fields). `max_states`: refuse a larger automaton before building its classes.

  Raises:
    CompileError: a regex outlines-core refuses (panics included), no text the
      vocabulary can spell, or more than `max_states` states.
  """
  outlines_core, _ = _outlines()
  v = int(vocab_size)
  try:
    index = outlines_core.Index(f"(?:{regex}){END}", vocabulary)  # see END
  except BaseException as e:
    if _uncaught(e):
      raise
    raise CompileError(f"constraint cannot be compiled over this vocabulary: {e}") from None
  ended = set(index.get_final_states())
  eos = {int(e) for e in eos_ids}
  edges = {  # the model's tokens only: END (id v) and EOS are not text
    s: {i: n for i, n in out.items() if i < v and i not in eos}
    for s, out in index.get_transitions().items()
  }
  finals = {s for s, out in index.get_transitions().items() if out.get(v) in ended}
  # Live states only: reachable from the start by tokens and able to reach a final
  # state (bytes of END's own character, spelled by byte tokens, lead nowhere).
  start = index.get_initial_state()
  order, seen = [start], {start}
  for state in order:
    for nxt in dict.fromkeys(edges.get(state, {}).values()):  # distinct, in order
      if nxt not in seen:
        seen.add(nxt)
        order.append(nxt)
  into: dict[int, list[int]] = {}
  for s in order:
    for nxt in set(edges.get(s, {}).values()):
      into.setdefault(nxt, []).append(s)
  live = {s for s in order if s in finals}
  todo = list(live)
  while todo:
    for s in into.get(todo.pop(), ()):
      if s not in live:
        live.add(s)
        todo.append(s)
  if start not in live:
    raise CompileError("constraint accepts no text this vocabulary can spell.")
  order = [s for s in order if s in live]
  if max_states is not None and len(order) > max_states:
    raise CompileError(f"constraint has {len(order)} states; the table holds at most {max_states}.")
  number = dict(zip(order, range(len(order))))  # outlines' state ids -> ours
  accepting = np.array([s in finals for s in order])
  eos_kept = np.array(sorted({e for e in eos if e < v}), np.int64)
  rows = []
  for k, s in enumerate(order):
    out = {i: number[n] for i, n in edges.get(s, {}).items() if n in live}
    ids = np.fromiter(out.keys(), np.int64, len(out))
    nxt = np.fromiter(out.values(), np.int64, len(out))
    if accepting[k]:  # EOS ends a complete text and keeps the row where it is
      ids, nxt = np.concatenate([ids, eos_kept]), np.concatenate([nxt, np.full_like(eos_kept, k)])
    rows.append((ids, nxt))
  token_class, class_next = token_classes(rows, v)
  return class_next, token_class, 0, accepting


def token_classes(
  transitions: Sequence[tuple[np.ndarray, np.ndarray]], v: int
) -> tuple[np.ndarray, np.ndarray]:
  """`(token_class [V], class_next [S, C])`: the coarsest classes such that every
  state sends all ids of a class to one next state (or forbids them all).

  Partition refinement, state by state: the ids a state allows leave their class
  for a fresh one per (old class, next state); the ids it does not mention stay,
  so they part from those that moved. Cost O(transitions log), never [S, V].
  """
  label, fresh = np.zeros(v, np.int64), 1
  for ids, nxt in transitions:
    if len(ids):
      # label < fresh <= transitions + 1, next < S: the key fits in int64.
      _, split = np.unique(label[ids] * len(transitions) + nxt, return_inverse=True)
      label[ids] = fresh + split
      fresh += int(split.max()) + 1
  _, token_class = np.unique(label, return_inverse=True)
  class_next = np.full((len(transitions), int(token_class.max()) + 1), -1, np.int32)
  for s, (ids, nxt) in enumerate(transitions):
    class_next[s, token_class[ids]] = nxt
  return token_class.astype(np.int32), class_next


# ------------------------------------------------------------------ the worker

# The file a compile worker process runs (`python -I WORKER_SCRIPT MEMORY_BYTES`).
WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "__main__.py")

KINDS = {"regex": Regex, "json_schema": JsonSchema, "choice": Choice, "tool_calls": ToolCalls}


# How far past the table a regex's automaton may count before a compile is
# refused unbuilt. `regex_states` counts the automaton over bytes, the table is
# over tokens (fewer states where the vocabulary has no token for some single
# bytes), and their Unicode tables and constructions differ a little. The margin
# keeps the count from refusing what would fit; the table's own count decides
# after the compile (`compile_arrays`).
STATE_MARGIN = 2


def check_size(regex: str, kind: str, max_states: int | None, max_repeat: int) -> None:
  """CompileError, before any compile, for a regex a worker will not compile: a
  counted repetition of more than `max_repeat` copies (0: no bound), or an
  automaton past STATE_MARGIN x `max_states` states (stopped as soon as it
  passes them: `regex_states.count_states`)."""
  repeat = regex_repeat(regex)
  if max_repeat and repeat > max_repeat:
    if kind in ("json_schema", "tool_calls"):
      raise CompileError(
        f"the schema's regular expression repeats a piece {repeat} times; "
        f"at most {max_repeat} (a maxLength, maxItems or similar bound is too large)."
      )
    raise CompileError(
      f"a counted repetition makes {repeat} copies of one piece; "
      f"this server takes at most {max_repeat} (max_regex_repeat)."
    )
  if max_states:
    cap = STATE_MARGIN * max_states
    try:  # as compiled: inside a group (a pattern may close it early: `)(a|b)*(?:`)
      states = regex_states.count_states(f"(?:{regex})", cap)
    except Exception:  # a pattern the count misreads must not refuse a compile
      states = None
    if states is not None and states > cap:
      raise CompileError(
        f"its automaton has more than {cap} states ({STATE_MARGIN} x the {max_states} "
        "the constraint table holds, constraint_states): simplify it."
      )


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
