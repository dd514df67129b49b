"""Rust regex syntax (regex-syntax's, which outlines-core reads) parsed into
`_Terms` nodes: flags and verbose mode, groups, escapes, bracketed classes and
their operators (`&&`, `--`, `~~`), counted repetitions.
"""

from __future__ import annotations

import re

from specjax.regex_states.char_classes import (
  _ALL,
  _CLASS_OPS,
  _MAX,
  _POSIX,
  _fold,
  _negate,
  _norm,
  _perl,
  _spelled,
  _unicode_class,
)
from specjax.regex_states.derivatives import _Terms

_NEST = 250  # groups inside groups at most (regex-syntax's own nest limit)
_ESCAPES = {"n": 10, "t": 9, "r": 13, "f": 12, "v": 11, "a": 7, "0": 0}
_HEX_DIGITS = {"x": 2, "u": 4, "U": 8}

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
