"""Static token trees: topologies, and the attention mask of a tree block.

A tree of N drafted nodes is a static tuple `parents` of N ints: node i continues
node `parents[i]`, or the root (-1, the last committed token); a parent comes
before its children. Being static, one compiled program serves every iteration;
rows differ only in their tokens (a node a drafter cannot fill, e.g. a second
top-k child where q has one non-zero entry, gets q = 0 and is never accepted).

Tree drafters also need the nodes in breadth-first order (depth never decreases),
so that each depth is one contiguous slice: one model call per depth.

Builders:
  chain(g)                  g nodes in a line: what chain drafting proposes
  from_paths(paths)         Medusa-style sparse trees from child-rank paths
  full(branching)           every node of depth d has branching[d] children
  best(rank_acceptance, n)  the n nodes of highest estimated acceptance (Sequoia/
                            Medusa-style static trees from per-rank acceptance rates)

Per-row trees (`RowTrees`: parents `[B, N]` and a static depth bound) are what
EAGLE-2's dynamic drafting (`DynamicTree`) proposes; tree attention and
`verify.tree_verify` take them wherever they take a static tuple.

In a cached forward a tree block is written at consecutive cache slots
(`tree_attention`): node j attends to the row's cached prefix, its ancestors and
itself, at position prefix + depth - 1, so every root-to-node path is scored as
if it were a plain sequence.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class RowTrees(NamedTuple):
  """Token trees that differ per row (dynamic drafting, e.g. EAGLE-2), in static shapes.

  Attributes:
    parents: `[B, N]` int32, node i's parent in row b (-1: the root), with
      -1 <= parents[b, i] < i. A node that breaks this is never accepted.
    depth: static int >= 1, no node is deeper (the path's length).
  """

  parents: jax.Array
  depth: int


@dataclasses.dataclass(frozen=True)
class DynamicTree:
  """EAGLE-2's dynamic tree, in static shapes (Li et al. 2024, arXiv 2406.16858).

  Each depth expands the `expand` most valuable nodes of the one before with
  `branch` children each; after `depth` levels the `size` most valuable nodes
  form the row's tree (`RowTrees`). A node's value is its parent's plus the log
  of the parent's `rank`-th largest draft probability (rank: its place among
  its siblings), the cumulative draft log-probability at temperature 0. It never
  depends on the node's own drawn token, which keeps sampled verification exact.
  """

  size: int
  depth: int
  branch: int = 4
  expand: int = 4

  def __post_init__(self):
    for name in ("size", "depth", "branch", "expand"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"DynamicTree.{name} must be an int >= 1, got {value!r}.")
    most = self.branch + (self.depth - 1) * self.expand * self.branch
    if not 2 <= self.depth <= self.size or self.size > most:
      raise ValueError(
        f"DynamicTree: depth must be in [2, size] and size <= branch + (depth - 1) * "
        f"expand * branch = {most}, got depth {self.depth}, size {self.size}."
      )


def row_depths(tree: RowTrees) -> jax.Array:
  """`[B, N]` int32 depth of every node (a child of the root has depth 1; a node
  whose parent is not before it gets depth + 1, deeper than any path)."""
  b, n = tree.parents.shape
  depths = []
  for c in range(n):
    parent = tree.parents[:, c]
    ok = (parent >= -1) & (parent < c)
    if c:
      above = jnp.take_along_axis(jnp.stack(depths, 1), jnp.clip(parent, 0, c - 1)[:, None], 1)
      d = jnp.where(parent < 0, 1, above[:, 0] + 1)
    else:
      d = jnp.ones((b,), jnp.int32)
    depths.append(jnp.where(ok, jnp.minimum(d, tree.depth + 1), tree.depth + 1))
  return jnp.stack(depths, axis=1).astype(jnp.int32)


def row_ancestors(tree: RowTrees) -> jax.Array:
  """`[B, N, N]` bool: entry (b, j, i) says node i is node j or its ancestor in row b."""
  b, n = tree.parents.shape
  rows = []
  for c in range(n):
    own = jnp.zeros((b, n), bool).at[:, c].set(True)
    parent = tree.parents[:, c]
    if c:
      above = jnp.take_along_axis(jnp.stack(rows, 1), jnp.clip(parent, 0, c - 1)[:, None, None], 1)[
        :, 0
      ]
      own |= above & ((parent >= 0) & (parent < c))[:, None]
    rows.append(own)
  return jnp.stack(rows, axis=1)


def check_parents(parents, name: str = "parents") -> tuple[int, ...]:
  """Checks a static tree and returns it as a tuple of ints.

  Raises:
    ValueError naming `name` unless it is a tuple of ints with
    -1 <= parents[i] < i (-1: a child of the root; a parent precedes its children).
  """
  if not isinstance(parents, tuple) or not all(
    isinstance(u, (int, np.integer)) and not isinstance(u, bool) for u in parents
  ):
    raise ValueError(
      f"{name} must be a static tuple of ints (one parent index per node, -1 for "
      f"the root), got {parents!r}."
    )
  for i, u in enumerate(parents):
    if not -1 <= u < i:
      raise ValueError(
        f"{name}[{i}] must be in [-1, {i - 1}] (-1: the root; a parent comes before "
        f"its children), got {u}."
      )
  return tuple(int(u) for u in parents)


def check_drafting_tree(parents, name: str = "tree") -> tuple[int, ...]:
  """`check_parents`, plus what tree drafters need: at least one node, breadth-first
  order (depths never decrease), so each depth is one contiguous slice."""
  parents = check_parents(parents, name)
  depths = tree_depths(parents)
  if not parents or any(a > b for a, b in itertools.pairwise(depths)):
    raise ValueError(
      f"{name} must be a non-empty tree in breadth-first order (node depths "
      f"non-decreasing), got parents {parents} with depths {depths}."
    )
  return parents


def tree_depths(parents: tuple[int, ...]) -> tuple[int, ...]:
  """Depth of each node (a child of the root has depth 1)."""
  depths = []
  for u in parents:
    depths.append(1 if u < 0 else depths[u] + 1)
  return tuple(depths)


def levels(parents: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
  """`(start, stop)` node slices of depths 1, 2, ... of a breadth-first tree."""
  depths = tree_depths(parents)
  return tuple(
    (depths.index(d), len(depths) - depths[::-1].index(d)) for d in range(1, max(depths) + 1)
  )


def sibling_ranks(parents: tuple[int, ...]) -> tuple[int, ...]:
  """Node i is the `rank`-th child of its parent (0 = first), in index order."""
  seen: dict[int, int] = {}
  ranks = []
  for u in parents:
    ranks.append(seen.get(u, 0))
    seen[u] = ranks[-1] + 1
  return tuple(ranks)


def num_children(parents: tuple[int, ...]) -> tuple[int, ...]:
  """`[N + 1]` children of the root (entry 0), then of each node."""
  counts = [0] * (len(parents) + 1)
  for u in parents:
    counts[u + 1] += 1
  return tuple(counts)


def chain(length: int) -> tuple[int, ...]:
  """A chain of `length` nodes: chain drafting as a tree."""
  return tuple(range(-1, length - 1))


def from_paths(paths: Sequence[Sequence[int]]) -> tuple[int, ...]:
  """A tree from child-rank paths (Medusa's "choices"): `(0,)` is the root's first
  child, `(0, 1)` that node's second child. Every prefix of a path must be there,
  and a node's children ranks must be 0, 1, ... without gaps (child k is the k-th
  draw from its parent's law). Nodes come out in breadth-first order.
  """
  unique = sorted({tuple(int(r) for r in p) for p in paths}, key=lambda p: (len(p), p))
  index = {(): -1}
  parents = []
  for path in unique:
    if not path or any(r < 0 for r in path):
      raise ValueError(f"paths must be non-empty tuples of ranks >= 0, got {path!r}.")
    if path[:-1] not in index:
      raise ValueError(f"paths: {path!r} is there but its parent {path[:-1]!r} is not.")
    if path[-1] and path[:-1] + (path[-1] - 1,) not in index:
      raise ValueError(
        f"paths: {path!r} is there but its elder sibling {path[:-1] + (path[-1] - 1,)!r} "
        "is not (children ranks must be 0, 1, ... without gaps)."
      )
    index[path] = len(parents)
    parents.append(index[path[:-1]])
  return check_drafting_tree(tuple(parents))


def full(branching: Sequence[int]) -> tuple[int, ...]:
  """Every node at depth d (the root at 0) has `branching[d]` children."""
  if not branching or any(int(k) < 1 for k in branching):
    raise ValueError(f"branching must be a non-empty sequence of ints >= 1, got {branching!r}.")
  paths = itertools.chain.from_iterable(
    itertools.product(*(range(int(k)) for k in branching[:d])) for d in range(1, len(branching) + 1)
  )
  return from_paths(list(paths))


def best(rank_acceptance: Sequence[float], size: int, max_depth: int = 16) -> tuple[int, ...]:
  """The static tree of `size` nodes that maximises expected accepted length.

  With `rank_acceptance[k]` the chance that a node's k-th child (k-th draft
  candidate) is the one the target keeps, a node reached by ranks r_1..r_d is on
  the accepted path with probability prod a[r_i] (treating depths as
  independent), and the expected number of accepted tokens is the sum over the
  tree's nodes. The best tree of a size takes the nodes of highest such product:
  prefix-closed and gap-free when the rates do not increase with k (ties break
  toward shallow, low ranks). Greedy tree verification follows exactly this
  model; sampled verification approximately.

  Args:
    rank_acceptance: rates by child rank, in (0, 1], non-increasing.
    size: nodes, >= 1.
    max_depth: the deepest level allowed (Medusa: its number of heads).
  """
  rates = [float(a) for a in rank_acceptance]
  if not rates or any(not 0 < a <= 1 for a in rates) or rates != sorted(rates, reverse=True):
    raise ValueError(
      f"rank_acceptance must be non-increasing rates in (0, 1], got {rank_acceptance!r}."
    )
  if int(size) < 1 or int(max_depth) < 1:
    raise ValueError(f"size and max_depth must be >= 1, got {size!r} and {max_depth!r}.")
  chosen: list[tuple[int, ...]] = []
  frontier = {(k,): rates[k] for k in range(len(rates))}
  while len(chosen) < size and frontier:
    path = min(frontier, key=lambda p: (-frontier[p], len(p), p))
    score = frontier.pop(path)
    chosen.append(path)
    if len(path) < max_depth:
      frontier.update({(*path, k): score * rates[k] for k in range(len(rates))})
  return from_paths(chosen)


def ancestor_matrix(parents: tuple[int, ...]) -> np.ndarray:
  """`[N, N]` bool: entry (j, i) says node i is node j or one of its ancestors."""
  n = len(parents)
  visible = np.eye(n, dtype=bool)
  for j, u in enumerate(parents):
    if u >= 0:
      visible[j] |= visible[u]
  return visible


def tree_attention(
  lengths: jax.Array,
  capacity: int,
  parents: tuple[int, ...],
  start: int,
  stop: int,
  sliding_window: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Where nodes `start..stop-1` of a tree block go, and what they may read.

  The block's N nodes occupy cache slots `lengths[b] + i` (node i); a call may
  write one slice of them (tree drafters go one depth per call). Node j reads the
  row's prefix (slots < lengths[b]) and the slots of its ancestors and itself.

  Args:
    lengths: `[B]` int32, each row's cached prefix (not advanced by tree calls).
    capacity: cache slots per row (static).
    parents: the block's static tree (-1: continues the prefix), or `RowTrees`
      (a tree per row).
    start, stop: the nodes this call writes (static).
    sliding_window: the model's window, if any; applied to positions.

  Returns:
    `(starts [B], positions [B, T], mask [B, T, capacity])` with T = stop - start:
    where the call writes, the positions lengths + depth - 1, and the mask.
  """
  slots = jnp.arange(capacity, dtype=jnp.int32)
  offset = slots[None, :] - lengths[:, None]  # [B, S]: node index of each slot
  if isinstance(parents, RowTrees):
    n = parents.parents.shape[1]
    node = jnp.clip(offset, 0, n - 1)
    visible = row_ancestors(parents)[:, start:stop]  # [B, T, N]
    ancestors = jnp.take_along_axis(
      visible, jnp.broadcast_to(node[:, None], visible.shape[:2] + node.shape[1:]), 2
    )
    depths = row_depths(parents)  # [B, N]
    node_depths = jnp.take_along_axis(depths, node, 1)
    positions = lengths[:, None] + depths[:, start:stop] - 1
  else:
    n = len(parents)
    node = jnp.clip(offset, 0, n - 1)
    visible = ancestor_matrix(parents)[start:stop]  # [T, N]
    ancestors = jnp.asarray(visible)[:, node].swapaxes(0, 1)  # [B, T, S]
    depths = np.asarray(tree_depths(parents), np.int32)
    node_depths = jnp.asarray(depths)[node]
    positions = lengths[:, None] + jnp.asarray(depths[start:stop] - 1)[None, :]
  in_block = (offset >= 0) & (offset < n)
  mask = (offset < 0)[:, None, :] | (in_block[:, None, :] & ancestors)
  if sliding_window is not None:
    node_positions = lengths[:, None] + node_depths - 1
    key_positions = jnp.where(offset < 0, slots[None, :], node_positions)
    mask &= key_positions[:, None, :] > positions[:, :, None] - sliding_window
  return lengths + start, positions, mask
