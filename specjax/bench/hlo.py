"""Counting what a compiled program executes: kernels per loop body, from its HLO.

XLA runs a jitted program as a sequence of kernels ("thunks" on CPU): each
fusion, dot, gather, dynamic-update-slice, custom call or copy of the top-level
computations is one launch with a fixed cost, whatever its size. On a small
model that fixed cost, not arithmetic, is what a decode step spends outside
its matrix products, so the count of those kernels per loop iteration is the
number to drive down. Instructions that launch nothing (parameters, constants,
tuples, bitcasts) are not counted; fused computations and reduction bodies are
folded into the instruction that calls them.
"""

from __future__ import annotations

import collections
import re

_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all"}
_HEADER = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")  # unindented, ends in {
_OPCODE = re.compile(r"=\s+(?:\(.*?\)|\S+)\s+([a-z][a-z0-9\-]*)\(")
_CALLED = re.compile(r"(?:calls|to_apply|condition|body|branch_computations)=\{?%?([\w.\-]+)")
_BODY = re.compile(r"body=%?([\w.\-]+)")


def computations(hlo_text: str) -> dict[str, list[str]]:
  """Computation name -> its instruction lines, from `compiled.as_text()`."""
  comps: dict[str, list[str]] = {}
  name = None
  for line in hlo_text.splitlines():
    header = _HEADER.match(line)
    if header:
      name = header.group(1)
      comps[name] = []
    elif line.strip() == "}":
      name = None
    elif name is not None and " = " in line:
      comps[name].append(line)
  return comps


def kernel_counts(hlo_text: str) -> dict[str, collections.Counter]:
  """Per top-level computation (entry, loop bodies and conditions, branches): the
  opcodes it launches, counted. Fusion bodies and reducers are not top-level."""
  comps = computations(hlo_text)
  folded = set()
  for lines in comps.values():
    for line in lines:
      op = _OPCODE.search(line)
      if op and op.group(1) not in ("while", "conditional", "call"):
        folded.update(_CALLED.findall(line))
  counts = {}
  for name, lines in comps.items():
    if name in folded:
      continue
    ops = (m.group(1) for m in map(_OPCODE.search, lines) if m)
    counts[name] = collections.Counter(op for op in ops if op not in _FREE)
  return counts


def while_bodies(hlo_text: str) -> list[str]:
  """Names of the computations that are the bodies of while loops, outermost first."""
  bodies = []
  for lines in computations(hlo_text).values():
    for line in lines:
      op = _OPCODE.search(line)
      if op and op.group(1) == "while":
        bodies.extend(_BODY.findall(line))
  return bodies


def loop_kernels(compiled_text: str) -> list[dict]:
  """For each while loop of a compiled program: its body's kernel count and the
  five most frequent opcodes (a summary for reports)."""
  counts = kernel_counts(compiled_text)
  out = []
  for body in while_bodies(compiled_text):
    c = counts.get(body, collections.Counter())
    out.append({"body": body, "kernels": sum(c.values()), "top": dict(c.most_common(5))})
  return out
