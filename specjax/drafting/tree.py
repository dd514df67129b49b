"""Drafting token trees: a static topology filled level by level.

`draft_tree` (shared by every tree drafter) fills a static breadth-first tree one
depth per step: each node's children are drawn from its q, then the model reads
that depth to give theirs. Siblings are drawn (and so verified, `tree_verify`):

  without_replacement  the first k of a Gumbel-top-k draw (distinct; a child
                       past q's support is dead, q = 0)
  iid                  k independent draws from q (SpecInfer)
  temperature 0        the top-k of the logits, whatever the mode

`TreeDrafter` makes one model call per depth into its own cache; the commit
moves the accepted path next to the prefix (`KVCache.gather_path`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct

from specjax import coupling, trees
from specjax.coupling import Coupling
from specjax.drafting.base import Commit, DraftConstraint, Proposal
from specjax.drafting.model import CachedDrafting
from specjax.models.kv_cache import KVCache, check_capacity
from specjax.models.transformer import Transformer
from specjax.sampling import SamplingParams, sample_with_uniform, warp_probs
from specjax.validation import is_int
from specjax.vocab import fit_ids

TREE_MODES = ("without_replacement", "iid")


def check_tree_mode(mode) -> str:
  """ValueError naming `tree_mode` unless it is one of `TREE_MODES`."""
  if mode not in TREE_MODES:
    raise ValueError(f"tree_mode must be one of {TREE_MODES}, got {mode!r}.")
  return mode


def check_tree_depth(tree: tuple[int, ...], most: int, per_depth: str) -> None:
  """ValueError unless `tree` is at most `most` deep: drafters whose one call gives
  a fixed number of per-depth laws (`per_depth`: what each depth reads)."""
  depth = len(trees.levels(tree))
  if depth > most:
    raise ValueError(f"tree must have depth <= {most} ({per_depth} per depth), got {depth}.")


def check_tree_gamma(tree: tuple[int, ...], gamma: int) -> None:
  """A tree drafter proposes exactly its N nodes: gamma must be N."""
  if gamma != len(tree):
    raise ValueError(
      f"gamma must equal the drafter's number of tree nodes, {len(tree)}, got {gamma} "
      "(a tree's gamma + 1 positions are scored in one target call)."
    )


def children(
  key: jax.Array | Coupling,
  logits: jax.Array,
  count: int,
  sampling: SamplingParams,
  mode: str,
) -> tuple[jax.Array, jax.Array | None]:
  """`count` children of each row's node from its next-token `logits [B, V]`:
  `(tokens [B, count] int32, q [B, V])`, q the warped law drawn from (None at
  temperature 0: the top-k). With a `Coupling` (its noise at index 0 is the
  children's position; `[B', ...]` with B a multiple of B', each row's nodes in
  a run), its rows take the top `count` of log q + noise: the first child is
  the coupled draw, the others Gumbel-max list samples (Rowan et al. 2025)."""
  if sampling.greedy:
    return jax.lax.top_k(logits, count)[1].astype(jnp.int32), None
  q = warp_probs(logits, sampling)
  if isinstance(key, Coupling):
    per_node = q.shape[0] // key.gumbel.shape[0]  # nodes per row
    gumbel = jnp.repeat(key.gumbel[:, 0], per_node, axis=0)
    coupled = jax.lax.top_k(coupling.scores(q, gumbel), count)[1].astype(jnp.int32)
    if key.rows is None:
      return coupled, q
    plain, _ = children(key.key, logits, count, sampling, mode)
    return jnp.where(jnp.repeat(key.rows, per_node)[:, None], coupled, plain), q
  if mode == "iid":
    uniforms = jax.random.uniform(key, (count, q.shape[0]), jnp.float32)
    return jnp.stack([sample_with_uniform(u, q) for u in uniforms], axis=1), q
  # Gumbel-top-k: the order statistics of log q + Gumbel noise are sequential
  # draws without replacement. Ids with q = 0 come last (-inf), as dead children.
  noise = jax.random.gumbel(key, q.shape, jnp.float32)
  scores = jnp.where(q > 0, jnp.log(jnp.where(q > 0, q, 1.0)) + noise, -jnp.inf)
  return jax.lax.top_k(scores, count)[1].astype(jnp.int32), q


def _fold(key: jax.Array | Coupling, salt: int, depth: int) -> jax.Array | Coupling:
  """A parent's key: `fold_in(key, salt)`; a coupling moves to the children's depth."""
  if isinstance(key, Coupling):
    return key.shift(depth, jax.random.fold_in(key.key, salt))
  return jax.random.fold_in(key, salt)


def depth_keys(key: jax.Array | Coupling, depth: int) -> list:
  """One key per depth of a tree drafted depth by depth (a coupling shifted to it)."""
  if isinstance(key, Coupling):
    return [key.shift(d, k) for d, k in enumerate(jax.random.split(key.key, depth))]
  return list(jax.random.split(key, depth))


def draft_tree(
  parents: tuple[int, ...],
  mode: str,
  sampling: SamplingParams,
  key: jax.Array,
  root_logits: jax.Array,
  read: Callable[[int, int, jax.Array], jax.Array],
  constraint: DraftConstraint | None = None,
) -> tuple[jax.Array, jax.Array | None]:
  """Fills a static breadth-first tree, depth by depth.

  Args:
    parents: the tree (`specjax.trees.check_drafting_tree`).
    mode: "without_replacement" or "iid" (how siblings are drawn).
    sampling: the warp; temperature 0 takes each node's top-k.
    key: all randomness comes from it (one fold per parent), or a `Coupling`
      (the children at depth d take its noise at index d).
    root_logits: `[B, V]`, the drafter's logits after s[-1].
    read: `read(start, stop, tokens [B, T])` -> `[B, T, V]`, the logits after
      nodes start..stop-1 (one depth), called in order for all depths but the last.
    constraint: None, or the rows' constraint after s[-1]: each node's children
      are drawn among what the state its own path reaches allows.


  Returns:
    `(tokens [B, N] int32, probs [B, N, V] or None)`: row i of probs is the law
    node i was drawn from, its parent's q.
  """
  n = len(parents)
  counts = trees.num_children(parents)
  laws: dict[int, jax.Array] = {-1: root_logits}  # node -> logits after it
  tokens: list[jax.Array | None] = [None] * n
  probs: list[jax.Array | None] = [None] * n
  rules = {-1: constraint}  # node -> the constraint at the state its path reaches
  spans = trees.levels(parents)
  for depth, (start, stop) in enumerate(spans):
    for u in sorted({parents[c] for c in range(start, stop)}):
      kids = [c for c in range(start, stop) if parents[c] == u]
      logits = laws[u] if rules[u] is None else rules[u].logits(laws[u])
      drawn, q = children(_fold(key, u + 1, depth), logits, counts[u + 1], sampling, mode)
      for rank, c in enumerate(kids):
        tokens[c], probs[c] = drawn[:, rank], q
        rules[c] = None if rules[u] is None else rules[u].after(drawn[:, rank])
    if depth + 1 < len(spans):
      level = jnp.stack(tokens[start:stop], axis=1)
      logits = read(start, stop, level)
      laws.update({c: logits[:, c - start] for c in range(start, stop)})
  return jnp.stack(tokens, axis=1), None if sampling.greedy else jnp.stack(probs, axis=1)


def draft_depth_tree(
  parents: tuple[int, ...],
  mode: str,
  sampling: SamplingParams,
  key: jax.Array,
  logits: jax.Array,
  constraint: DraftConstraint | None = None,
) -> Proposal:
  """A static tree from one call's per-depth laws (Medusa's heads, the block
  drafter's positions): every node at depth d draws its children from
  `logits[:, d]` (`[B, depth, V]`), whatever the node; `draft_tree`'s siblings.
  Returns the whole tree's `Proposal` (lengths N, one call)."""
  depths = trees.tree_depths(parents)

  def read(start, stop, tokens):  # the nodes of one depth: their children's law
    d = depths[start]
    return jnp.broadcast_to(logits[:, d : d + 1], (*tokens.shape, logits.shape[-1]))

  tokens, probs = draft_tree(parents, mode, sampling, key, logits[:, 0], read, constraint)
  lengths = jnp.full((logits.shape[0],), len(parents), jnp.int32)
  return Proposal(tokens, probs, lengths, jnp.int32(1), trees.Tree.static(parents))


@struct.dataclass
class TreeDrafter(CachedDrafting):
  """Drafts a static token tree with a `Transformer` (optionally its first layers).

  Attributes:
    model: the draft model (or the target itself, with `num_layers`).
    tree: the static parents of the N nodes, breadth-first; gamma must be N.
    tree_mode: "without_replacement" (the default) or "iid".
    num_layers: layers to run; None runs all of them.

  """

  model: Transformer
  tree: tuple[int, ...] = struct.field(pytree_node=False, default=(-1,))
  tree_mode: str = struct.field(pytree_node=False, default="without_replacement")
  num_layers: int | None = struct.field(pytree_node=False, default=None)

  confidence = 0.0  # the adaptive draft length does not apply to trees
  gives_confidence = False  # nor does the verification length

  def __post_init__(self):
    object.__setattr__(self, "tree", trees.check_drafting_tree(self.tree))
    check_tree_mode(self.tree_mode)
    if self.num_layers is not None and (
      not is_int(self.num_layers) or not 1 <= self.num_layers <= self.model.cfg.n_layers
    ):
      raise ValueError(
        f"num_layers must be None or an int in [1, {self.model.cfg.n_layers}], "
        f"got {self.num_layers!r}."
      )

  @property
  def vocab_size(self) -> int:
    return self.model.cfg.vocab_size

  def check_capacity(self, prompt_width: int, max_new_tokens: int, gamma: int) -> None:
    check_tree_gamma(self.tree, gamma)
    check_capacity("draft", self.model.cfg.max_seq_len, prompt_width, max_new_tokens, gamma)

  def with_confidence(self, threshold: float):
    raise ValueError("adaptive='confidence' does not apply to a tree drafter.")

  def _new_state(self, batch: int, capacity: int) -> KVCache:
    return self.model.init_cache(batch, capacity, num_layers=self.num_layers)

  def _with_lengths(self, cache: KVCache, lengths: jax.Array) -> KVCache:
    return cache.with_lengths(lengths)

  def _forward(self, tokens, cache, logit_indices=None, tree=None):
    return self.model.forward_cached(
      fit_ids(tokens, self.vocab_size),
      cache,
      logit_indices=logit_indices,
      num_layers=self.num_layers,
      tree=tree,
    )

  def propose(
    self,
    cache: KVCache,
    recent: jax.Array,
    key: jax.Array,
    limit: jax.Array,
    *,
    gamma: int,
    sampling: SamplingParams,
    constraint: DraftConstraint | None = None,
  ) -> tuple[Proposal, KVCache]:
    """One call on `recent`, then one per depth but the last; node i at slot
    len(s) + i."""

    del limit, gamma  # a tree is drafted whole
    b, tree = recent.shape[0], trees.Tree.static(self.tree)
    logits, cache = self._forward(recent, cache, jnp.ones((b, 1), jnp.int32))
    state = {"cache": cache}

    def read(start, stop, tokens):
      logits, state["cache"] = self._forward(tokens, state["cache"], tree=(tree, start))
      return logits

    tokens, probs = draft_tree(
      self.tree, self.tree_mode, sampling, key, logits[:, 0], read, constraint
    )
    calls = len(trees.levels(self.tree))  # recent, then every depth but the last
    lengths = jnp.full((b,), len(self.tree), jnp.int32)
    return Proposal(tokens, probs, lengths, jnp.int32(calls), tree), state["cache"]

  def commit(self, cache: KVCache, commit: Commit) -> KVCache:
    # The path moves next to s (node i sat at slot len(s) + i); then the chain rule.
    return super().commit(cache.gather_path(commit.path, commit.old_length), commit)
