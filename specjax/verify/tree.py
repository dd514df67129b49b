"""Exact verification of a token tree (SpecInfer, Miao et al. 2024, arXiv 2305.09781;
Jeon et al. 2024, "Recursive speculative decoding", arXiv 2402.14160).

Node i holds `tree_tokens[:, i]` and continues node `parents[i]` (-1: the root).
The walk tries a node's children in index order: child c, holding x drawn from
q_c, is accepted with probability min(1, p(x) / q_c(x)) and the walk descends
with the target's law after c; a rejection sets p <- normalize(max(0, p - q_c)).
With no child accepted the walk emits y ~ p. q_c depends on `mode`:

  iid                  q_c = q, the parent's law (SpecInfer)
  without_replacement  q without the earlier siblings' tokens, renormalised
                       (sampled top-k; Jeon et al.'s recursive rejection sampling)
  greedy               temperature 0: descend into the first child equal to the
                       target's argmax

A node that cannot have come from q_c (id outside [0, V), non-finite q row,
q_c(x) = 0) is rejected with the usual residual update; a zero-mass residual
falls back to p. The proof of exactness and these conventions: docs/trees.md.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax.sampling import sample_with_uniform
from specjax.trees import Tree, as_tree
from specjax.verify.base import _shape, check_key

MODES = ("iid", "without_replacement", "greedy")


class TreeVerifyResult(NamedTuple):
  """What one tree verification decides for each row.

  Attributes:
    path: `[B, D]` int32, the accepted nodes from the top, then -1 (D static).
    num_accepted: `[B]` int32 in [0, D].
    next_token: `[B]` int32, the correction or the bonus token after the path.
  """

  path: jax.Array
  num_accepted: jax.Array
  next_token: jax.Array


def _check_inputs(tree_tokens, parents, draft_probs, target_probs, mode):
  """Checks mode, tree and shapes at trace time; returns (tree, B, N, V)."""
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
  tokens_shape = _shape("tree_tokens", tree_tokens)
  if len(tokens_shape) != 2 or not np.issubdtype(tree_tokens.dtype, np.integer):
    raise ValueError(
      f"tree_tokens must be an integer array [B, N], got {tree_tokens.dtype}{list(tokens_shape)}."
    )
  b, n = tokens_shape
  tree = as_tree(parents)
  shape = _shape("parents.parents", tree.parents)
  if (
    len(shape) != 2
    or shape[0] not in (1, b)
    or shape[1] != n
    or not np.issubdtype(tree.parents.dtype, np.integer)
  ):
    raise ValueError(
      f"parents must have one entry per node, N = {n} (tree_tokens {list(tokens_shape)}): "
      f"a static tuple of N ints or a Tree of parents [1 or B={b}, N={n}], got "
      f"{tree.parents.dtype}{list(shape)}."
    )
  depth = tree.depth
  if isinstance(depth, bool) or not isinstance(depth, int) or not min(1, n) <= depth <= n:
    # A path never has more nodes than the tree; the commit writes depth + 1 slots.
    raise ValueError(f"parents.depth must be a static int in [1, N={n}], got {depth!r}.")
  target_shape = _shape("target_probs", target_probs)
  if len(target_shape) != 3 or not jnp.issubdtype(target_probs.dtype, jnp.floating):
    raise ValueError(
      f"target_probs must be a float array [B, N + 1, V], got {target_probs.dtype}"
      f"{list(target_shape)}."
    )
  if target_shape[:2] != (b, n + 1) or target_shape[2] < 1:
    raise ValueError(
      f"target_probs must have shape [B={b}, N + 1={n + 1}, V >= 1] (the root's row, "
      f"then one per node), got {list(target_shape)}."
    )
  v = target_shape[2]
  if draft_probs is None:
    if mode != "greedy":
      raise ValueError(f"draft_probs must be a float array [B, N, V] in mode {mode!r}, got None.")
    return tree, b, n, v
  probs_shape = _shape("draft_probs", draft_probs)
  if len(probs_shape) != 3 or not jnp.issubdtype(draft_probs.dtype, jnp.floating):
    raise ValueError(
      f"draft_probs must be a float array [B, N, V], got {draft_probs.dtype}{list(probs_shape)}."
    )
  if probs_shape != (b, n, v):
    raise ValueError(
      f"draft_probs must have shape [B={b}, N={n}, V={v}] to match tree_tokens and "
      f"target_probs, got {list(probs_shape)}."
    )
  return tree, b, n, v


def _normalized(residual: jax.Array, fallback: jax.Array) -> jax.Array:
  """`residual [B, V]` / its mass, or `fallback` where the mass is zero."""
  mass = jnp.sum(residual, axis=-1, keepdims=True)
  return jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), fallback)


def _without(q: jax.Array, taken: jax.Array) -> jax.Array:
  """`q [B, V]` with the ids `taken [B, k]` removed, renormalised; all zero if no mass is left."""
  b, v = q.shape
  # Ids outside [0, V) were never drawn from q: point them past the end and drop them.
  taken = jnp.where((taken >= 0) & (taken < v), taken, v)
  rest = q.at[jnp.arange(b)[:, None], taken].set(0.0, mode="drop")
  return _normalized(rest, jnp.zeros_like(rest))


def _gather(rows: jax.Array, index: jax.Array) -> jax.Array:
  """`rows [B, V]`, `index [B]` -> `[B]`."""
  return jnp.take_along_axis(rows, index[:, None], axis=-1)[:, 0]


def _node_laws(
  tree_tokens: jax.Array, draft_probs: jax.Array | None, v: int
) -> tuple[jax.Array, jax.Array | None, jax.Array]:
  """`(tokens [B, N] safe to gather with, q [B, N, V] float32 or None, valid [B, N])`:
  a node is invalid when its id is outside [0, V) or its row of q is not a law."""
  in_vocab = (tree_tokens >= 0) & (tree_tokens < v)
  tokens = jnp.where(in_vocab, tree_tokens, 0).astype(jnp.int32)
  if draft_probs is None:
    return tokens, None, in_vocab
  q = draft_probs.astype(jnp.float32)
  finite = jnp.isfinite(q)
  # A row of q with any non-finite entry is not a law: its node is rejected.
  return tokens, jnp.where(finite, q, 0.0), in_vocab & jnp.all(finite, axis=-1)


def _sibling_law(q: jax.Array | None, tree: Tree, tree_tokens: jax.Array, c: int, mode: str):
  """`[B, V]` q_c, the law node c was drawn from given its earlier siblings (None: no q)."""
  if q is None or mode != "without_replacement":
    return None if q is None else q[:, c]
  columns, same = tree.earlier_siblings(c)
  if not columns:
    return q[:, c]
  # The earlier siblings in each row (-1 elsewhere, which _without drops).
  return _without(q[:, c], jnp.where(same, tree_tokens[:, columns], -1))


class _Walk(NamedTuple):
  """Where each row's walk down the tree stands.

  current: `[B]` the deepest accepted node (-1: the root); path: D `[B]` columns,
  the accepted node at each depth (-1: none); law: `[B, V]` the law of the token
  after `current` (None in greedy mode); residual: `[B]` whether law is a residual.
  """

  current: jax.Array
  path: tuple[jax.Array, ...]
  law: jax.Array | None
  residual: jax.Array | None


def _try_sampled(walk: _Walk, tried, valid, x, q_x, q_c, u_c, p_next):
  """Node c's ratio test for the rows at its parent: `(accept [B], law [B, V],
  residual [B])`, the law moved to its residual on rejection."""

  accept = tried & valid & (u_c * q_x < _gather(walk.law, x))  # u < p/q without dividing
  reject = tried & ~accept
  residual = _normalized(jnp.maximum(walk.law - q_c, 0.0), walk.law)
  law = jnp.where(accept[:, None], p_next, jnp.where(reject[:, None], residual, walk.law))
  return accept, law, (walk.residual | reject) & ~accept


def tree_verify(
  key: jax.Array | None,
  tree_tokens: jax.Array,
  parents: Tree | tuple[int, ...],
  draft_probs: jax.Array | None,
  target_probs: jax.Array,
  mode: str = "iid",
) -> TreeVerifyResult:
  """Exact verification of a drafted token tree, vectorised over rows. A chain
  (`parents = (-1, 0, ..., g - 2)`) gives `token_verify`'s draws exactly.

  Args:
    key: PRNG key (ignored, may be None, in mode "greedy").
    tree_tokens: `[B, N]` int32, the token of each node.
    parents: a `specjax.trees.Tree` (static or per row) or a static tuple of N
      parents (-1: the root; parents[i] < i).
    draft_probs: `[B, N, V]`, the law node i was drawn from (its parent's q).
      None allowed in mode "greedy"; if given, q(x) = 0 is never accepted.
    target_probs: `[B, N + 1, V]`, row 0 after the root, row i + 1 after node i
      (in mode "greedy" logits work too).
    mode: "iid", "without_replacement" or "greedy" (static).

  Returns:
    `TreeVerifyResult(path [B, D], num_accepted [B], next_token [B])`.

  Raises:
    ValueError naming the argument (mode, parents, tree_tokens, draft_probs,
    target_probs, key) when it is out of range or shapes disagree.
  """
  tree, b, n, v = _check_inputs(tree_tokens, parents, draft_probs, target_probs, mode)
  tokens, q, valid_node = _node_laws(tree_tokens, draft_probs, v)
  greedy = mode == "greedy"
  if greedy:
    best = jnp.argmax(target_probs, axis=-1).astype(jnp.int32)  # [B, N + 1]
  else:
    check_key(key)
    p = target_probs.astype(jnp.float32)
    # One random-bit computation: a uniform per node's test, then the emitted token's.
    u = jax.random.uniform(key, (b, n + 1), jnp.float32)
  walk = _Walk(
    current=jnp.full((b,), -1, jnp.int32),
    path=(jnp.full((b,), -1, jnp.int32),) * tree.depth,
    law=None if greedy else p[:, 0],
    residual=None if greedy else jnp.zeros((b,), bool),
  )
  depths = tree.depths()  # [1 or B, N]
  for c in range(n):
    parent = tree.parents[:, c]
    # Only rows standing at c's parent try c: an accepted earlier sibling moved on,
    # and every child of the current node comes after it in index order.
    tried = walk.current == parent
    x = tokens[:, c]
    q_c = _sibling_law(q, tree, tree_tokens, c, mode)
    q_x = None if q_c is None else _gather(q_c, x)
    valid = valid_node[:, c] if q_x is None else valid_node[:, c] & (q_x > 0)
    valid &= depths[:, c] <= tree.depth  # a per-row node too deep is never accepted
    if greedy:  # x must be the target's argmax after the parent
      accept = tried & valid & (x == _gather(best, parent + 1))
      law, residual = None, None
    else:
      accept, law, residual = _try_sampled(walk, tried, valid, x, q_x, q_c, u[:, c], p[:, c + 1])
    # One column per depth: a static tree's constant depths leave one select per node.
    at_depth = [depths[:, c] == d + 1 for d in range(tree.depth)]
    walk = _Walk(
      current=jnp.where(accept, c, walk.current),
      path=tuple(jnp.where(accept & at, c, col) for at, col in zip(at_depth, walk.path)),
      law=law,
      residual=residual,
    )
  path = jnp.stack(walk.path, axis=1) if tree.depth else jnp.zeros((b, 0), jnp.int32)
  num_accepted = jnp.sum(path >= 0, axis=1).astype(jnp.int32)
  if greedy:  # the target's argmax after the deepest accepted node
    next_token = jnp.take_along_axis(best, (walk.current + 1)[:, None], axis=1)[:, 0]
  else:
    next_token = _last_draw(walk, u[:, n])
  return TreeVerifyResult(path, num_accepted, next_token)


def _last_draw(walk: _Walk, u: jax.Array) -> jax.Array:
  """`[B]` the token after the walk, drawn from its law with uniforms `u [B]`
  (normalised as token_verify's bonus row, so a chain draws the same token)."""

  law = walk.law
  dist = jnp.where(walk.residual[:, None], law, _normalized(jnp.maximum(law, 0.0), law))
  return sample_with_uniform(u, dist)
