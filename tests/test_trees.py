"""Token trees end to end: topology, tree attention, the commit's gather, greedy
decoding with tree drafters, and bad input. (The verifier's exactness is in
tests/test_tree_verify.py; the full-model law with tree drafting in
tests/test_distribution.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from helpers import GEMMA_STYLE, forward_cached, full_logits, head_drafter
from specjax import trees
from specjax.drafting import TreeDrafter
from specjax.generation.speculative import init_state, speculative_step
from specjax.generation.state import SpecConfig

# Two children of the root; the second has two children, its first one more. A
# path of two or more nodes always goes through node 1, so committing it moves
# keys and values (node 1 -> the slot after s[-1]).
TREE = trees.from_paths([(0,), (1,), (1, 0), (1, 1), (1, 0, 0)])


def test_builders_and_topology():
  assert TREE == (-1, -1, 1, 1, 2)
  assert trees.tree_depths(TREE) == (1, 1, 2, 2, 3)
  assert trees.levels(TREE) == ((0, 2), (2, 4), (4, 5))
  assert trees.sibling_ranks(TREE) == (0, 1, 0, 1, 0)
  assert trees.num_children(TREE) == (2, 0, 2, 1, 0, 0)
  assert trees.full((2, 2)) == (-1, -1, 0, 0, 1, 1)
  assert trees.chain(3) == (-1, 0, 1)
  visible = trees.Tree.static(TREE).ancestors()[0]
  assert visible[4].tolist() == [False, True, True, False, True]


@pytest.mark.parametrize(
  "paths, match",
  [
    ([(0,), (0, 1)], "elder sibling"),
    ([(0, 0)], "parent"),
    ([(0,), ()], "non-empty"),
  ],
)
def test_from_paths_rejects_gaps(paths, match):
  with pytest.raises(ValueError, match=match):
    trees.from_paths(paths)


def test_drafting_trees_must_be_breadth_first(draft):
  with pytest.raises(ValueError, match="breadth-first"):
    TreeDrafter(draft, (-1, 0, -1))
  with pytest.raises(ValueError, match=r"tree\[1\] must be in \[-1, 0\]"):
    TreeDrafter(draft, (-1, 3))
  with pytest.raises(ValueError, match="tree_mode must be one of"):
    TreeDrafter(draft, TREE, tree_mode="top_k")


# The block trees (s[-1] is node 0): TREE's for both rows, or a different tree per
# row (`Tree.per_row`, as EAGLE-2 drafts).
ROW_TREES = ((-1, 0, 0, 1, 2, 3), (-1, 0, 1, 1, 0, 4))


@pytest.mark.parametrize(
  "per_row, gemma",
  [(False, False), (True, False), (False, True)],
  ids=["static", "per_row", "gemma"],
)
def test_tree_attention_scores_every_path_as_a_sequence(target, tiny_cfg, per_row, gemma):
  """One cached call over s[-1] + a tree (ragged prefixes) gives each node the
  logits of a plain forward over the prefix and the node's path; `gemma`: with a
  local layer's window shorter than the paths."""
  if gemma:
    target = specjax.Transformer(tiny_cfg.replace(**GEMMA_STYLE), rngs=nnx.Rngs(5))
  b, width = 2, 6
  tokens = jax.random.randint(jax.random.key(3), (b, width), 0, 512)
  lengths = jnp.array([6, 3])  # the prefix; its last token is the root
  cache = target.init_cache(b, 16)
  cache = forward_cached(target, tokens, cache)[1].with_lengths(lengths - 1)
  row_trees = ROW_TREES if per_row else ((-1, *(u + 1 for u in TREE)),) * b
  nodes = jax.random.randint(jax.random.key(4), (b, len(row_trees[0]) - 1), 0, 512)
  root = jnp.take_along_axis(tokens, (lengths - 1)[:, None], axis=1)
  block = jnp.concatenate([root, nodes], axis=1)
  layout = trees.Tree.per_row(jnp.array(row_trees), 4) if per_row else row_trees[0]
  call = jax.jit(lambda model, block, cache: model.forward_cached(block, cache, tree=(layout, 0)))
  logits, out = call(target, block, cache)
  assert out.lengths.tolist() == (lengths - 1).tolist()  # a tree call does not advance
  # Every (row, node) path as one right-padded batch of plain sequences: one call.
  seqs, ends = [], []
  for row in range(b):
    visible = trees.Tree.static(row_trees[row]).ancestors()[0]
    prefix = np.asarray(tokens[row, : int(lengths[row]) - 1])
    for j in range(len(row_trees[row])):
      seqs.append(np.concatenate([prefix, np.asarray(block[row])[visible[j]]]))
      ends.append(len(seqs[-1]) - 1)
  padded = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
  for i, seq in enumerate(seqs):
    padded[i, : len(seq)] = seq
  full = full_logits(target, jnp.asarray(padded))[np.arange(len(seqs)), np.asarray(ends)]
  np.testing.assert_allclose(logits.reshape(len(seqs), -1), full, atol=2e-5)


def test_commit_leaves_caches_as_a_recompute_would(target, draft, prompts):
  """After tree iterations the target's and the tree drafter's caches hold the
  committed sequence in consecutive slots, as prefilling it from scratch would."""
  drafter = TreeDrafter(draft, TREE, tree_mode="iid")
  config = SpecConfig(
    gamma=len(TREE),
    max_new_tokens=12,
    sampling=specjax.SamplingParams(temperature=1.0),
    verifier="tree",
  )
  step = jax.jit(lambda s: speculative_step(target, drafter, s, config))
  state = jax.jit(init_state, static_argnames="config")(
    target, drafter, *prompts, jax.random.key(8), config=config
  )
  for _ in range(2):
    state = step(state)
  # The tiny models are near-uniform at T = 1, so paths through node 1 are common.
  assert int(jnp.max(state.num_generated)) >= 4
  rows = prompts[0].shape[0]
  seqs = [
    np.concatenate(
      [
        np.asarray(prompts[0][row, : int(prompts[1][row])]),
        np.asarray(state.tokens[row, : int(state.num_generated[row])]),
      ]
    )
    for row in range(rows)
  ]
  padded = np.zeros((rows, max(map(len, seqs))), np.int32)
  for row, seq in enumerate(seqs):
    padded[row, : len(seq)] = seq
  for model, cache, drop in ((target, state.target_cache, 1), (draft, state.drafter_state, 2)):
    # One causal prefill of the padded batch: slots before each row's end are exact.
    fresh = forward_cached(model, jnp.asarray(padded), model.init_cache(rows, cache.capacity))[1]
    for row, seq in enumerate(seqs):
      n = len(seq) - drop  # target: s[:-1]; draft: s[:-2]
      assert int(cache.lengths[row]) == n
      for got, want in zip(cache.k + cache.v, fresh.k + fresh.v):
        np.testing.assert_allclose(got[row, :, :n], want[row, :, :n], atol=1e-5)


@pytest.mark.parametrize("name", ["model", "medusa", "eagle", "eagle2", "dflash"])
def test_greedy_tree_decoding_is_the_targets_greedy_output(
  target, noisy_target, prompts, greedy_reference, name
):
  drafter = {
    "model": lambda: TreeDrafter(noisy_target, TREE),
    "medusa": lambda: head_drafter("medusa", target, num_heads=3).replace(tree=TREE),
    "eagle": lambda: head_drafter("eagle", target).replace(tree=TREE),
    # EAGLE-2: 5 of 3 + 2 x 2 x 3 candidates, a tree per row
    "eagle2": lambda: head_drafter("eagle", target).replace(tree=trees.DynamicTree(5, 3, 3, 2)),
    # the block drafter: depth d's children from block position d + 1, one call
    "dflash": lambda: head_drafter("dflash", target, block_size=4).replace(tree=TREE),
  }[name]()
  out = specjax.speculative_generate(
    target, drafter, *prompts, gamma=len(TREE), max_new_tokens=16, sampling=specjax.GREEDY
  )
  np.testing.assert_array_equal(out.tokens, greedy_reference.tokens)
  if name == "model":  # a draft that agrees often: paths through node 1 are accepted
    assert int(out.stats.accepted_at_position[1]) > 0


def test_tree_drafters_refuse_what_does_not_apply(target, draft, prompts):
  drafter = TreeDrafter(draft, TREE)
  run = lambda **kw: specjax.speculative_generate(
    target,
    drafter,
    *prompts,
    max_new_tokens=4,
    **{"gamma": len(TREE), "sampling": specjax.GREEDY, **kw},
  )
  with pytest.raises(ValueError, match="gamma must equal the drafter's number of tree nodes, 5"):
    run(gamma=4)
  with pytest.raises(ValueError, match="verifier must be 'auto'"):
    run(verifier="token")
  with pytest.raises(ValueError, match="adaptive None"):
    run(adaptive="schedule")
  with pytest.raises(ValueError, match="depth <= 2"):
    head_drafter("medusa", target, num_heads=2).replace(tree=TREE)
  with pytest.raises(ValueError, match=r"depth <= 2 \(block_size - 1"):
    head_drafter("dflash", target, block_size=3).replace(tree=TREE)
  with pytest.raises(ValueError, match="DynamicTree.branch must be an int >= 1, got 0"):
    trees.DynamicTree(8, 3, branch=0)
  with pytest.raises(ValueError, match="size <= branch"):
    trees.DynamicTree(40, 2, branch=2, expand=2)
  with pytest.raises(ValueError, match=r"depth must be in \[2, size\]"):
    trees.DynamicTree(4, 6)
  eagle2 = head_drafter("eagle", target).replace(tree=trees.DynamicTree(8, 3))
  with pytest.raises(ValueError, match="gamma must equal the dynamic tree's size, 8"):
    specjax.speculative_generate(
      target, eagle2, *prompts, gamma=5, max_new_tokens=4, sampling=specjax.GREEDY
    )
