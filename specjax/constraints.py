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
  forced_chain                the tokens a row's state forces next (speculative
                              decoding drafts them without the drafter)

EOS ids are allowed only in accepting states (and keep the row there).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax import grammar

# What a request asks for, and its regex: host-only code, shared with the server's
# compile worker (specjax.grammar imports no JAX).
from specjax.grammar import Choice, Constraint, JsonSchema, Regex, to_regex  # noqa: F401

FREE = 0  # the state of an unconstrained row: every token allowed, stays FREE

# `layout="auto"` keeps a table dense up to this size: there a dense row is one
# gather and the memory is small next to any model's weights; past it (a realistic
# JSON schema over a 128k vocabulary is hundreds of MB dense) the class layout,
# at the cost of one more V-wide gather per masked position.
DENSE_LIMIT_BYTES = 64 << 20


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
    token_class, class_next = grammar.token_classes(transitions, vocab_size)
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


def compile_constraint(
  constraint: Regex | JsonSchema | Choice,
  token_bytes: Sequence[bytes | None],
  eos_ids: Sequence[int],
  vocab_size: int | None = None,
) -> Automaton:
  """Compiles `constraint` over a vocabulary (`specjax.vocab_map.token_bytes(tok)`:
  each id's bytes, None for specials) into an `Automaton` of `vocab_size` ids
  (default: the tokenizer's; a model's may be larger: those ids are never allowed).
  In process (`specjax.grammar`'s arrays); a server compiles in a worker process
  it can stop (`specjax.serving.compiler`).

  Raises:
    ValueError naming the field: a malformed constraint, no EOS id, or a
    language no token sequence can spell.
  """
  outlines_core, _ = grammar._outlines()
  eos_ids = [int(i) for i in eos_ids]
  if not eos_ids:
    raise ValueError("eos_ids must name at least one id (a constrained text ends with EOS).")
  v = len(token_bytes) if vocab_size is None else int(vocab_size)
  regex = to_regex(constraint)
  vocabulary = outlines_core.Vocabulary(
    eos_ids[0], grammar.vocabulary_pieces(token_bytes, eos_ids, v)
  )
  class_next, token_class, start, accepting = grammar.compile_arrays(regex, vocabulary, eos_ids, v)
  return Automaton(class_next, token_class, start, accepting)


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
    forced: `[S]` int32, the one token a state allows, -1 where it allows none
      or several (built with the table, so that finding a forced token is one
      gather per step, never an `[S, V]` pass); None: not built (then
      `forced_chain` derives it from `next_state`).
  """

  next_state: jax.Array
  token_class: jax.Array | None = None
  forced: jax.Array | None = None

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
    parts = (self.next_state, self.token_class, self.forced)
    return sum(int(x.size) * 4 for x in parts if x is not None)


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


def forced_tokens(next_state: np.ndarray, token_class: np.ndarray | None) -> np.ndarray:
  """`[S]` int32 (host): the one token each state of a table (`next_state [S, C]`,
  `token_class [V]` or None for dense) allows, -1 where it allows none or several:
  a state forces a token when one column is allowed and that column is one id."""
  ok = next_state >= 0
  one = ok.sum(axis=1) == 1
  column = ok.argmax(axis=1)
  if token_class is None:
    return np.where(one, column, -1).astype(np.int32)
  sizes = np.bincount(token_class, minlength=next_state.shape[1])
  # each class's first id (its only one where the class is a single id)
  first = np.full(next_state.shape[1], -1, np.int64)
  ids = np.arange(token_class.shape[0])
  first[token_class[::-1]] = ids[::-1]
  return np.where(one & (sizes[column] == 1), first[column], -1).astype(np.int32)


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
  forced = jnp.asarray(forced_tokens(table, token_class))
  token_class = None if token_class is None else jnp.asarray(token_class)
  return RowConstraints(
    ConstraintTable(jnp.asarray(table), token_class, forced), jnp.asarray(starts, jnp.int32)
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


def forced_chain(
  table: ConstraintTable, states: jax.Array, length: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The tokens the constraint forces from `states [B]` on: a state that allows
  exactly one token forces it, and the state after it may force the next.

  Returns:
    `(tokens [B, length] int32, count [B] int32, after [B])`: row b's first
    `count[b]` tokens are forced (the rest 0), `after` the state they reach.
    An unconstrained (`FREE`) or dead (-1) state forces nothing.
  """
  forced = table.forced
  if forced is None:  # a table built by hand: one [S, C] pass (row_constraints builds it)
    ok = table.next_state >= 0
    one = jnp.sum(ok, axis=1) == 1
    column = jnp.argmax(ok, axis=1)
    if table.token_class is None:
      forced = jnp.where(one, column, -1)
    else:
      sizes = jnp.zeros(ok.shape[1], jnp.int32).at[table.token_class].add(1)
      first = (
        jnp.full(ok.shape[1], -1, jnp.int32)
        .at[table.token_class[::-1]]
        .set(jnp.arange(table.vocab_size - 1, -1, -1, dtype=jnp.int32))
      )
      forced = jnp.where(one & (sizes[column] == 1), first[column], -1)
  tokens, count = [], jnp.zeros(states.shape, jnp.int32)
  going = jnp.ones(states.shape, bool)
  for _ in range(length):  # static and short (gamma): a chain of gathers
    token = jnp.where(states >= 0, forced[jnp.maximum(states, 0)], -1)
    going = going & (token >= 0)
    tokens.append(jnp.where(going, token, 0))
    count = count + going
    states = jnp.where(going, advance(table, states, token), states)
  return jnp.stack(tokens, axis=1).astype(jnp.int32), count, states


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
  `sparse_bytes` the class layout's device bytes (with the `[S]` forced tokens),
  `classes` its C unpadded."""
  table, token_class, _ = _stack([automaton], automaton.vocab_size, 0, 0, "sparse")
  return {
    "states": automaton.num_states,
    "vocab_size": automaton.vocab_size,
    "classes": automaton.num_classes,
    "transitions": automaton.num_transitions(),
    "dense_bytes": automaton.num_states * automaton.vocab_size * 4,
    "sparse_bytes": (table.size + token_class.size + table.shape[0]) * 4,
  }
