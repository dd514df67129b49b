"""Constrained generation as data: regular languages compiled to token automata.

A constraint (a regex, a JSON schema, a list of choices) is compiled on the host
by outlines-core against the target's tokenizer into a token-level automaton:
`next_state[state, token]`, -1 where the token is not allowed. On the device a
row's constraint is its current state; masking a position's logits and advancing
along a token are gathers inside the jitted loop, so no host code runs per
token. Why outlines-core: its index is exactly such a finite table over the
vocabulary (xgrammar and llguidance match grammars with a host-side parser per
token, which a jitted loop cannot call).

  Regex, JsonSchema, Choice   what a request asks for
  compile_constraint          one constraint -> `Automaton` (host, numpy)
  ConstraintTable             automata stacked into one device table; state 0
                              allows every token (unconstrained rows)
  RowConstraints              the table and each row's start state
  allowed, advance            the device side: masks and transitions

EOS ids are allowed only in accepting states (and keep the row there).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

FREE = 0  # the state of an unconstrained row: every token allowed, stays FREE


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
class Automaton:
  """A token automaton on the host.

  Attributes:
    next_state: `[S, V]` int32, -1 where the token is not allowed.
    start: the initial state.
    accepting: `[S]` bool, the states where the text may end (EOS allowed).
  """

  next_state: np.ndarray
  start: int
  accepting: np.ndarray

  @property
  def num_states(self) -> int:
    return self.next_state.shape[0]


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
    for nxt in transitions.get(state, {}).values():
      if nxt not in seen:
        seen.add(nxt)
        order.append(nxt)
  number = {s: k for k, s in enumerate(order)}
  table = np.full((len(order), v), -1, np.int32)
  for s in order:
    for token, nxt in transitions.get(s, {}).items():
      if token < v and token not in eos_ids:
        table[number[s], token] = number[nxt]
  accepting = np.array([s in finals for s in order])
  for eos in eos_ids:
    if eos < v:
      table[accepting, eos] = np.nonzero(accepting)[0]
  if not accepting.any():
    raise ValueError("constraint accepts no text this vocabulary can spell.")
  return Automaton(table, 0, accepting)


@struct.dataclass
class ConstraintTable:
  """Automata stacked into one device table: state 0 is `FREE`.

  Attributes:
    next_state: `[S, V]` int32, -1 where the token is not allowed; S is padded
      to a bucket so that new constraints of a similar size reuse the program.
  """

  next_state: jax.Array

  @property
  def num_states(self) -> int:
    return self.next_state.shape[0]

  def nbytes(self) -> int:
    return int(self.next_state.size) * 4


@struct.dataclass
class RowConstraints:
  """What a generation call constrains: the table and each row's start state
  (`FREE` for an unconstrained row). Build it with `row_constraints`."""

  table: ConstraintTable
  start: jax.Array  # [B] int32


def _bucket(states: int) -> int:
  """States padded to a power of two (at least 16): one program per bucket."""
  return max(16, 1 << (states - 1).bit_length())


def row_constraints(
  automata: Sequence[Automaton | None], vocab_size: int, num_states: int = 0
) -> RowConstraints:
  """One table for a batch: row b follows `automata[b]` (None: unconstrained).
  Rows with the same automaton object share its states. The table's states are
  padded to a power of two, at least `num_states` (a server's fixed bucket)."""
  tables, offsets, starts = [np.zeros((1, vocab_size), np.int32)], {}, []
  total = 1
  for a in automata:
    if a is None:
      starts.append(FREE)
      continue
    if a.next_state.shape[1] != vocab_size:
      raise ValueError(
        f"automaton has {a.next_state.shape[1]} ids; the model's vocabulary has {vocab_size}."
      )
    if id(a) not in offsets:
      offsets[id(a)] = total
      tables.append(np.where(a.next_state >= 0, a.next_state + total, -1).astype(np.int32))
      total += a.num_states
    starts.append(offsets[id(a)] + a.start)
  pad = _bucket(max(total, num_states)) - total
  tables.append(np.full((pad, vocab_size), -1, np.int32))
  return RowConstraints(
    ConstraintTable(jnp.asarray(np.concatenate(tables))), jnp.asarray(starts, jnp.int32)
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
  if rules.table.next_state.shape[1] != vocab_size:
    raise ValueError(
      f"constraints.table must cover the model's {vocab_size} ids, got "
      f"{rules.table.next_state.shape[1]}."
    )
  return rules


def allowed(table: ConstraintTable, states: jax.Array) -> jax.Array:
  """`[..., V]` bool: the tokens allowed in `states [...]`. A dead state (-1,
  after a token that was not allowed) allows every token: positions after it are
  never reached, and their laws must stay finite."""
  rows = jnp.take(table.next_state, jnp.maximum(states, 0), axis=0)
  return (rows >= 0) | (states < 0)[..., None]


def advance(table: ConstraintTable, states: jax.Array, tokens: jax.Array) -> jax.Array:
  """`[...]` int32: the state after `tokens [...]` in `states [...]`; -1 (dead)
  for a token not allowed there or an id outside the table."""
  v = table.next_state.shape[1]
  inside = (tokens >= 0) & (tokens < v) & (states >= 0)
  nxt = table.next_state[jnp.maximum(states, 0), jnp.clip(tokens, 0, v - 1)]
  return jnp.where(inside, nxt, -1)


def mask_logits(logits: jax.Array, table: ConstraintTable, states: jax.Array) -> jax.Array:
  """`logits [..., V']` with the tokens not allowed in `states [...]` at -inf (ids
  past the table's V are never allowed)."""
  mask = allowed(table, states)
  v, width = mask.shape[-1], logits.shape[-1]
  if width > v:
    mask = jnp.concatenate([mask, jnp.zeros(mask.shape[:-1] + (width - v,), bool)], -1)
  return jnp.where(mask[..., :width], logits, -jnp.inf)


def memory_report(automaton: Automaton) -> dict[str, int]:
  """Bytes of the dense table against a sparse layout (a bitmask of allowed ids
  per state plus the allowed (id, next state) pairs) for one automaton."""
  s, v = automaton.next_state.shape
  nnz = int(np.sum(automaton.next_state >= 0))
  return {
    "states": s,
    "vocab_size": v,
    "transitions": nnz,
    "dense_bytes": s * v * 4,
    "sparse_bytes": s * ((v + 31) // 32) * 4 + nnz * 8 + (s + 1) * 4,
  }
