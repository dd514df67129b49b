"""The states of a regular expression's automaton, counted up to a cap without
building the automaton: the guard a compile worker runs before outlines-core.

outlines-core builds a regex's whole DFA (regex-automata, with no size limit)
and then walks every token of the vocabulary from every state, all in one call
that cannot be stopped from inside. `(a|b)*a(a|b){20}` has 2^21 states,
`(?:a{1000}){1000}` a million, and `\\w{300}` 95,000 (each `\\w` is a few hundred
states of UTF-8); each runs until the server kills the worker. Here the regex
is parsed (the Rust syntax outlines-core takes: flags, verbose mode, classes
and their operators, counted repetitions) and its automaton over UTF-8 bytes,
as outlines-core's is, explored lazily: each state is a set of Antimirov
partial derivatives, a character class a trie of its encodings, and a counted
repetition stays a counter instead of being copied out, so the count stops as
soon as it passes the cap, after work in proportion to the cap.

The count is close to the table's, not equal to it: the table is over the
vocabulary's tokens (fewer states where a token spans several bytes and the
vocabulary lacks the single bytes), Unicode's classes come from this Python's
`unicodedata` (a script, `\\p{Greek}`, stands as one block of two-byte
characters), and
neither automaton is minimal. So a caller keeps a margin and still counts the
table (`specjax.grammar.compile_arrays`). `count_states` answers None where it
cannot tell (a pattern it does not parse, or one whose states are too costly
to tell apart); then only the compile's own bounds apply.

  char_classes.py  character classes as code point ranges, spelled in UTF-8
  derivatives.py   the terms and their derivatives by a byte (`_Terms`)
  parser.py        Rust regex syntax to terms (`_Parser`)

and here `count_states`, which explores the states. The package imports only
the standard library: the compile worker runs it (`specjax/grammar/__main__.py`).
"""

from __future__ import annotations

import time

from specjax.regex_states.derivatives import _Terms
from specjax.regex_states.parser import _Parser

# What a count may spend before it gives up (None) rather than delay a compile:
# derivative steps (about a second of work), and seconds (for a pattern whose
# every step is costly).
BUDGET = 4_000_000
SECONDS = 2.0


def count_states(
  pattern: str, limit: int, budget: int = BUDGET, seconds: float = SECONDS
) -> int | None:
  """The states of `pattern`'s automaton over UTF-8 bytes (the start included,
  the dead state not), or `limit + 1` as soon as there are more than `limit`.
  None where it cannot tell: a pattern it does not parse, or one that takes
  more than `budget` derivative steps or `seconds` (see the module doc)."""
  terms = _Terms()
  deadline = time.monotonic() + seconds
  try:
    start = terms.prune(frozenset([_Parser(pattern, terms).parse()]))
    seen, todo, work = {start}, [start], 0
    while todo:
      if time.monotonic() > deadline:
        return None
      state = todo.pop()
      sets = frozenset().union(*(terms.first(t) for t in state))
      for c in terms.representatives(sets):
        work += len(state)
        if work > budget:
          return None
        after = terms.prune(frozenset().union(*(terms.derive(t, c) for t in state)))
        if after and after not in seen:
          if len(seen) == limit:
            return limit + 1
          seen.add(after)
          todo.append(after)
  except (ValueError, RecursionError):
    return None
  return len(seen)
