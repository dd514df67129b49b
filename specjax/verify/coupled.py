"""Coupled verification (Gumbel-max; Daliri, Musco and Suresh 2024, arXiv 2408.07978).

The token at each position is the target's own coupled draw, argmax(log p~ + G)
with the row's noise G at that generated index (`specjax.coupling`). A drafted
token is accepted while it equals that draw; the first disagreement emits the
target's draw; if all agree the bonus is the draw at the last position. Every
emitted token is then a Gumbel-max draw from the target's warped law (exact),
and the same token plain decoding with the same key emits (drafter-invariant).
A tree descends into the first child equal to the draw at its depth: the text
is the same for any tree. q is read only to reject tokens it cannot have drawn.

Rows a `Coupling` does not cover (`rows` False) are verified by the token rule
(or a tree's own mode) with `Coupling.key`, as if it were a plain key.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax import coupling as coupling_lib
from specjax.coupling import Coupling
from specjax.trees import Tree, as_tree
from specjax.verify.base import VerifyResult, check_inputs
from specjax.verify.greedy import greedy_verify
from specjax.verify.token import token_verify
from specjax.verify.tree import TreeVerifyResult, tree_verify


def _check_coupling(coupling, positions: int, batch: int) -> None:
  if not isinstance(coupling, Coupling):
    raise ValueError(
      "key must be a specjax.coupling.Coupling (the rows' noise) for coupled "
      f"verification, got {type(coupling).__name__}; speculative_generate builds "
      "it from per-row keys."
    )
  shape = tuple(coupling.gumbel.shape)
  if len(shape) != 3 or shape[0] != batch or shape[1] < positions:
    raise ValueError(
      f"key.gumbel must have shape [B={batch}, >= {positions}, V] (noise at every "
      f"verified position), got {list(shape)}."
    )


def coupled_verify(
  key: Coupling, draft_tokens: jax.Array, draft_probs: jax.Array, target_probs: jax.Array
) -> VerifyResult:
  """Coupled verification of a drafted chain, vectorised over rows.

  Args:
    key: a `Coupling` with noise `[B, >= g + 1, V']` at the block's positions.
    draft_tokens: `[B, g]` int32.
    draft_probs: `[B, g, V]`; a token with q(x) = 0 (or past the row's
      proposal) is rejected.
    target_probs: `[B, g + 1, V]` the target's warped law.

  Returns:
    `VerifyResult(num_accepted [B], next_token [B])`.
  """
  b, g, _ = check_inputs(draft_tokens, draft_probs, target_probs)
  _check_coupling(key, g + 1, b)
  target_scores = coupling_lib.scores(target_probs.astype(jnp.float32), key.gumbel[:, : g + 1])
  coupled = greedy_verify(None, draft_tokens, draft_probs, target_scores)
  if key.rows is None:
    return coupled
  plain = token_verify(key.key, draft_tokens, draft_probs, target_probs)
  return VerifyResult(*(key.select(c, p) for c, p in zip(coupled, plain)))


def coupled_tree_verify(
  key: Coupling,
  tree_tokens: jax.Array,
  parents: Tree | tuple[int, ...],
  draft_probs: jax.Array | None,
  target_probs: jax.Array,
  mode: str = "iid",
) -> TreeVerifyResult:
  """Coupled verification of a token tree: `tree_verify`'s greedy walk over the
  target's coupled scores, the root's children against the noise at index 0,
  a node at depth d's children against index d.

  Args:
    key: a `Coupling` with noise `[B, >= D + 1, V']`, D the tree's depth.
    tree_tokens, parents, draft_probs, target_probs: as `tree_verify`'s.
    mode: the tree's own mode, for the rows `key` does not cover.

  Returns:
    `TreeVerifyResult(path [B, D], num_accepted [B], next_token [B])`.
  """
  tree = as_tree(parents)
  b = tree_tokens.shape[0]
  _check_coupling(key, tree.depth + 1, b)
  # Block row 0 is the root (depth 0), row c + 1 node c: its children are drawn at index depth.
  depths = jnp.concatenate(
    [jnp.zeros((tree.parents.shape[0], 1), jnp.int32), jnp.asarray(tree.depths())], axis=1
  )
  depths = jnp.broadcast_to(jnp.minimum(depths, tree.depth), (b, depths.shape[1]))
  gumbel = jnp.take_along_axis(key.gumbel, depths[:, :, None], axis=1)  # [B, N + 1, V']
  target_scores = coupling_lib.scores(target_probs.astype(jnp.float32), gumbel)
  coupled = tree_verify(None, tree_tokens, tree, draft_probs, target_scores, "greedy")
  if key.rows is None:
    return coupled
  plain = tree_verify(key.key, tree_tokens, tree, draft_probs, target_probs, mode)
  return TreeVerifyResult(*(key.select(c, p) for c, p in zip(coupled, plain)))
