"""The same mask on q as on p: drafters draw only what the constraint allows.

* Every drafter with `constrained_drafts` (draft model, layer skip, EAGLE, DFlash,
  Medusa, early exit, a bigram, a static tree, a Medusa tree, EAGLE-2), asked
  for a proposal under a regex, proposes only tokens the state along its own
  path allows, greedy and sampled; unmasked, the same drafters propose
  forbidden tokens (so the check can fail).
* The target drafting for itself under a constraint has every draft accepted
  at temperature 0, which it cannot without the mask on q.
* Greedy constrained speculative output still equals constrained greedy
  decoding for every one of them.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from helpers import head_drafter, make_drafter
from specjax import constraints as C
from specjax import trees
from specjax.drafting import DraftConstraint, TreeDrafter, as_drafter
from specjax.generation.speculative import constrained_path, init_state

TOKENS = [bytes([97 + i % 26]) * (1 + i // 26) for i in range(511)] + [None]  # id 511: EOS
EOS = 511
TREE = trees.from_paths([(0,), (1,), (1, 0), (1, 1), (1, 0, 0)])

DRAFTERS = {
  "model": lambda t, d: (make_drafter("model", t, d), 3),
  "layer_skip": lambda t, d: (make_drafter("layer_skip", t, d), 3),
  "eagle": lambda t, d: (make_drafter("eagle", t, d), 3),
  "medusa": lambda t, d: (make_drafter("medusa", t, d), 3),
  "early_exit": lambda t, d: (make_drafter("early_exit", t, d), 3),
  "dflash": lambda t, d: (make_drafter("dflash", t, d), 3),
  "bigram": lambda t, d: (make_drafter("bigram", t, d), 3),
  "static_tree": lambda t, d: (TreeDrafter(d, TREE), len(TREE)),
  "medusa_tree": lambda t, d: (head_drafter("medusa", t).replace(tree=TREE), len(TREE)),
  "dflash_tree": lambda t, d: (make_drafter("dflash", t, d).replace(tree=TREE), len(TREE)),
  "dspark": lambda t, d: (make_drafter("dspark", t, d), 3),
  "dspark_tree": lambda t, d: (make_drafter("dspark", t, d).replace(tree=TREE), len(TREE)),
  "eagle2": lambda t, d: (head_drafter("eagle", t).replace(tree=trees.DynamicTree(5, 3, 3, 2)), 5),
}


@pytest.fixture(scope="module")
def regex():
  return C.compile_constraint(C.Regex("[a-f]{2,9}(xy|z)"), TOKENS, [EOS], 512)


def _proposal(target, drafter, gamma, rules, sampling, masked: bool):
  """One proposal after the prefill of two prompts, with or without the mask on q;
  returns the proposal and the states its path reaches `[B, g + 1]`."""
  prompts, lengths = jnp.asarray([[3, 4, 5], [6, 7, 8]], jnp.int32), jnp.asarray([3, 2])
  config = specjax.SpecConfig(gamma=gamma, max_new_tokens=8, sampling=sampling, eos_id=EOS)
  state = init_state(target, drafter, prompts, lengths, jax.random.key(3), config, rules=rules)
  rule = {"constraint": DraftConstraint(rules.table, state.constraint_state)} if masked else {}
  proposal, _ = drafter.propose(
    state.drafter_state, state.recent, jax.random.key(5), state.draft_limit,
    gamma=gamma, sampling=sampling, **rule,
  )  # fmt: skip
  path = constrained_path(rules.table, state.constraint_state, proposal.tokens, proposal.tree)
  return proposal, np.asarray(path)


# Layer skip and early exit: CachedDrafting as "model", with another model (the slow tier).
@pytest.mark.sample(*(name for name in DRAFTERS if name not in ("layer_skip", "early_exit")))
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_every_masking_drafter_proposes_only_allowed_tokens(target, draft, regex, name):
  drafter, gamma = DRAFTERS[name](target, draft)
  drafter = as_drafter(drafter)
  assert drafter.constrained_drafts
  rules = C.row_constraints([regex, regex], 512)
  forbidden_unmasked = 0
  for sampling in (specjax.GREEDY, specjax.SamplingParams(1.0)):
    proposal, path = _proposal(target, drafter, gamma, rules, sampling, masked=True)
    lengths = np.asarray(proposal.lengths)
    proposed = np.arange(gamma)[None, :] < lengths[:, None]
    assert proposed.any()
    drawn_in = _drawn_in(path, proposal.tree)
    allowed = np.asarray(C.allowed(rules.table, jnp.asarray(drawn_in)))
    live = proposed & ~_past_support(allowed, drawn_in, proposal.tree)
    assert (path[:, 1:][live] >= 0).all(), "a drafted token the constraint forbids"
    if proposal.probs is not None:  # q itself is masked: no mass on forbidden tokens
      q = np.asarray(proposal.probs)[..., :512]
      assert (q[proposed] * ~allowed[proposed]).max() == 0
    proposal, path = _proposal(target, drafter, gamma, rules, sampling, masked=False)
    forbidden_unmasked += int((path[:, 1:] < 0).sum())
  assert forbidden_unmasked > 0, "unmasked, the drafter should propose forbidden tokens"


def _past_support(allowed: np.ndarray, drawn_in: np.ndarray, tree) -> np.ndarray:
  """`[B, g]` dead tree nodes (q = 0, never accepted): a sibling rank past the
  tokens its parent's state allows (`allowed [B, g, V]`, drawn once the allowed
  ones run out), or a dead parent (`drawn_in` < 0)."""
  if tree is None:
    return np.zeros(allowed.shape[:2], bool)
  parents = np.asarray(tree.parents)  # [1, N] static, or [B, N] per row (EAGLE-2)
  ranks = np.asarray([trees.sibling_ranks(tuple(int(u) for u in row)) for row in parents])
  return (ranks >= allowed.sum(axis=-1)) | (drawn_in < 0)


def _drawn_in(path: np.ndarray, tree) -> np.ndarray:
  """`[B, g]` the state each drafted token is drawn in: a chain's previous column
  of `path`, a tree node's parent's column."""
  if tree is None:
    return path[:, :-1]
  parents = np.broadcast_to(np.asarray(tree.parents), (path.shape[0], path.shape[1] - 1))
  return np.take_along_axis(path, parents + 1, axis=1)


# Layer skip and early exit: CachedDrafting as "model", with another model (the slow tier).
@pytest.mark.sample(*(name for name in DRAFTERS if name not in ("layer_skip", "early_exit")))
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_masked_drafters_keep_greedy_constrained_output(target, draft, regex, name):
  drafter, gamma = DRAFTERS[name](target, draft)
  rules = C.row_constraints([regex, None], 512)
  prompts, lengths = jnp.asarray([[3, 4, 5], [6, 7, 8]], jnp.int32), jnp.asarray([3, 2])
  run = dict(max_new_tokens=10, sampling=specjax.GREEDY, eos_id=EOS, constraints=rules)
  plain = specjax.autoregressive_generate(target, prompts, lengths, **run)
  spec = specjax.speculative_generate(target, drafter, prompts, lengths, gamma=gamma, **run)
  np.testing.assert_array_equal(spec.tokens, plain.tokens)


def test_the_target_drafting_for_itself_is_always_accepted_under_a_constraint(target, regex):
  """q = p after the same mask: every greedy draft is the constrained argmax."""
  rules = C.row_constraints([regex, regex], 512)
  prompts, lengths = jnp.asarray([[3, 4, 5], [6, 7, 8]], jnp.int32), jnp.asarray([3, 3])
  out = specjax.speculative_generate(
    target, target, prompts, lengths, gamma=3, max_new_tokens=10, sampling=specjax.GREEDY,
    eos_id=EOS, constraints=rules,
  )  # fmt: skip
  assert float(out.stats.acceptance_rate) == 1.0
