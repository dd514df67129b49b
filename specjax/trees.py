"""Token trees: one type, `Tree`, its builders, and the attention mask of a tree block.

Node i continues node `parents[i]`, or the root (-1, the last committed token); a
parent comes before its children. `Tree` holds the parents as `[1, N]` numpy
constants shared by every row (`Tree.static`) or `[B, N]` data, a tree per row
(`Tree.per_row`, EAGLE-2's `DynamicTree`). Tree drafters need breadth-first order
(one contiguous slice, one model call, per depth). Builders of static tuples:
`chain`, `from_paths` (Medusa), `full`, `best` (Sequoia/Medusa-style). The guide:
docs/trees.md.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_pytree_node_class
class Tree:
  """A token tree of N nodes: each node's parent, and a static bound on the depth.

  Attributes:
    parents: `[1, N]` int32 numpy constants (`Tree.static`) or `[B, N]` int32 data
      (`Tree.per_row`); -1 <= parents[b, i] < i, -1 the root. In a per-row tree a
      node that breaks this, or is deeper than `depth`, is never accepted.
    depth: static int, no node is deeper (0 for no nodes).
  """

  def __init__(self, parents: np.ndarray | jax.Array, depth: int):
    self.parents = parents
    self.depth = depth

  @classmethod
  def static(cls, parents: tuple[int, ...], name: str = "parents") -> Tree:
    """The tree of a static tuple of parents (checked: `check_parents`), shared by every row."""
    parents = check_parents(parents, name)
    shared = np.asarray(parents, np.int32).reshape(1, len(parents))
    return cls(shared, max(tree_depths(parents), default=0))

  @classmethod
  def per_row(cls, parents: jax.Array, depth: int) -> Tree:
    """A tree per row: `parents [B, N]` int32, no node deeper than the static `depth`."""
    return cls(parents, depth)

  @property
  def num_nodes(self) -> int:
    return self.parents.shape[1]

  @property
  def _xp(self):
    """numpy for a static tree (its masks and depths are constants), else jax.numpy."""
    return np if isinstance(self.parents, np.ndarray) else jnp

  def with_root(self) -> Tree:
    """The scored block's tree: the root (s[-1]) as node 0, then these nodes."""
    xp = self._xp
    root = xp.full((self.parents.shape[0], 1), -1, np.int32)
    return Tree(xp.concatenate([root, self.parents + 1], axis=1).astype(np.int32), self.depth + 1)

  def depths(self) -> np.ndarray | jax.Array:
    """`[1 or B, N]` int32 depth of every node (root's children: 1; a node whose
    parent is not before it: depth + 1, deeper than any path)."""
    xp, parents = self._xp, self.parents
    b, n = parents.shape
    depths = []
    for c in range(n):
      parent = parents[:, c]
      ok = (parent >= -1) & (parent < c)
      d = xp.ones((b,), np.int32)
      if c:
        above = xp.take_along_axis(xp.stack(depths, 1), xp.clip(parent, 0, c - 1)[:, None], 1)
        d = xp.where(parent < 0, 1, above[:, 0] + 1)
      depths.append(xp.where(ok, xp.minimum(d, self.depth + 1), self.depth + 1))
    return xp.stack(depths, axis=1).astype(np.int32) if n else xp.zeros((b, 0), np.int32)

  def ancestors(self) -> np.ndarray | jax.Array:
    """`[1 or B, N, N]` bool: entry (b, j, i) says node i is node j or its ancestor."""
    xp, parents = self._xp, self.parents
    b, n = parents.shape
    rows = []
    for c in range(n):
      own = xp.broadcast_to(xp.arange(n) == c, (b, n))
      if c:
        parent = parents[:, c]
        above = xp.take_along_axis(xp.stack(rows, 1), xp.clip(parent, 0, c - 1)[:, None, None], 1)
        own = own | (above[:, 0] & ((parent >= 0) & (parent < c))[:, None])
      rows.append(own)
    return xp.stack(rows, axis=1) if n else xp.zeros((b, 0, 0), bool)

  def earlier_siblings(self, c: int) -> tuple[list[int], np.ndarray | jax.Array]:
    """The nodes before `c` that may share its parent: `(columns, same [1 or B, k])`,
    `same` saying in which rows each does."""
    same = self.parents[:, :c] == self.parents[:, c : c + 1]
    if self._xp is np:
      columns = np.flatnonzero(same[0]).tolist()
      return columns, same[:, columns]
    return list(range(c)), same

  # A pytree: a static tree's parents are part of its structure (hashable, as a
  # static argument or field), a per-row tree's are its one leaf.
  def tree_flatten(self):
    if isinstance(self.parents, np.ndarray):
      return (), (tuple(self.parents[0].tolist()), self.depth)
    return (self.parents,), (None, self.depth)

  @classmethod
  def tree_unflatten(cls, aux, children):
    static, depth = aux
    if static is not None:
      return cls(np.asarray(static, np.int32).reshape(1, len(static)), depth)
    return cls(children[0], depth)

  def _key(self):
    return self.tree_flatten()[1] if isinstance(self.parents, np.ndarray) else id(self)

  def __eq__(self, other) -> bool:
    return isinstance(other, Tree) and self._key() == other._key()

  def __hash__(self) -> int:
    return hash(self._key())

  def __repr__(self) -> str:
    parents = self.parents[0].tolist() if self._xp is np else self.parents
    return f"Tree(parents={parents}, depth={self.depth})"


def as_tree(tree: Tree | tuple[int, ...], name: str = "parents") -> Tree:
  """`tree` itself, or a static tuple of parents as a `Tree` (`Tree.static`)."""
  return tree if isinstance(tree, Tree) else Tree.static(tree, name)


@dataclasses.dataclass(frozen=True)
class DynamicTree:
  """EAGLE-2's dynamic tree, in static shapes (Li et al. 2024, arXiv 2406.16858).

  Each depth expands the `expand` most valuable nodes with `branch` children
  each; the `size` most valuable form the row's tree. A node's value is its
  parent's plus the log of the parent's rank-th largest draft probability, never
  its own drawn token (which keeps sampled verification exact; docs/trees.md).
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


def check_parents(parents, name: str = "parents") -> tuple[int, ...]:
  """A static tree checked as a tuple of ints with -1 <= parents[i] < i (else a
  ValueError naming `name`)."""
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
  """`check_parents`, plus at least one node in breadth-first order (tree drafters)."""

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
  """A breadth-first tree from child-rank paths (Medusa's "choices"): `(0, 1)` is
  the root's first child's second child. Paths must be prefix-closed, ranks
  0, 1, ... without gaps."""
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
  """The static tree of `size` nodes that maximises expected accepted length: the
  nodes of highest product of `rank_acceptance` along their path (depths taken
  as independent; ties toward shallow, low ranks).

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


def tree_attention(
  lengths: jax.Array,
  capacity: int,
  tree: Tree,
  start: int,
  stop: int,
  sliding_window: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Where nodes `start..stop-1` (static) of a tree block go, and what they read.

  Node i occupies slot `lengths[b] + i` and reads the prefix (slots <
  `lengths [B]`), its ancestors and itself; `sliding_window` applies to positions.

  Returns:
    `(starts [B], positions [B, T], mask [B, T, capacity])`, T = stop - start,
    positions lengths + depth - 1.
  """

  slots = jnp.arange(capacity, dtype=jnp.int32)
  offset = slots[None, :] - lengths[:, None]  # [B, S]: node index of each slot
  n = tree.num_nodes
  node = jnp.clip(offset, 0, n - 1)
  visible = tree.ancestors()[:, start:stop]  # [1 or B, T, N]
  ancestors = jnp.take_along_axis(visible, node[:, None, :], 2, mode="clip")  # [B, T, S]
  depths = tree.depths()  # [1 or B, N]
  positions = lengths[:, None] + depths[:, start:stop] - 1
  in_block = (offset >= 0) & (offset < n)
  mask = (offset < 0)[:, None, :] | (in_block[:, None, :] & ancestors)
  if sliding_window is not None:
    node_positions = lengths[:, None] + jnp.take_along_axis(depths, node, 1, mode="clip") - 1
    key_positions = jnp.where(offset < 0, slots[None, :], node_positions)
    mask &= key_positions[:, None, :] > positions[:, :, None] - sliding_window
  return lengths + start, positions, mask
