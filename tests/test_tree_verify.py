"""Exactness of tree verification: the emitted tokens must follow the target's law.

The same three layers of evidence as tests/test_verify_exactness.py, for trees:

* An independent float64 numpy reference enumerates every drafted tree (siblings
  i.i.d. or without replacement from a context-dependent q), every accept/reject
  outcome of the walk and the final sample, on V = 4 and depth-2 trees, and proves
  the rule exact: the emitted tokens, completed to length depth + 1 by sampling the
  target, have exactly the target's joint prod_j p(w_j | w_<j). Verifying siblings
  with the other mode's rule is not exact, so the two modes are really different.
* The jitted `tree_verify`, run on 10^6 trees drawn in JAX with the right sibling
  law, passes a chi-square test against the reference's joint law of (accepted
  path, completed sequence), whose sequence marginal is the target's joint.
* A chain is `token_verify`, draw for draw, and so has its acceptance lengths.

Greedy mode and the guards get hand-built deterministic checks.
"""

import functools
import itertools
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_verify_exactness as chain

from helpers import SIMULATION_COMPILER_OPTIONS, chisquare_pvalue
from specjax.trees import Tree
from specjax.verify import TreeVerifyResult, token_verify, tree_verify

CASES = chain.CASES
MODES = ["iid", "without_replacement"]
# Depth-2 trees: two children per node; three chains; mixed widths with a leaf at depth 1.
TREES = {
  "binary": (-1, -1, 0, 0, 1, 1),
  "three_chains": (-1, -1, -1, 0, 1, 2),
  "mixed": (-1, -1, -1, 0, 0, 1),
}
DEPTH = 2
NUM_SAMPLES = 10**6
MIN_PVALUE = 1e-4
jit_tree_verify = jax.jit(tree_verify, static_argnames=("parents", "mode"))


def children_of(parents):
  """{node: its children in index order}; the root is -1."""
  kids = defaultdict(list)
  for i, u in enumerate(parents):
    kids[u].append(i)
  return kids


def depth_of(parents):
  depths = []
  for u in parents:
    depths.append(1 if u < 0 else depths[u] + 1)
  return max(depths, default=0)


# ---------------------------------------------------------------------------
# Independent float64 reference: exact enumeration of one iteration.
# ---------------------------------------------------------------------------


def sibling_draws(q, count, mode):
  """Every ordered draw of `count` siblings from `q [V]` -> (tokens, probability).

  Without replacement, a sibling drawn once q's support is used up cannot exist:
  it is None (padding), and so are the ones after it.
  """
  vocab = len(q)
  if mode == "iid":
    for tokens in itertools.product(range(vocab), repeat=count):
      weight = np.prod(q[list(tokens)])
      if weight > 0:
        yield tokens, weight
    return

  def draw(tokens, weight):
    if len(tokens) == count:
      yield tokens, weight
      return
    rest = q.copy()
    rest[list(tokens)] = 0.0
    if rest.sum() == 0:
      yield tokens + (None,) * (count - len(tokens)), weight
      return
    for x in np.flatnonzero(rest):
      yield from draw(tokens + (int(x),), weight * rest[x] / rest.sum())

  yield from draw((), 1.0)


def drafted_trees(q_table, parents, mode):
  """Every drafted tree as (tokens [N] with None for padding, probability).

  Sibling groups are drawn parent by parent from q(parent's prefix); a parent
  comes before its children, so its prefix is known when its group is drawn.
  """
  vocab, kids = q_table.shape[-1], children_of(parents)
  groups = [u for u in range(-1, len(parents)) if kids[u]]

  def prefix(node, tokens):
    out = []
    while node >= 0:
      out.append(tokens[node])
      node = parents[node]
    return None if None in out else tuple(reversed(out))

  def draw(g, tokens, weight):
    if g == len(groups):
      yield tuple(tokens), weight
      return
    members, context = kids[groups[g]], prefix(groups[g], tokens)
    if context is None:  # the children of padding are padding
      yield from draw(g + 1, tokens, weight)
      return
    for drawn, w in sibling_draws(q_table[chain.ctx_index(context, vocab)], len(members), mode):
      for node, x in zip(members, drawn):
        tokens[node] = x
      yield from draw(g + 1, tokens, weight * w)

  yield from draw(0, [None] * len(parents), 1.0)


def reference_tree_emitted(p_table, q_table, parents, mode, draw_mode=None):
  """Exact law of one iteration's outcome as {(path, emitted tokens): probability}.

  `path` is the accepted nodes padded with -1 to the tree's depth, the emitted
  tokens are the path's tokens then the verifier's token. Trees are drawn with
  `draw_mode` (default: `mode`) and verified with `mode`'s rule: at a node with
  law p, child c with token x is accepted with min(1, p(x)/q_c(x)) (q_c = q, or q
  without the earlier siblings' tokens, renormalised); a rejection sets p to
  normalize(max(0, p - q_c)) (p if that is all zero); after the last child y ~ p.
  """
  vocab, kids, depth = p_table.shape[-1], children_of(parents), depth_of(parents)
  emitted = defaultdict(float)

  def visit(tokens, node, prefix, path, weight):
    law = p_table[chain.ctx_index(prefix, vocab)]
    earlier = []
    for c in kids[node]:
      x = tokens[c]
      if x is None:
        continue  # padding: nothing was drawn
      q = q_table[chain.ctx_index(prefix, vocab)].copy()
      if mode == "without_replacement" and earlier:
        q[earlier] = 0.0
        q = q / q.sum() if q.sum() > 0 else q
      earlier.append(x)
      accept = min(1.0, law[x] / q[x]) if q[x] > 0 else 0.0
      if accept > 0:
        visit(tokens, c, prefix + (x,), path + (c,), weight * accept)
      weight *= 1.0 - accept
      residual = np.maximum(law - q, 0.0)
      law = residual / residual.sum() if residual.sum() > 0 else law
    path = path + (-1,) * (depth - len(path))
    for y in range(vocab):
      emitted[(path, prefix + (y,))] += weight * law[y]

  for tokens, weight in drafted_trees(q_table, parents, draw_mode or mode):
    visit(tokens, -1, (), (), weight)
  return dict(emitted)


def emitted_tokens(emitted):
  """{(path, tokens): mass} -> {tokens: mass}, the law `chain.complete_with_target` takes."""
  law = defaultdict(float)
  for (_, tokens), mass in emitted.items():
    law[tokens] += mass
  return dict(law)


def path_code(path, num_nodes):
  """The histogram cell of an accepted path: base-(N + 1) digits node + 1, top first."""
  return sum((node + 1) * (num_nodes + 1) ** d for d, node in enumerate(path))


def reference_path_joint(emitted, p_table, parents):
  """`[(N+1)**D, V**(D+1)]` law of (accepted path, completed sequence)."""
  depth, vocab = depth_of(parents), p_table.shape[-1]
  joint = np.zeros(((len(parents) + 1) ** depth, vocab ** (depth + 1)))
  for (path, tokens), mass in emitted.items():
    completed = chain.complete_with_target({tokens: mass}, p_table, depth)
    joint[path_code(path, len(parents))] += completed.ravel()
  return joint


def acceptance_distribution(emitted, depth):
  dist = np.zeros(depth + 1)
  for (path, _), mass in emitted.items():
    dist[sum(node >= 0 for node in path)] += mass
  return dist


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("case", CASES)
def test_reference_tree_enumeration_equals_target_joint(case, tree, mode):
  """The tree rule, enumerated exactly, reproduces the target's joint to 1e-9."""
  p, q = chain.make_tables(case, vocab=4, gamma=DEPTH, seed=400 + CASES.index(case))
  emitted = reference_tree_emitted(p, q, TREES[tree], mode)
  assert abs(sum(emitted.values()) - 1.0) < 1e-12
  np.testing.assert_allclose(
    chain.complete_with_target(emitted_tokens(emitted), p, DEPTH),
    chain.target_joint(p, DEPTH),
    rtol=0,
    atol=1e-9,
  )
  accepted = acceptance_distribution(emitted, DEPTH)
  if case == "p_equals_q":  # the first child is always accepted, and node 0 has children
    assert accepted[DEPTH] == pytest.approx(1.0, abs=1e-12)
  if case == "disjoint_supports":
    assert accepted[0] == pytest.approx(1.0, abs=1e-12)


def test_reference_chain_equals_chain_reference():
  """On a chain the tree reference is the (separately written) chain reference."""
  for mode in MODES:
    p, q = chain.make_tables("generic", vocab=4, gamma=2, seed=9)
    tree = emitted_tokens(reference_tree_emitted(p, q, (-1, 0), mode))
    flat = chain.reference_emitted(p, q, 2)
    assert tree.keys() == flat.keys()
    np.testing.assert_allclose([tree[k] for k in flat], list(flat.values()), rtol=0, atol=1e-12)


@pytest.mark.parametrize("draw_mode", MODES)
def test_other_modes_rule_is_not_exact(draw_mode):
  """Siblings verified with the rule for the other sibling law miss the target's joint:
  the without-replacement correction is necessary, and only right for such draws."""
  mode = MODES[1 - MODES.index(draw_mode)]
  p, q = chain.make_tables("generic", vocab=4, gamma=DEPTH, seed=400)
  emitted = reference_tree_emitted(p, q, TREES["mixed"], mode, draw_mode=draw_mode)
  joint = chain.complete_with_target(emitted_tokens(emitted), p, DEPTH)
  assert np.abs(joint - chain.target_joint(p, DEPTH)).max() > 1e-3


# ---------------------------------------------------------------------------
# The jitted verifier, statistically.
# ---------------------------------------------------------------------------


def draw(key, probs, shape=()):
  """Inverse-CDF draws from `probs [S, V]` -> int32 `[*shape, S]`: one uniform per token
  (a quarter of `jax.random.categorical`'s random bits at V = 4). u * total < total,
  so a token of probability zero is never drawn."""
  cdf = jnp.cumsum(probs, axis=-1)
  u = jax.random.uniform(key, (*shape, probs.shape[0], 1))
  return jnp.sum(cdf <= u * cdf[:, -1:], axis=-1).astype(jnp.int32)


@functools.partial(
  jax.jit,
  static_argnames=("parents", "mode", "num_samples"),
  compiler_options=SIMULATION_COMPILER_OPTIONS,
)
def simulate_tree(key, p_table, q_table, *, parents, mode, num_samples):
  """`num_samples` iterations of tree drafting + `tree_verify` + target completion.

  Sibling groups are drawn from q(parent's prefix): i.i.d. by inverse CDF, or
  without replacement as the top of Gumbel-perturbed
  log q (Gumbel-top-k; once q's support is used up the rest are q = 0 padding).

  Returns:
    `[(N+1)**D * V**(D+1)]` counts of (accepted path, completed sequence).
  """
  vocab, num_nodes, kids = p_table.shape[-1], len(parents), children_of(parents)
  depth = depth_of(parents)
  draw_key, verify_key, complete_key = jax.random.split(key, 3)
  rows = lambda table, prefix: table[chain._ctx_rows(prefix, vocab, num_samples)]

  prefixes, tokens, q_rows = {-1: []}, [None] * num_nodes, [None] * num_nodes
  for u in sorted(kids):
    members, q_parent = kids[u], rows(q_table, prefixes[u])  # [S, V]
    k = jax.random.fold_in(draw_key, u + 1)
    if mode == "iid":
      drawn = draw(k, q_parent, (len(members),)).T
    else:
      perturbed = jnp.log(q_parent) + jax.random.gumbel(k, q_parent.shape)
      drawn = jax.lax.top_k(perturbed, len(members))[1]
    for j, c in enumerate(members):
      tokens[c] = drawn[:, j].astype(jnp.int32)
      prefixes[c], q_rows[c] = prefixes[u] + [tokens[c]], q_parent
  p_rows = [rows(p_table, prefixes[c]) for c in [-1, *range(num_nodes)]]
  tree_tokens = jnp.stack(tokens, 1)
  path, n, y = tree_verify(
    verify_key, tree_tokens, parents, jnp.stack(q_rows, 1), jnp.stack(p_rows, 1), mode=mode
  )

  # Emitted: the path's tokens, then y; later positions are filled by the target.
  path_tokens = jnp.take_along_axis(tree_tokens, jnp.maximum(path, 0), axis=1)
  seq = []
  for j, k in enumerate(jax.random.split(complete_key, depth + 1)):
    token = draw(k, rows(p_table, seq))
    token = jnp.where(j == n, y, token)
    if j < depth:
      token = jnp.where(j < n, path_tokens[:, j], token)
    seq.append(token)
  seq_code = chain._ctx_rows(seq, vocab, num_samples) - chain.num_contexts(vocab, depth)
  path_cell = sum((path[:, d] + 1) * (num_nodes + 1) ** d for d in range(depth))
  size = (num_nodes + 1) ** depth * vocab ** (depth + 1)
  return jnp.bincount(path_cell * vocab ** (depth + 1) + seq_code, length=size)


def mixed_case_tables(vocab, seed):
  """Generic p and q at the root; after first token x, the edge case CASES[x + 1]
  (one-hot q, p == q, disjoint supports, q zero where p > 0), so one simulation
  meets them all, and without replacement exhausts q's support."""
  tables = {case: chain.make_tables(case, vocab, DEPTH, seed) for case in CASES}
  p, q = (table.copy() for table in tables["generic"])
  for token, case in enumerate(CASES[1:]):
    row = chain.ctx_index((token,), vocab)
    p[row], q[row] = tables[case][0][row], tables[case][1][row]
  return p, q


@pytest.mark.parametrize("mode", MODES)
def test_tree_verify_matches_target_joint(mode):
  """10^6 jitted iterations: the completed sequences fit the target's joint, and
  (accepted path, sequence) fits the reference's joint law (never observing an
  outcome of probability zero)."""
  parents, vocab, seed = TREES["mixed"], 4, 500 + MODES.index(mode)
  (p32, q32), (p64, q64) = chain.to_float32(*mixed_case_tables(vocab, seed))
  counts = simulate_tree(
    jax.random.key(seed),
    jnp.asarray(p32),
    jnp.asarray(q32),
    parents=parents,
    mode=mode,
    num_samples=NUM_SAMPLES,
  )
  counts = np.asarray(counts, np.int64).reshape(-1, vocab ** (DEPTH + 1))
  assert counts.sum() == NUM_SAMPLES
  assert chisquare_pvalue(counts.sum(0), chain.target_joint(p64, DEPTH)) > MIN_PVALUE
  # A wrong rule can still emit the target's law (e.g. reject everything and
  # sample p); the accepted paths pin down the rule itself.
  expected = reference_path_joint(reference_tree_emitted(p64, q64, parents, mode), p64, parents)
  assert chisquare_pvalue(counts, expected) > MIN_PVALUE
  # Every acceptance length occurs often enough to be tested.
  digits = (
    np.arange(len(counts))[:, None] // (len(parents) + 1) ** np.arange(DEPTH) % (len(parents) + 1)
  )
  accepted = np.bincount((digits > 0).sum(1), weights=counts.sum(1), minlength=DEPTH + 1)
  assert np.all(accepted > NUM_SAMPLES // 20), accepted


def test_chain_is_token_verify_draw_for_draw():
  """Same key, same chain: the same accepted lengths and tokens, row for row, in
  both sampling modes (a chain has no siblings), including the guards' cases."""
  batch, gamma, vocab = 4096, 3, 5

  @jax.jit  # one program for the inputs and the reference, not one per eager op
  def chain_and_reference(key):
    keys = jax.random.split(key, 4)
    q = jax.random.dirichlet(keys[0], jnp.full((vocab,), 0.5), (batch, gamma))
    p = jax.random.dirichlet(keys[1], jnp.full((vocab,), 0.5), (batch, gamma + 1))
    tokens = jax.random.categorical(keys[2], jnp.log(q)).astype(jnp.int32)
    # A few rows the guards decide: q(x) = 0, an id out of range, p == q.
    q = q.at[:8, 1].set(q[:8, 1].at[jnp.arange(8), tokens[:8, 1]].set(0.0))
    tokens = tokens.at[8:16, 2].set(vocab)
    p = p.at[16:24, :gamma].set(q[16:24])
    return keys[3], tokens, q, p, token_verify(keys[3], tokens, q, p)

  key, tokens, q, p, expected = chain_and_reference(jax.random.key(2))
  assert len(set(np.asarray(expected.num_accepted).tolist())) == gamma + 1
  for mode in MODES:
    result = jit_tree_verify(key, tokens, (-1, 0, 1), q, p, mode=mode)
    np.testing.assert_array_equal(result.num_accepted, expected.num_accepted)
    np.testing.assert_array_equal(result.next_token, expected.next_token)
    n = np.asarray(result.num_accepted)[:, None]
    np.testing.assert_array_equal(result.path, np.where(np.arange(gamma) < n, np.arange(gamma), -1))


# ---------------------------------------------------------------------------
# Greedy mode.
# ---------------------------------------------------------------------------


def _argmax_rows(argmaxes, vocab):
  """`[B, N + 1]` argmax ids -> target rows `[B, N + 1, V]` peaked there."""
  target = np.full((*argmaxes.shape, vocab), 0.1, np.float32)
  np.put_along_axis(target, argmaxes[..., None], 0.6, axis=-1)
  return jnp.asarray(target)


def test_greedy_hand_built():
  """The longest path whose tokens are the target's argmaxes, then the argmax after it."""
  parents, vocab = TREES["binary"], 6  # root -> 0, 1; 0 -> 2, 3; 1 -> 4, 5
  # Argmax of target row r (r = 0: after the root, r = i + 1: after node i).
  argmaxes = np.array(
    [
      [3, 4, 0, 0, 2, 0, 0],  # 0 matches, then 3 (not 2): path 0, 3; bonus = row 4's = 2
      [5, 0, 2, 0, 0, 0, 1],  # 0 mismatches, 1 matches, 4 not, 5 does: path 1, 5; bonus 1
      [0, 0, 0, 0, 0, 0, 0],  # nothing matches at the root: next = 0
      [3, 0, 0, 0, 0, 0, 0],  # 0 matches, none of its children: path 0; next = row 1's = 0
      [2, 1, 0, 5, 0, 0, 0],  # 0 and 1 both match: the first wins, then 2: path 0, 2; next 5
    ]
  )
  tokens = np.array(
    [
      [3, 5, 1, 4, 0, 0],
      [3, 5, 1, 1, 0, 2],
      [3, 5, 0, 0, 0, 0],
      [3, 5, 1, 4, 0, 0],
      [2, 2, 1, 3, 1, 1],
    ],
    np.int32,
  )
  target = _argmax_rows(argmaxes, vocab)
  result = jit_tree_verify(None, jnp.asarray(tokens), parents, None, target, mode="greedy")
  assert isinstance(result, TreeVerifyResult)
  np.testing.assert_array_equal(result.path, [[0, 3], [1, 5], [-1, -1], [0, -1], [0, 2]])
  np.testing.assert_array_equal(result.num_accepted, [2, 2, 0, 1, 2])
  np.testing.assert_array_equal(result.next_token, [2, 1, 0, 0, 5])
  # As in greedy_verify, draft_probs only mark nodes that cannot have been drafted.
  q = np.full((5, 6, vocab), 1.0 / vocab, np.float32)
  q[1, 1, 5] = 0.0  # row 1's node 1 is padding: its subtree is not reached
  result = tree_verify(None, jnp.asarray(tokens), parents, jnp.asarray(q), target, mode="greedy")
  np.testing.assert_array_equal(result.path, [[0, 3], [-1, -1], [-1, -1], [0, -1], [0, 2]])
  np.testing.assert_array_equal(result.next_token, [2, 5, 0, 0, 5])


@pytest.mark.parametrize("mode", MODES)
def test_one_hot_laws_reduce_to_greedy(mode):
  """Temperature 0 (one-hot p, and q one-hot at each node's token): the exact rule
  walks the greedy path."""
  batch, vocab, parents = 512, 4, TREES["binary"]
  rng = np.random.default_rng(4)
  tokens = rng.integers(vocab, size=(batch, len(parents))).astype(np.int32)
  argmaxes = rng.integers(vocab, size=(batch, len(parents) + 1))
  eye = np.eye(vocab, dtype=np.float32)
  q, p = jnp.asarray(eye[tokens]), jnp.asarray(eye[argmaxes])
  greedy = jit_tree_verify(None, jnp.asarray(tokens), parents, None, p, mode="greedy")
  assert len(set(np.asarray(greedy.num_accepted).tolist())) == DEPTH + 1
  exact = jit_tree_verify(jax.random.key(0), jnp.asarray(tokens), parents, q, p, mode=mode)
  for got, want in zip(exact, greedy):
    np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------------------
# Guards and input checks.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad", ["id_below", "id_above", "q_zero_at_x", "nan_q"])
def test_impossible_nodes_are_rejected(mode, bad):
  """Node 0 cannot have been drafted: it is never accepted (which would emit 3 next),
  and its rejection updates the law as any rejection does."""
  batch, vocab = 256, 4
  tokens = np.tile([[1, 2]], (batch, 1)).astype(np.int32)
  q = np.tile(np.eye(vocab, dtype=np.float32)[2], (batch, 2, 1))  # shared by the siblings
  p = np.tile(np.array([[0, 0.5, 0.5, 0], [0, 0, 0, 1], [1, 0, 0, 0]], np.float32), (batch, 1, 1))
  tokens[:, 0] = {"id_below": -1, "id_above": vocab}.get(bad, 1)  # q(1) = 0 but p(1) > 0
  if bad == "nan_q":
    q[:, 0] = np.nan
  path, _, y = jit_tree_verify(
    jax.random.key(1), jnp.asarray(tokens), (-1, -1), jnp.asarray(q), jnp.asarray(p), mode=mode
  )
  path, y = np.asarray(path)[:, 0], np.asarray(y)
  if bad == "nan_q":
    # No law at node 0: it leaves p as it was; node 1 is accepted with min(1, 0.5 / 1),
    # else max(0, p - e_2) = e_1 gives 1.
    np.testing.assert_array_equal(y, np.where(path == 1, 0, 1))
    assert 0 < np.mean(path == 1) < 1 and np.all(path != 0)
  else:
    # max(0, p - e_2) = e_1 after node 0, where node 1 (token 2) has p = 0.
    np.testing.assert_array_equal(path, -1)
    np.testing.assert_array_equal(y, 1)


def test_exhausted_support_is_padding():
  """Without replacement from a one-hot q only one sibling exists: node 1 has no law,
  is never accepted, and leaves the residual max(0, p - q) = e_1 unchanged."""
  batch, vocab = 4096, 4
  tokens = jnp.tile(jnp.array([[0, 1]], jnp.int32), (batch, 1))
  q = jnp.tile(jnp.eye(vocab)[0], (batch, 2, 1))
  p = jnp.tile(jnp.array([[0.5, 0.5, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0]]), (batch, 1, 1))
  mode = "without_replacement"
  path, n, y = jit_tree_verify(jax.random.key(3), tokens, (-1, -1), q, p, mode=mode)
  path, n, y = np.asarray(path)[:, 0], np.asarray(n), np.asarray(y)
  np.testing.assert_array_equal(np.where(n == 1, path, -1), np.where(n == 1, 0, -1))
  np.testing.assert_array_equal(y, np.where(n == 1, 3, 1))
  assert abs(n.mean() - 0.5) < 5 * 0.5 / np.sqrt(batch)


@pytest.mark.parametrize("mode", [*MODES, "greedy"])
def test_empty_tree_gives_the_bonus_token(mode):
  p = jax.nn.one_hot(jnp.arange(4) + 1, 6)[:, None]  # [4, 1, 6]
  result = tree_verify(jax.random.key(0), jnp.zeros((4, 0), jnp.int32), (), p[:, :0], p, mode)
  assert result.path.shape == (4, 0)
  np.testing.assert_array_equal(result.num_accepted, 0)
  np.testing.assert_array_equal(result.next_token, np.arange(4) + 1)


def _valid_inputs():
  b, v, parents = 2, 5, (-1, -1, 0)
  tokens = jnp.zeros((b, 3), jnp.int32)
  return tokens, parents, jnp.full((b, 3, v), 1.0 / v), jnp.full((b, 4, v), 1.0 / v)


BAD_INPUTS = {  # id: (the argument named, a change of the valid call (key, t, a, q, p, mode))
  "parents_list": ("parents", lambda k, t, a, q, p, m: (k, t, list(a), q, p, m)),
  "parent_is_self": ("parents", lambda k, t, a, q, p, m: (k, t, (-1, -1, 2), q, p, m)),
  "parent_after": ("parents", lambda k, t, a, q, p, m: (k, t, (-1, -1, 3), q, p, m)),
  "parent_below_root": ("parents", lambda k, t, a, q, p, m: (k, t, (-2, -1, 0), q, p, m)),
  "parent_float": ("parents", lambda k, t, a, q, p, m: (k, t, (-1, -1.0, 0), q, p, m)),
  "parent_bool": ("parents", lambda k, t, a, q, p, m: (k, t, (-1, True, 0), q, p, m)),
  "parents_too_few": ("parents", lambda k, t, a, q, p, m: (k, t, (-1, -1), q, p, m)),
  "tokens_float": ("tree_tokens", lambda k, t, a, q, p, m: (k, t.astype(float), a, q, p, m)),
  "tokens_rank": ("tree_tokens", lambda k, t, a, q, p, m: (k, t[0], a, q, p, m)),
  "draft_n": ("draft_probs", lambda k, t, a, q, p, m: (k, t, a, q[:, :2], p, m)),
  "draft_v": ("draft_probs", lambda k, t, a, q, p, m: (k, t, a, q[..., :4], p, m)),
  "draft_rank": ("draft_probs", lambda k, t, a, q, p, m: (k, t, a, q[0], p, m)),
  "draft_none": ("draft_probs", lambda k, t, a, q, p, m: (k, t, a, None, p, m)),
  "target_no_root_row": ("target_probs", lambda k, t, a, q, p, m: (k, t, a, q, p[:, :3], m)),
  "target_batch": ("target_probs", lambda k, t, a, q, p, m: (k, t, a, q, p[:1], m)),
  "target_int": ("target_probs", lambda k, t, a, q, p, m: (k, t, a, q, p.astype(int), m)),
  "mode": ("mode", lambda k, t, a, q, p, m: (k, t, a, q, p, "top_k")),
  "key": ("key", lambda k, t, a, q, p, m: (None, t, a, q, p, m)),
}


@pytest.mark.parametrize("name, change", BAD_INPUTS.values(), ids=BAD_INPUTS)
def test_bad_inputs_raise_naming_the_argument(name, change):
  args = change(jax.random.key(0), *_valid_inputs(), "iid")
  with pytest.raises(ValueError, match=f"^{name}"):
    tree_verify(*args)
  if isinstance(args[2], tuple):  # (a list cannot be a static argument)
    with pytest.raises(ValueError, match=f"^{name}"):  # raised while tracing, before compiling
      jit_tree_verify(*args[:5], mode=args[5])


@pytest.mark.parametrize("mode", [*MODES, "greedy"])
def test_per_row_trees_equal_the_static_tree(mode):
  """A per-row `Tree` holding the same tree in every row decides exactly as the
  static tuple (the per-row trees EAGLE-2's dynamic drafting proposes)."""
  parents = TREES["binary"]
  b, n, v = 4096, len(parents), 4

  @jax.jit  # one program, not one per eager op
  def static_and_dynamic(key):
    keys = jax.random.split(key, 4)
    tokens = jax.random.randint(keys[0], (b, n), 0, v)
    q = jax.nn.softmax(2 * jax.random.normal(keys[1], (b, n, v)))
    p = jax.nn.softmax(2 * jax.random.normal(keys[2], (b, n + 1, v)))
    rows = Tree.per_row(jnp.broadcast_to(jnp.array(parents), (b, n)), DEPTH)
    static = tree_verify(keys[3], tokens, parents, q, p, mode)
    return static, tree_verify(keys[3], tokens, rows, q, p, mode)

  static, dynamic = static_and_dynamic(jax.random.key(21))
  for a, d in zip(static, dynamic):
    np.testing.assert_array_equal(a, d)
  assert 0 < np.mean(static.num_accepted) < DEPTH  # both outcomes occur
