"""outlines-core's index over a vocabulary, as numpy arrays: the vocabulary's
pieces with the `END` token (`vocabulary_pieces`), the live states of a regex's
token automaton with their transitions grouped into token classes
(`compile_arrays`, `token_classes`): the fields of
`specjax.constraints.Automaton`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specjax.grammar.kinds import CompileError
from specjax.grammar.outlines import _outlines, _uncaught

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
  order = _live_states(index.get_initial_state(), edges, finals)
  if not order:
    raise CompileError("constraint accepts no text this vocabulary can spell.")
  if max_states is not None and len(order) > max_states:
    raise CompileError(f"constraint has {len(order)} states; the table holds at most {max_states}.")
  number = dict(zip(order, range(len(order))))  # outlines' state ids -> ours
  accepting = np.array([s in finals for s in order])
  eos_kept = np.array(sorted({e for e in eos if e < v}), np.int64)
  rows = []
  for k, s in enumerate(order):
    out = {i: number[n] for i, n in edges.get(s, {}).items() if n in number}  # live states only
    ids = np.fromiter(out.keys(), np.int64, len(out))
    nxt = np.fromiter(out.values(), np.int64, len(out))
    if accepting[k]:  # EOS ends a complete text and keeps the row where it is
      ids, nxt = np.concatenate([ids, eos_kept]), np.concatenate([nxt, np.full_like(eos_kept, k)])
    rows.append((ids, nxt))
  token_class, class_next = token_classes(rows, v)
  return class_next, token_class, 0, accepting


def _live_states(start: int, edges: dict[int, dict[int, int]], finals: set[int]) -> list[int]:
  """The live states, in breadth-first order from `start`: reachable from it by
  tokens and able to reach a final state (bytes of END's own character, spelled
  by byte tokens, lead nowhere). Empty where `start` is not live."""
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
  return [s for s in order if s in live]


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
