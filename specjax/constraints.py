"""Constrained generation as data: regular languages compiled to token automata.

A constraint (a regex, a JSON schema, a list of choices) is compiled on the host
by outlines-core against the target's tokenizer into a token-level automaton:
the next state of each (state, token), -1 where the token is not allowed. On
the device a row's constraint is its current state; masking a position's logits
and advancing along a token are gathers inside the jitted loop, so no host code
runs per token. Why outlines-core: its index is exactly such a finite table
over the vocabulary (xgrammar and llguidance match grammars with a host-side
parser per token, which a jitted loop cannot call).

Ids that every state treats alike form one token class (inside a JSON string,
the ids that spell as many plain characters lead to one state), so an automaton is
stored as `[S, C]` transitions over classes and a `[V]` map from ids to
classes, with C in the hundreds even for a 128k vocabulary, where a schema's
dense `[S, V]` table runs to hundreds of MB (`memory_report`).

  Regex, JsonSchema, Choice   what a request asks for
  compile_constraint          one constraint -> `Automaton` (host, numpy)
  ConstraintTable             automata stacked into one device table, dense
                              `[S, V]` or by token class; state 0 allows every
                              token (unconstrained rows)
  RowConstraints              the table and each row's start state
  allowed, advance            the device side: masks and transitions

EOS ids are allowed only in accepting states (and keep the row there).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

FREE = 0  # the state of an unconstrained row: every token allowed, stays FREE

# `layout="auto"` keeps a table dense up to this size: there a dense row is one
# gather and the memory is small next to any model's weights; past it (a realistic
# JSON schema over a 128k vocabulary is hundreds of MB dense) the class layout,
# at the cost of one more V-wide gather per masked position.
DENSE_LIMIT_BYTES = 64 << 20


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


Constraint = Regex | JsonSchema | Choice  # what a request may ask for


@dataclasses.dataclass(frozen=True, eq=False)
class Automaton:
  """A token automaton on the host, stored by token class (see the module doc).

  Attributes:
    class_next: `[S, C]` int32, the state after a token of class c in state s;
      -1 where the class is not allowed.
    token_class: `[V]` int32, each id's class.
    start: the initial state.
    accepting: `[S]` bool, the states where the text may end (EOS allowed).
  """

  class_next: np.ndarray
  token_class: np.ndarray
  start: int
  accepting: np.ndarray

  @classmethod
  def from_transitions(
    cls,
    transitions: Sequence[tuple[np.ndarray, np.ndarray]],
    vocab_size: int,
    start: int,
    accepting: np.ndarray,
  ) -> Automaton:
    """The automaton whose state s allows exactly `transitions[s] = (ids [n], next
    states [n])` (distinct ids below `vocab_size`), grouped into token classes."""
    token_class, class_next = _token_classes(transitions, vocab_size)
    return cls(class_next, token_class, int(start), np.asarray(accepting, bool))

  @property
  def num_states(self) -> int:
    return self.class_next.shape[0]

  @property
  def num_classes(self) -> int:
    return self.class_next.shape[1]

  @property
  def vocab_size(self) -> int:
    return self.token_class.shape[0]

  @functools.cached_property
  def next_state(self) -> np.ndarray:
    """`[S, V]` int32 dense, -1 where a token is not allowed: built on first use
    (S * V * 4 bytes, for tests and small vocabularies)."""
    return self.class_next[:, self.token_class]

  def num_transitions(self) -> int:
    """The allowed (state, token) pairs."""
    sizes = np.bincount(self.token_class, minlength=self.num_classes)
    return int(((self.class_next >= 0) * sizes).sum())


def _token_classes(
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


def _outlines():
  try:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema
  except ImportError as e:  # pragma: no cover - the test extra installs it
    raise ImportError("constraints need outlines-core: pip install 'specjax[structured]'") from e
  return outlines_core, build_regex_from_schema


def to_regex(constraint: Regex | JsonSchema | Choice) -> str:
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
    text = schema if isinstance(schema, str) else json.dumps(schema)
    try:
      json.loads(text)
      return build_regex_from_schema(text)
    except Exception as e:  # outlines-core raises its own types
      raise ValueError(f"json_schema is not a schema outlines-core can compile: {e}") from None
  raise ValueError(
    f"constraint must be a Regex, JsonSchema or Choice, got {type(constraint).__name__}."
  )


def _escape(text: str) -> str:
  return "".join("\\" + c if c in r".^$*+?{}[]\|()" else c for c in text)


def compile_constraint(
  constraint: Regex | JsonSchema | Choice,
  token_bytes: Sequence[bytes | None],
  eos_ids: Sequence[int],
  vocab_size: int | None = None,
) -> Automaton:
  """Compiles `constraint` over a vocabulary (`specjax.vocab_map.token_bytes(tok)`:
  each id's bytes, None for specials) into an `Automaton` of `vocab_size` ids
  (default: the tokenizer's; a model's may be larger: those ids are never allowed).

  Raises:
    ValueError naming the field: a malformed constraint, no EOS id, or a
    language no token sequence can spell.
  """
  outlines_core, _ = _outlines()
  eos_ids = [int(i) for i in eos_ids]
  if not eos_ids:
    raise ValueError("eos_ids must name at least one id (a constrained text ends with EOS).")
  v = len(token_bytes) if vocab_size is None else int(vocab_size)
  pieces: dict[bytes, list[int]] = {}
  for i, piece in enumerate(token_bytes[:v]):
    if piece and i not in eos_ids:
      pieces.setdefault(piece, []).append(i)
  regex = to_regex(constraint)
  try:
    index = outlines_core.Index(regex, outlines_core.Vocabulary(eos_ids[0], pieces))
  except Exception as e:
    raise ValueError(f"constraint cannot be compiled over this vocabulary: {e}") from None
  transitions = index.get_transitions()
  finals = set(index.get_final_states())
  start = index.get_initial_state()
  # Reachable states only, numbered breadth-first from the start.
  order, seen = [start], {start}
  for state in order:
    for nxt in dict.fromkeys(transitions.get(state, {}).values()):  # distinct, in order
      if nxt not in seen:
        seen.add(nxt)
        order.append(nxt)
  number = np.zeros(max(order) + 1, np.int64)  # outlines' state ids -> ours
  number[order] = np.arange(len(order))
  accepting = np.array([s in finals for s in order])
  if not accepting.any():
    raise ValueError("constraint accepts no text this vocabulary can spell.")
  eos_kept = np.array(sorted({e for e in eos_ids if e < v}), np.int64)
  rows = []
  for k, s in enumerate(order):
    out = transitions.get(s, {})
    ids = np.fromiter(out.keys(), np.int64, len(out))
    nxt = number[np.fromiter(out.values(), np.int64, len(out))]
    keep = (ids < v) & ~np.isin(ids, eos_ids)
    ids, nxt = ids[keep], nxt[keep]
    if accepting[k]:  # EOS ends a complete text and keeps the row where it is
      ids, nxt = np.concatenate([ids, eos_kept]), np.concatenate([nxt, np.full_like(eos_kept, k)])
    rows.append((ids, nxt))
  return Automaton.from_transitions(rows, v, 0, accepting)


@struct.dataclass
class ConstraintTable:
  """Automata stacked into one device table: state 0 is `FREE`.

  One of two layouts, read by the same functions: dense, where an id is its own
  column (C = V); or by token class, where `token_class` maps ids to columns.

  Attributes:
    next_state: `[S, C]` int32, the next state of each state and column, -1 where
      not allowed; S (and a class table's C) are padded to buckets so that new
      constraints of a similar size reuse the program.
    token_class: `[V]` int32, each id's column; None for the dense layout.
  """

  next_state: jax.Array
  token_class: jax.Array | None = None

  @property
  def num_states(self) -> int:
    return self.next_state.shape[0]

  @property
  def vocab_size(self) -> int:
    return self.next_state.shape[1] if self.token_class is None else self.token_class.shape[0]

  @property
  def layout(self) -> str:
    return "dense" if self.token_class is None else "sparse"

  def nbytes(self) -> int:
    return sum(int(x.size) * 4 for x in (self.next_state, self.token_class) if x is not None)


@struct.dataclass
class RowConstraints:
  """What a generation call constrains: the table and each row's start state
  (`FREE` for an unconstrained row). Build it with `row_constraints`."""

  table: ConstraintTable
  start: jax.Array  # [B] int32


def _bucket(size: int) -> int:
  """A size padded to a power of two (at least 16): one program per bucket."""
  return max(16, 1 << (size - 1).bit_length())


def _stack(
  automata: Sequence[Automaton | None],
  vocab_size: int,
  num_states: int,
  num_classes: int,
  layout: str,
) -> tuple[np.ndarray, np.ndarray | None, list[int]]:
  """`row_constraints` on the host: `(next_state [S, C], token_class [V] or None,
  starts)`, never a dense `[S, V]` unless the layout is dense."""
  if layout not in ("auto", "dense", "sparse"):
    raise ValueError(f"layout must be 'auto', 'dense' or 'sparse', got {layout!r}.")
  unique = list({id(a): a for a in automata if a is not None}.values())
  for a in unique:
    if a.vocab_size != vocab_size:
      raise ValueError(
        f"automaton has {a.vocab_size} ids; the model's vocabulary has {vocab_size}."
      )
  # The batch's classes: ids that every automaton puts in the same class.
  joint = np.zeros(vocab_size, np.int64)
  for a in unique:
    joint = np.unique(joint * a.num_classes + a.token_class, return_inverse=True)[1].ravel()
  columns = np.unique(joint, return_index=True)[1]  # one id of each class
  blocks, offsets, total = [np.zeros((1, len(columns)), np.int32)], {}, 1
  for a in unique:
    offsets[id(a)] = total
    rows = a.class_next[:, a.token_class[columns]]
    blocks.append(np.where(rows >= 0, rows + total, -1).astype(np.int32))
    total += a.num_states
  starts = [FREE if a is None else offsets[id(a)] + a.start for a in automata]
  states = _bucket(max(total, num_states))
  if layout == "dense" or (layout == "auto" and states * vocab_size * 4 <= DENSE_LIMIT_BYTES):
    width, token_class = vocab_size, None
    blocks = [b[:, joint] for b in blocks]
  else:
    width, token_class = _bucket(max(len(columns), num_classes)), joint.astype(np.int32)
  table = np.full((states, width), -1, np.int32)
  table[:total, : blocks[0].shape[1]] = np.concatenate(blocks)
  return table, token_class, starts


def row_constraints(
  automata: Sequence[Automaton | None],
  vocab_size: int,
  num_states: int = 0,
  num_classes: int = 0,
  layout: str = "auto",
) -> RowConstraints:
  """One table for a batch: row b follows `automata[b]` (None: unconstrained).

  Rows with the same automaton object share its states. The table's states are
  padded to a power of two, at least `num_states` (a server's fixed bucket);
  under the class layout its classes too, at least `num_classes`.

  Args:
    layout: "dense" (`[S, V]`), "sparse" (`[S, C]` over the batch's token
      classes and a `[V]` class map) or "auto": dense while it takes at most
      `DENSE_LIMIT_BYTES`. Both give the same masks and transitions.
  """
  table, token_class, starts = _stack(automata, vocab_size, num_states, num_classes, layout)
  token_class = None if token_class is None else jnp.asarray(token_class)
  return RowConstraints(
    ConstraintTable(jnp.asarray(table), token_class), jnp.asarray(starts, jnp.int32)
  )


def check_rows(rules, batch: int, vocab_size: int) -> RowConstraints | None:
  """`rules` checked against the batch and the model's vocabulary (host, before compiling)."""
  if rules is None:
    return None
  if not isinstance(rules, RowConstraints):
    raise ValueError(
      f"constraints must be a specjax.constraints.RowConstraints, got {type(rules).__name__}."
    )
  if rules.start.shape != (batch,):
    raise ValueError(f"constraints.start must have one state per row, [{batch}], got "
                     f"{tuple(rules.start.shape)}.")  # fmt: skip
  if rules.table.vocab_size != vocab_size:
    raise ValueError(
      f"constraints.table must cover the model's {vocab_size} ids, got {rules.table.vocab_size}."
    )
  return rules


def allowed(table: ConstraintTable, states: jax.Array) -> jax.Array:
  """`[..., V]` bool: the tokens allowed in `states [...]`. A dead state (-1,
  after a token that was not allowed) allows every token: positions after it are
  never reached, and their laws must stay finite."""
  ok = jnp.take(table.next_state, jnp.maximum(states, 0), axis=0) >= 0  # [..., C]
  if table.token_class is not None:  # classes -> ids, gathering bools (a quarter of int32's bytes)
    ok = jnp.take(ok, table.token_class, axis=-1)
  return ok | (states < 0)[..., None]


def advance(table: ConstraintTable, states: jax.Array, tokens: jax.Array) -> jax.Array:
  """`[...]` int32: the state after `tokens [...]` in `states [...]`; -1 (dead)
  for a token not allowed there or an id outside the table."""
  v = table.vocab_size
  inside = (tokens >= 0) & (tokens < v) & (states >= 0)
  column = jnp.clip(tokens, 0, v - 1)
  if table.token_class is not None:
    column = table.token_class[column]
  return jnp.where(inside, table.next_state[jnp.maximum(states, 0), column], -1)


def mask_logits(logits: jax.Array, table: ConstraintTable, states: jax.Array) -> jax.Array:
  """`logits [..., V']` with the tokens not allowed in `states [...]` at -inf (ids
  past the table's V are never allowed)."""
  mask = allowed(table, states)
  v, width = mask.shape[-1], logits.shape[-1]
  if width > v:
    mask = jnp.concatenate([mask, jnp.zeros(mask.shape[:-1] + (width - v,), bool)], -1)
  return jnp.where(mask[..., :width], logits, -jnp.inf)


def memory_report(automaton: Automaton) -> dict[str, int]:
  """One automaton's table in both layouts, as `row_constraints` builds them
  (with the FREE row and the buckets): `dense_bytes` unpadded `[S, V]`,
  `sparse_bytes` the class layout's device bytes, `classes` its C unpadded."""
  table, token_class, _ = _stack([automaton], automaton.vocab_size, 0, 0, "sparse")
  return {
    "states": automaton.num_states,
    "vocab_size": automaton.vocab_size,
    "classes": automaton.num_classes,
    "transitions": automaton.num_transitions(),
    "dense_bytes": automaton.num_states * automaton.vocab_size * 4,
    "sparse_bytes": (table.size + token_class.size) * 4,
  }
