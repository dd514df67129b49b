"""Character classes as code point ranges, over Unicode and spelled in UTF-8:
their set operations, Unicode's general categories and Perl classes (`\\d`,
`\\s`, `\\w`) from this Python's `unicodedata`, named ASCII classes, case
folding, and a range's UTF-8 encodings as byte ranges (regex-automata's
Utf8Sequences). Ranges are tuples of `(lo, hi)`, sorted, disjoint and not
adjacent (`_norm`). Standard library only (see `specjax.regex_states`).
"""

from __future__ import annotations

import bisect
import functools
import unicodedata

_MAX = 0x10FFFF
_ALL = ((0, _MAX),)


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


def _contains(ranges: tuple, c: int) -> bool:
  k = bisect.bisect_right(ranges, (c, _MAX + 1)) - 1
  return k >= 0 and ranges[k][1] >= c
