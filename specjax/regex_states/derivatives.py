"""The terms of a regex's automaton: regular expressions as interned nodes with
their Antimirov partial derivatives by a byte, a character class a trie of its
UTF-8 encodings, a counted repetition a counter (`_Terms`). A state of the
automaton is a set of terms (`specjax.regex_states.count_states`).
"""

from __future__ import annotations

import math

from specjax.regex_states.char_classes import _MAX, _contains, _norm, _utf8


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
