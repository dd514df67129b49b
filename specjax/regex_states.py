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

This module imports only the standard library: the compile worker loads it
beside `specjax/grammar.py` (see there).
"""

from __future__ import annotations

import bisect
import functools
import math
import re
import time
import unicodedata

_MAX = 0x10FFFF
_ALL = ((0, _MAX),)
_NEST = 250  # groups inside groups at most (regex-syntax's own nest limit)
# What a count may spend before it gives up (None) rather than delay a compile:
# derivative steps (about a second of work), and seconds (for a pattern whose
# every step is costly).
BUDGET = 4_000_000
SECONDS = 2.0


def _norm(ranges) -> tuple:
  """Code point ranges `(lo, hi)` as a sorted tuple of disjoint, non-adjacent ones."""
  out: list[tuple[int, int]] = []
  for lo, hi in sorted(ranges):
    if out and lo <= out[-1][1] + 1:
      out[-1] = (out[-1][0], max(hi, out[-1][1]))
    else:
      out.append((lo, hi))
  return tuple(out)


def _negate(ranges: tuple) -> tuple:
  out, start = [], 0
  for lo, hi in ranges:
    if lo > start:
      out.append((start, lo - 1))
    start = hi + 1
  return tuple(out) + (((start, _MAX),) if start <= _MAX else ())


def _and(a: tuple, b: tuple) -> tuple:
  return _negate(_norm(_negate(a) + _negate(b)))


_CLASS_OPS = {
  "&&": _and,
  "--": lambda a, b: _and(a, _negate(b)),
  "~~": lambda a, b: _norm(_and(a, _negate(b)) + _and(b, _negate(a))),
}
# White_Space, exactly (\s).
_SPACE = _norm(
  [(9, 13), (32, 32), (0x85, 0x85), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A)]
  + [(0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000)]
)
_CATEGORY_NAMES = {
  "letter": "L", "mark": "M", "number": "N", "punctuation": "P", "symbol": "S",
  "separator": "Z", "other": "C", "digit": "Nd", "decimalnumber": "Nd",
  "uppercaseletter": "Lu", "lowercaseletter": "Ll",
}  # fmt: skip
_POSIX = {
  "alnum": "0-9A-Za-z", "alpha": "A-Za-z", "ascii": "\x00-\x7f", "blank": "\t ",
  "cntrl": "\x00-\x1f\x7f", "digit": "0-9", "graph": "!-~", "lower": "a-z", "print": " -~",
  "punct": "!-/:-@[-`{-~", "space": "\t-\r ", "upper": "A-Z", "word": "0-9A-Za-z_",
  "xdigit": "0-9A-Fa-f",
}  # fmt: skip
_ESCAPES = {"n": 10, "t": 9, "r": 13, "f": 12, "v": 11, "a": 7, "0": 0}
_HEX_DIGITS = {"x": 2, "u": 4, "U": 8}


@functools.cache
def _categories() -> dict[str, tuple]:
  """Each Unicode general category's code point ranges (as this Python's
  `unicodedata` knows them; Rust's regex may know a newer Unicode)."""
  runs: dict[str, list] = {}
  start, current = 0, unicodedata.category("\0")
  for cp in range(1, _MAX + 2):
    category = unicodedata.category(chr(cp)) if cp <= _MAX else ""
    if category != current:
      runs.setdefault(current, []).append((start, cp - 1))
      start, current = cp, category
  return {name: tuple(ranges) for name, ranges in runs.items()}


def _category(*prefixes: str) -> tuple:
  """The code points of the general categories that begin with one of `prefixes`."""
  categories = _categories().items()
  return _norm(r for name, ranges in categories if name.startswith(prefixes) for r in ranges)


@functools.cache
def _perl(letter: str) -> tuple:
  """`\\d`, `\\s` or `\\w` (lower case), as Rust's regex defines them over Unicode."""
  if letter == "d":
    return _category("Nd")
  if letter == "s":
    return _SPACE
  return _norm(_category("L", "M", "Nd", "Nl", "Pc") + ((0x200C, 0x200D),))  # + Join_Control


def _unicode_class(name: str) -> tuple:
  """`\\p{name}`: a general category (`L`, `Lu`, `Letter`, `Nd`) or White_Space;
  any other name (a script: Greek, Han) counts as one block of two-byte
  characters, so that its shape counts and its bytes are not overcounted."""
  key = name.lstrip("^").replace("_", "").replace(" ", "").replace("-", "").lower()
  if key in ("whitespace", "space"):
    return _SPACE
  category = _CATEGORY_NAMES.get(key, key.capitalize())
  if category[:1] in "LMNPSZC" and 0 < len(category) <= 2 and _category(category):
    return _category(category)
  return ((0x370, 0x3FF),)


def _utf8(lo: int, hi: int) -> list[tuple]:
  """The UTF-8 encodings of the code points `lo..hi` (surrogates aside) as
  sequences of byte ranges, one range per byte (regex-automata's Utf8Sequences)."""
  out, todo = [], [(lo, hi)]
  while todo:
    lo, hi = todo.pop()
    if lo > hi:
      continue
    if lo <= 0xDFFF and hi >= 0xD800:  # no surrogate has an encoding
      todo += [(lo, 0xD7FF), (0xE000, hi)]
      continue
    split = next((b for b in (0x7F, 0x7FF, 0xFFFF) if lo <= b < hi), None)
    if split is not None:  # one length of encoding at a time
      todo += [(lo, split), (split + 1, hi)]
      continue
    for i in range(1, len(chr(lo).encode())):
      mask = (1 << (6 * i)) - 1
      if lo & ~mask != hi & ~mask:  # the last i bytes must each span a whole range
        if lo & mask:
          todo += [(lo, lo | mask), ((lo | mask) + 1, hi)]
          break
        if hi & mask != mask:
          todo += [(lo, (hi & ~mask) - 1), (hi & ~mask, hi)]
          break
    else:
      out.append(tuple(zip(chr(lo).encode(), chr(hi).encode())))
  return out


def _spelled(spec: str) -> tuple:
  """The ranges of a class spelled like "a-z0-9_" (no escapes)."""
  out, i = [], 0
  while i < len(spec):
    if i + 2 < len(spec) and spec[i + 1] == "-":
      out.append((ord(spec[i]), ord(spec[i + 2])))
      i += 3
    else:
      out.append((ord(spec[i]), ord(spec[i])))
      i += 1
  return _norm(out)


def _fold(ranges: tuple) -> tuple:
  """`ranges` and their other case: ASCII exactly, short non-ASCII runs char by char."""
  extra = []
  for lo, hi in ranges:
    for a, b, shift in ((97, 122, -32), (65, 90, 32)):
      low, high = max(lo, a), min(hi, b)
      if low <= high:
        extra.append((low + shift, high + shift))
    if lo > 127 and hi - lo < 64:
      for cp in range(lo, hi + 1):
        for other in {chr(cp).lower(), chr(cp).upper()}:
          if len(other) == 1:
            extra.append((ord(other), ord(other)))
  return _norm(ranges + tuple(extra))


class _Terms:
  """Regular expressions as interned nodes (ids), each with whether it matches ""
  and, on demand, its first characters and derivatives."""

  EPS = 0  # matches "" only

  def __init__(self):
    self.nodes: list[tuple] = [("eps",)]
    self.nullable: list[bool] = [True]
    self._ids: dict[tuple, int] = {("eps",): 0}
    self._chars: dict[tuple, int] = {}
    self._spelled: dict[frozenset, int] = {}
    self._spines: dict[int, tuple[int, tuple]] = {}
    self._shapes: dict[tuple, int] = {}
    self._first: dict[int, frozenset] = {}
    self._derived: dict[tuple[int, int], frozenset] = {}
    self._reps: dict[frozenset, list[int]] = {}

  def _add(self, node: tuple, nullable: bool) -> int:
    i = self._ids.get(node)
    if i is None:
      i = self._ids[node] = len(self.nodes)
      self.nodes.append(node)
      self.nullable.append(nullable)
    return i

  def chars(self, ranges: tuple) -> int:
    """One character of `ranges` (code points), spelled in UTF-8 bytes: the
    automaton is over bytes, as outlines-core's is."""
    if ranges not in self._chars:
      self._chars[ranges] = self._spell(frozenset(s for r in ranges for s in _utf8(*r)))
    return self._chars[ranges]

  def _spell(self, sequences: frozenset) -> int:
    """The byte sequences (tuples of byte ranges) as a deterministic trie: the
    first bytes cut into disjoint ranges, each followed by the rest of the
    sequences it begins (of one length: UTF-8's first byte tells it)."""
    if sequences in self._spelled:
      return self._spelled[sequences]
    if () in sequences:
      return self.EPS
    events: dict[int, list] = {}
    for s in sequences:
      events.setdefault(s[0][0], []).append((True, s))
      events.setdefault(s[0][1] + 1, []).append((False, s))
    points, active, after = sorted(events), set(), {}
    for lo, end in zip(points, points[1:]):  # a sweep over the first byte
      for starts, s in events[lo]:
        (active.add if starts else active.discard)(s)
      if active:
        after.setdefault(frozenset(s[1:] for s in active), []).append((lo, end - 1))
    options = [
      self.cat(self._add(("set", _norm(firsts)), False), self._spell(rest))
      for rest, firsts in after.items()
    ]
    self._spelled[sequences] = self.alt(options)
    return self._spelled[sequences]

  def cat(self, a: int, b: int) -> int:
    if a == self.EPS or b == self.EPS:
      return a + b  # the other one
    return self._add(("cat", a, b), self.nullable[a] and self.nullable[b])

  def seq(self, items: list[int]) -> int:
    out = self.EPS
    for item in reversed(items):  # right-nested, built without recursion
      out = self.cat(item, out)
    return out

  def alt(self, items: list[int]) -> int:
    options = frozenset(items)
    if len(options) == 1:
      return next(iter(options))
    return self._add(("alt", options), any(self.nullable[i] for i in options))

  def rep(self, r: int, lo: int, hi: int | None) -> int:
    """`r{lo,hi}` (hi None: no bound), kept as a counter."""
    if hi == 0 or r == self.EPS:
      return self.EPS
    lo = 0 if self.nullable[r] else lo  # copies of "" add nothing
    if (lo, hi) == (1, 1):
      return r
    return self._add(("rep", r, lo, hi), lo == 0)

  def first(self, t: int) -> frozenset:
    """The ids of the byte sets a text of `t` may begin with."""
    if t in self._first:
      return self._first[t]
    out, node = set(), t
    while True:  # along a right-nested sequence, without recursion
      kind = self.nodes[node]
      if kind[0] == "cat":
        out |= self.first(kind[1])
        if not self.nullable[kind[1]]:
          break
        node = kind[2]
        continue
      if kind[0] == "set":
        out.add(node)
      elif kind[0] == "alt":
        for option in kind[1]:
          out |= self.first(option)
      elif kind[0] == "rep":
        out |= self.first(kind[1])
      break
    self._first[t] = frozenset(out)
    return self._first[t]

  def derive(self, t: int, c: int) -> frozenset:
    """The partial derivatives of `t` by the byte `c` (Antimirov)."""
    key = (t, c)
    if key in self._derived:
      return self._derived[key]
    out, node = set(), t
    while True:
      kind = self.nodes[node]
      if kind[0] == "cat":
        out.update(self.cat(d, kind[2]) for d in self.derive(kind[1], c))
        if not self.nullable[kind[1]]:
          break
        node = kind[2]
        continue
      if kind[0] == "set":
        if _contains(kind[1], c):
          out.add(self.EPS)
      elif kind[0] == "alt":
        for option in kind[1]:
          out |= self.derive(option, c)
      elif kind[0] == "rep":
        _, r, lo, hi = kind
        rest = self.rep(r, max(lo - 1, 0), None if hi is None else hi - 1)
        out.update(self.cat(d, rest) for d in self.derive(r, c))
      break
    self._derived[key] = frozenset(out)
    return self._derived[key]

  def prune(self, state: frozenset) -> frozenset:
    """`state` without the terms that another one of its terms contains: those of
    one shape whose bounds are no larger, where the repeated part matches ""
    (`(a*){0,3}b` within `(a*){0,5}b`). A Thompson automaton (outlines-core's)
    holds every smaller bound there as well, so its state is the same; without
    this, `(a*){0,1000}` would count a state per bound left (1,001; the table: 2)."""
    if len(state) < 2:
      return state
    shapes: dict[int, list] = {}
    for t in state:
      shape, bounds = self._spine(t)
      shapes.setdefault(shape, []).append((bounds, t))
    if len(shapes) == len(state):
      return state
    kept = []
    for members in shapes.values():
      front: list[tuple] = []  # sorted largest first, so a container comes before
      for bounds, t in sorted(members, reverse=True):
        if not any(all(x >= y for x, y in zip(f, bounds)) for f, _ in front):
          front.append((bounds, t))
      kept += [t for _, t in front]
    return frozenset(kept)

  def _spine(self, t: int) -> tuple[int, tuple]:
    """`t` as (shape, bounds): its right-nested sequence with each `x{0,n}` on it
    (`x` matching "") a hole, and those `n`s (inf: none). Iterative: a sequence
    may be long."""
    chain, node = [], t
    while node not in self._spines and self.nodes[node][0] == "cat":
      chain.append(node)
      node = self.nodes[node][2]
    if node not in self._spines:
      self._spines[node] = self._part(node)
    shape, bounds = self._spines[node]
    for cat in reversed(chain):
      head, head_bounds = self._part(self.nodes[cat][1])
      shape, bounds = self._shape(("cat", head, shape)), head_bounds + bounds
      self._spines[cat] = (shape, bounds)
    return self._spines[t]

  def _part(self, node: int) -> tuple[int, tuple]:
    """One element of a sequence as (shape, bounds): `x{0,n}` whose `x` matches
    "" a hole and `n`; anything else itself."""
    kind = self.nodes[node]
    if kind[0] == "rep" and self.nullable[kind[1]]:
      return self._shape(("hole", kind[1])), (math.inf if kind[3] is None else kind[3],)
    return self._shape(("term", node)), ()

  def _shape(self, key: tuple) -> int:
    return self._shapes.setdefault(key, len(self._shapes))

  def representatives(self, sets: frozenset) -> list[int]:
    """One byte of each class the byte sets `sets` tell apart."""
    if sets not in self._reps:
      ranges = [self.nodes[i][1] for i in sets]
      points = sorted({p for r in ranges for lo, hi in r for p in (lo, hi + 1) if p <= _MAX})
      classes: dict[tuple, int] = {}
      for p in points:  # membership is constant from one point to the next
        inside = tuple(k for k, r in enumerate(ranges) if _contains(r, p))
        if inside:
          classes.setdefault(inside, p)
      self._reps[sets] = list(classes.values())
    return self._reps[sets]


def _contains(ranges: tuple, c: int) -> bool:
  k = bisect.bisect_right(ranges, (c, _MAX + 1)) - 1
  return k >= 0 and ranges[k][1] >= c


_COUNT = re.compile(r"\{(\d+)(,(\d*))?\}")
_COUNT_VERBOSE = re.compile(r"\{\s*(\d+)\s*(,\s*(\d*)\s*)?\}")  # (?x) allows spaces inside
_GROUP_FLAGS = re.compile(r"\?([a-zA-Z-]*)([:)])")  # after "(": (?i) or (?i:...)


def _with_flags(flags: frozenset, letters: str) -> frozenset:
  on, _, off = letters.partition("-")
  return (flags | set(on)) - set(off)


class _Parser:
  """Rust regex syntax (regex-syntax's, which outlines-core reads) to `_Terms`
  nodes. ValueError for what it does not take (lookaround, unknown escapes,
  unclosed groups or classes): outlines-core refuses those too."""

  def __init__(self, pattern: str, terms: _Terms):
    self.p, self.i, self.terms = pattern, 0, terms

  def parse(self) -> int:
    node = self._body(frozenset(), 0)
    if self.i < len(self.p):
      raise ValueError("a ')' without its '('")
    return node

  def _at(self, text: str) -> bool:
    return self.p.startswith(text, self.i)

  def _space(self, flags: frozenset, comments: bool = True) -> bool:
    """Skips verbose mode's whitespace and `#` comments; whether there were any."""
    start = self.i
    while "x" in flags and self.i < len(self.p):
      if comments and self.p[self.i] == "#":
        end = self.p.find("\n", self.i)
        self.i = len(self.p) if end < 0 else end + 1
      elif self.p[self.i].isspace():
        self.i += 1
      else:
        break
    return self.i > start

  def _body(self, flags: frozenset, depth: int) -> int:
    """The alternation up to its group's `)` (left for the caller) or the end; a
    flag group `(?x)` inside it sets flags until there."""
    if depth > _NEST:
      raise ValueError("groups nested too deep")
    branches, items = [], []
    while self.i < len(self.p) and self.p[self.i] != ")":
      if self._space(flags):
        continue
      c = self.p[self.i]
      if c == "|":
        self.i += 1
        branches.append(self.terms.seq(items))
        items = []
      elif c in "*+?{":
        if not items:
          raise ValueError("a repetition of nothing")
        items[-1] = self._repeat(items[-1], flags)
      else:
        atom, flags = self._atom(flags, depth)
        if atom is not None:
          items.append(atom)
    branches.append(self.terms.seq(items))
    return self.terms.alt(branches)

  def _repeat(self, node: int, flags: frozenset) -> int:
    if self.p[self.i] == "{":
      count = (_COUNT_VERBOSE if "x" in flags else _COUNT).match(self.p, self.i)
      if count is None:
        raise ValueError("a '{' that opens no count")
      lo = int(count.group(1))
      hi = lo if count.group(2) is None else int(count.group(3)) if count.group(3) else None
      if hi is not None and hi < lo:
        raise ValueError("a count whose bounds are reversed")
      self.i = count.end()
    else:
      lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[self.p[self.i]]
      self.i += 1
    if self._at("?"):  # lazy: the same language
      self.i += 1
    return self.terms.rep(node, lo, hi)

  def _atom(self, flags: frozenset, depth: int) -> tuple[int | None, frozenset]:
    """The next atom's node, or None and the flags a flag group `(?i)` sets."""
    c, terms = self.p[self.i], self.terms
    if c == "(":
      return self._group(flags, depth)
    if c == "[":
      return terms.chars(self._class(flags)), flags
    if c == "\\":
      item = self._escape()
    elif c == ".":  # any character; but a newline only in (?s) mode
      item = _ALL if "s" in flags else _negate(((10, 10),))
      self.i += 1
    else:
      item = None if c in "^$" else ord(c)
      self.i += 1
    if item is None:  # an anchor: no character
      return terms.EPS, flags
    if isinstance(item, int):
      item = self._cased(((item, item),), flags)
    return terms.chars(item), flags

  def _group(self, flags: frozenset, depth: int) -> tuple[int | None, frozenset]:
    self.i += 1
    inner = flags
    if self._at("?P<") or (self._at("?<") and not self._at("?<=") and not self._at("?<!")):
      end = self.p.find(">", self.i)
      if end < 0:
        raise ValueError("an unclosed group name")
      self.i = end + 1
    elif self._at("?"):
      group = _GROUP_FLAGS.match(self.p, self.i)
      if group is None:
        raise ValueError("lookaround, or a group outlines-core does not take")
      self.i = group.end()
      inner = _with_flags(flags, group.group(1))
      if group.group(2) == ")":
        return None, inner
    node = self._body(inner, depth + 1)
    if not self._at(")"):
      raise ValueError("an unclosed group")
    self.i += 1
    return node, flags

  def _cased(self, ranges: tuple, flags: frozenset) -> tuple:
    return _fold(ranges) if "i" in flags else ranges

  def _escape(self, in_class: bool = False) -> int | tuple | None:
    """After a backslash: a character (int), a class (ranges) or an anchor (None)."""
    if self.i + 1 >= len(self.p):
      raise ValueError("a trailing backslash")
    c = self.p[self.i + 1]
    self.i += 2
    if c.lower() in "dsw":
      ranges = _perl(c.lower())
      return _negate(ranges) if c.isupper() else ranges
    if c in "pP":
      ranges = _unicode_class(self._braced() if self._at("{") else self._take(1))
      return _negate(ranges) if c == "P" else ranges
    if c in _HEX_DIGITS:
      code = int(self._braced() if self._at("{") else self._take(_HEX_DIGITS[c]), 16)
      if code > _MAX:
        raise ValueError("a code point past U+10FFFF")
      return code
    if c in "bBAz<>" and not in_class:
      return None
    if c in _ESCAPES:
      return _ESCAPES[c]
    if c.isalnum() or c in "bBAz<>":
      raise ValueError(f"an unknown escape \\{c}")
    return ord(c)

  def _take(self, n: int) -> str:
    text = self.p[self.i : self.i + n]
    self.i += n
    return text

  def _braced(self) -> str:
    end = self.p.find("}", self.i)
    if end < 0:
      raise ValueError("an unclosed '{'")
    text = self.p[self.i + 1 : end]
    self.i = end + 1
    return text

  def _class(self, flags: frozenset) -> tuple:
    """A bracketed class: characters, ranges, escapes, `[:name:]` and nested
    classes, joined by `&&`, `--` and `~~` left to right."""
    self.i += 1
    negated = self._at("^")
    self.i += negated
    done, op, items, first = None, None, [], True
    while not (self._at("]") and not first):
      if self.i >= len(self.p):
        raise ValueError("an unclosed class")
      first = False
      if self._space(flags, comments=False):
        continue
      if self.p[self.i : self.i + 2] in _CLASS_OPS:
        done = _combine(done, op, items)
        op, items = self._take(2), []
      elif self._at("[:") and ":]" in self.p[self.i :]:
        name = self.p[self.i + 2 : self.p.index(":]", self.i)]
        if name.lstrip("^") not in _POSIX:
          raise ValueError(f"an unknown class [:{name}:]")
        self.i += len(name) + 4
        ranges = _spelled(_POSIX[name.lstrip("^")])
        items.extend(_negate(ranges) if name.startswith("^") else ranges)
      elif self._at("["):
        items.extend(self._class(flags))
      else:
        items.extend(self._range())
    self.i += 1
    ranges = self._cased(_combine(done, op, items), flags)
    return _negate(ranges) if negated else ranges

  def _range(self) -> tuple:
    """One class item: a character, a range `a-z`, or an escaped class `\\d`."""
    low = self._escape(in_class=True) if self._at("\\") else ord(self._take(1))
    if isinstance(low, tuple):
      return low
    if not (self._at("-") and self.i + 1 < len(self.p) and self.p[self.i + 1] != "]"):
      return ((low, low),)
    self.i += 1
    high = self._escape(in_class=True) if self._at("\\") else ord(self._take(1))
    if not isinstance(high, int) or high < low:
      raise ValueError("a class range that is not one")
    return ((low, high),)


def _combine(done: tuple | None, op: str | None, items: list) -> tuple:
  ranges = _norm(items)
  return ranges if op is None else _CLASS_OPS[op](done, ranges)


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
