"""The cheap measures a server bounds before compiling a constraint: the copies
a counted repetition makes (`regex_repeat`), a JSON value's nesting depth
(`json_depth`), and in the compile worker `check_size`: the copies, then the
automaton's states, counted up to a cap by `specjax.regex_states`.
"""

from __future__ import annotations

import re
from typing import Any

from specjax import regex_states
from specjax.grammar.kinds import CompileError

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
