"""Full models: speculative sampling has the target's own law, for every warp.

On a vocabulary of 8 the exact joint law of the first three generated tokens is
computed from the target's full forward (8 x 8 continuations), and 20,000
independent rows of `speculative_generate` (and, as a check of the harness, of
`autoregressive_generate`) are compared with it by a chi-square test.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from helpers import chisquare_pvalue, make_drafter, sequence_counts, word_tokenizer

V, ROWS, NEW = 8, 20_000, 3
PROMPT = jnp.array([1, 5, 2, 7], jnp.int32)


@pytest.fixture(scope="module")
def pair():
  cfg = specjax.ModelConfig(
    vocab_size=V,
    d_model=32,
    n_layers=2,
    n_heads=2,
    n_kv_heads=1,
    d_ff=64,
    max_seq_len=16,
    init_std=0.4,
  )
  target = specjax.Transformer(cfg, rngs=nnx.Rngs(0))
  # The draft is the target with heavy noise: it agrees often, not always, so
  # both acceptance and the residual correction are exercised.
  draft = specjax.Transformer(cfg, rngs=nnx.Rngs(1))
  params = nnx.state(target, nnx.Param)
  noise = nnx.state(draft, nnx.Param)
  nnx.update(draft, jax.tree.map(lambda p, n: p + 0.6 * n, params, noise))
  return target, draft


@functools.partial(jax.jit, static_argnames="sampling")
def _warped(target, seqs, sampling):
  """`warp_probs(target(seqs), sampling)` as one program (eagerly, each of its
  operations compiles on its own)."""
  return specjax.warp_probs(target(seqs), sampling)


def exact_joint(target, sampling, prompt=PROMPT):
  """`[V, V, V]` law of the first three tokens under `sampling`, from full forwards."""
  pairs = jnp.array(list(itertools.product(range(V), repeat=2)), jnp.int32)  # [V*V, 2]
  seqs = jnp.concatenate([jnp.tile(prompt, (V * V, 1)), pairs], axis=1)
  probs = np.asarray(_warped(target, seqs, sampling), np.float64)
  n = len(prompt)
  p1 = probs[0, n - 1]  # same for every row
  p2 = probs[::V, n].reshape(V, V)  # [t1, t2]
  p3 = probs[:, n + 1].reshape(V, V, V)  # [t1, t2, t3]
  return p1[:, None, None] * p2[:, :, None] * p3


def chi_square_pvalue(tokens, joint):
  return chisquare_pvalue(sequence_counts(tokens, V), joint)


@pytest.mark.sample("temperature")  # top-k and top-p: the head drafters' test
@pytest.mark.parametrize(
  "sampling",
  [
    specjax.SamplingParams(temperature=1.0),
    specjax.SamplingParams(temperature=0.7, top_k=3),
    specjax.SamplingParams(temperature=1.0, top_p=0.8),
  ],
  ids=["temperature", "top_k", "top_p"],
)
def test_speculative_sampling_matches_target_law(pair, sampling):
  target, draft = pair
  joint = exact_joint(target, sampling)
  prompts = jnp.tile(PROMPT, (ROWS, 1))
  lengths = jnp.full((ROWS,), len(PROMPT), jnp.int32)
  spec = specjax.speculative_generate(
    target,
    draft,
    prompts,
    lengths,
    gamma=2,
    max_new_tokens=NEW,
    sampling=sampling,
    key=jax.random.key(11),
  )
  ar = specjax.autoregressive_generate(
    target, prompts, lengths, max_new_tokens=NEW, sampling=sampling, key=jax.random.key(12)
  )
  rate = float(spec.stats.acceptance_rate)
  assert 0.1 < rate < 0.95, f"draft should agree sometimes, not always: {rate}"
  assert chi_square_pvalue(ar.tokens, joint) > 1e-3  # the harness itself is right
  assert chi_square_pvalue(spec.tokens, joint) > 1e-3


def test_coupled_sampling_matches_target_law(pair):
  """The coupled verifier (per-row keys, Gumbel-max) and the coupled plain
  sampler each have the target's law; speculative rows equal plain rows."""
  target, draft = pair
  sampling = specjax.SamplingParams(temperature=0.7, top_k=5)
  joint = exact_joint(target, sampling)
  prompts = jnp.tile(PROMPT, (ROWS, 1))
  lengths = jnp.full((ROWS,), len(PROMPT), jnp.int32)
  keys = jax.random.split(jax.random.key(15), ROWS)
  run = dict(max_new_tokens=NEW, sampling=sampling, key=keys)
  spec = specjax.speculative_generate(target, draft, prompts, lengths, gamma=2, **run)
  ar = specjax.autoregressive_generate(target, prompts, lengths, **run)
  assert 0.1 < float(spec.stats.acceptance_rate) < 0.95
  assert chi_square_pvalue(ar.tokens, joint) > 1e-3
  np.testing.assert_array_equal(spec.tokens, ar.tokens)


MIXED = [
  specjax.GREEDY,
  specjax.SamplingParams(temperature=1.0),
  specjax.SamplingParams(temperature=0.7, top_k=3),
  specjax.SamplingParams(temperature=1.3, top_k=5, top_p=0.8),
]


@pytest.mark.slow
def test_mixed_row_settings_in_one_batch_follow_each_rows_law(pair):
  """Per-row settings (`RowSampling`): greedy and three warps interleaved in one
  batch. Each group of rows has its own warp's law (chi-square), greedy rows are
  exactly the target's greedy output, in both generation loops."""
  target, draft = pair
  prompts = jnp.tile(PROMPT, (ROWS, 1))
  lengths = jnp.full((ROWS,), len(PROMPT), jnp.int32)
  rows = specjax.RowSampling.of([MIXED[i % len(MIXED)] for i in range(ROWS)])
  spec = specjax.speculative_generate(
    target, draft, prompts, lengths, gamma=2, max_new_tokens=NEW, sampling=rows,
    key=jax.random.key(13),
  )  # fmt: skip
  ar = specjax.autoregressive_generate(
    target, prompts, lengths, max_new_tokens=NEW, sampling=rows, key=jax.random.key(14)
  )
  outputs = {"speculative": spec.tokens, "autoregressive": ar.tokens}
  greedy = specjax.autoregressive_generate(
    target, PROMPT[None], jnp.array([len(PROMPT)]), max_new_tokens=NEW, sampling=specjax.GREEDY
  ).tokens
  for name, tokens in outputs.items():
    tokens = np.asarray(tokens)
    np.testing.assert_array_equal(tokens[0 :: len(MIXED)], np.tile(greedy, (ROWS // 4, 1)))
    for i, sampling in enumerate(MIXED[1:], start=1):
      pvalue = chi_square_pvalue(tokens[i :: len(MIXED)], exact_joint(target, sampling))
      assert pvalue > 1e-3, f"{name}, rows with {sampling}: p = {pvalue:.2g}"
  # The groups differ: the test would catch rows warped with another row's settings.
  top_k_rows = np.asarray(spec.tokens)[2 :: len(MIXED)]
  assert chi_square_pvalue(top_k_rows, exact_joint(target, MIXED[1])) < 1e-6


def test_harness_detects_a_wrong_law(pair):
  """The same test rejects the draft's own law (what an inexact verifier tends to)."""
  target, draft = pair
  sampling = specjax.SamplingParams(temperature=1.0)
  prompts = jnp.tile(PROMPT, (ROWS, 1))
  lengths = jnp.full((ROWS,), len(PROMPT), jnp.int32)
  wrong = specjax.autoregressive_generate(
    draft, prompts, lengths, max_new_tokens=NEW, sampling=sampling, key=jax.random.key(12)
  )
  assert chi_square_pvalue(wrong.tokens, exact_joint(target, sampling)) < 1e-6


@pytest.mark.sample(1)
@pytest.mark.parametrize("draft_vocab", [6, 11])
def test_draft_with_another_vocabulary_size_stays_exact(pair, draft_vocab):
  """A draft lacking ids 6-7 (q = 0 there), or with ids 8-10 the target lacks (p = 0)."""
  target, _ = pair
  cfg = target.cfg.replace(vocab_size=draft_vocab)
  draft = specjax.Transformer(cfg, rngs=nnx.Rngs(5))
  sampling = specjax.SamplingParams(temperature=1.0)
  prompts = jnp.tile(PROMPT % min(V, draft_vocab), (ROWS, 1))
  lengths = jnp.full((ROWS,), len(PROMPT), jnp.int32)
  spec = specjax.speculative_generate(
    target,
    draft,
    prompts,
    lengths,
    gamma=2,
    max_new_tokens=NEW,
    sampling=sampling,
    key=jax.random.key(13),
  )
  assert 0.05 < float(spec.stats.acceptance_rate) < 0.95
  assert int(np.max(spec.tokens)) < V
  joint = exact_joint(target, sampling, prompt=PROMPT % min(V, draft_vocab))
  assert chi_square_pvalue(spec.tokens, joint) > 1e-3


@pytest.mark.sample("model-block-None", "ngram-token-None")
@pytest.mark.parametrize(
  "name, verifier, adaptive",
  [
    ("model", "block", None),
    ("ngram", "token", None),
    ("ngram", "block", None),
    ("layer_skip", "token", None),
    ("layer_skip", "block", None),
    ("unigram", "token", None),
    ("bigram", "block", None),
    ("model", "token", "schedule"),
    ("model", "block", "confidence"),
    ("model_one_width", "token", None),
    ("model_one_width", "block", "confidence"),
  ],
)
def test_every_drafter_and_verifier_is_exact(pair, name, verifier, adaptive):
  """Each sampling drafter x {token, block} verification (and both adaptive draft
  lengths) reproduces the target's law of the first three tokens."""
  target, draft = pair
  sampling = specjax.SamplingParams(temperature=1.0)
  prompts = jnp.tile(PROMPT, (ROWS, 1))
  lengths = jnp.full((ROWS,), len(PROMPT), jnp.int32)
  spec = specjax.speculative_generate(
    target,
    make_drafter(name, target, draft, max_ngram=2),
    prompts,
    lengths,
    gamma=2,
    max_new_tokens=NEW,
    sampling=sampling,
    key=jax.random.key(22),
    verifier=verifier,
    adaptive=adaptive,
    confidence_threshold=0.6,
  )
  stats = spec.stats
  assert 0.05 < float(stats.acceptance_rate) < 0.95  # verification really decides
  if adaptive == "confidence":
    # The threshold bites: some rows propose fewer than gamma tokens.
    assert 0 < np.sum(stats.proposed) < 2 * np.sum(stats.row_iterations)
  assert chi_square_pvalue(spec.tokens, exact_joint(target, sampling)) > 1e-3


@pytest.mark.sample("eagle_subset-block")
@pytest.mark.parametrize(
  "name, verifier",
  [("eagle", "token"), ("medusa", "block"), ("early_exit", "token"), ("eagle_subset", "block")],
)
def test_head_drafters_are_exact_with_top_k_and_top_p(pair, name, verifier):
  """Drafters that read the target's features (fresh heads: they agree sometimes)
  keep the target's law under a top-k and top-p warp."""
  target, draft = pair
  sampling = specjax.SamplingParams(temperature=1.0, top_k=6, top_p=0.9)
  prompts = jnp.tile(PROMPT, (ROWS, 1))
  lengths = jnp.full((ROWS,), len(PROMPT), jnp.int32)
  spec = specjax.speculative_generate(
    target,
    make_drafter(name, target, draft),
    prompts,
    lengths,
    gamma=2,
    max_new_tokens=NEW,
    sampling=sampling,
    key=jax.random.key(23),
    verifier=verifier,
  )
  assert 0.05 < float(spec.stats.acceptance_rate) < 0.95
  assert chi_square_pvalue(spec.tokens, exact_joint(target, sampling)) > 1e-3


# Depth 2, three children of the root, two under the first: under a top-k = 2 warp
# the third child of the root is past q's support (a dead node) in without-
# replacement mode, and i.i.d. siblings repeat tokens.
TREE = specjax.trees.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)])


@pytest.mark.sample("eagle2_wor_top_p", "dflash_wor_top_k")
@pytest.mark.parametrize(
  "name, mode, sampling",
  [
    ("model", "iid", specjax.SamplingParams(temperature=1.0)),
    ("model", "without_replacement", specjax.SamplingParams(temperature=0.8, top_k=2)),
    ("medusa", "iid", specjax.SamplingParams(temperature=1.0)),
    ("eagle2", "without_replacement", specjax.SamplingParams(temperature=1.0, top_p=0.9)),
    ("dflash", "without_replacement", specjax.SamplingParams(temperature=0.9, top_k=4)),
    ("dflash", "iid", specjax.SamplingParams(temperature=1.0)),
  ],
  ids=[
    "model_iid",
    "model_wor_top_k",
    "medusa_iid",
    "eagle2_wor_top_p",
    "dflash_wor_top_k",
    "dflash_iid",
  ],
)
def test_tree_drafting_matches_target_law(pair, name, mode, sampling):
  """Token trees (the draft model, Medusa heads, the block drafter; EAGLE-2's trees,
  which differ per row) drafted and verified in both sibling modes keep the
  target's law of the first three tokens."""
  target, draft = pair
  tree = TREE
  if name == "model":
    drafter = specjax.drafting.TreeDrafter(draft, TREE, tree_mode=mode)
  else:
    if name == "eagle2":  # 6 of 2 + 3 x 2 x 2 candidates, per row
      name, tree = "eagle", specjax.trees.DynamicTree(size=6, depth=3, branch=2, expand=2)
    drafter = make_drafter(name, target, draft).replace(tree=tree, tree_mode=mode)
  prompts = jnp.tile(PROMPT, (ROWS, 1))
  lengths = jnp.full((ROWS,), len(PROMPT), jnp.int32)
  spec = specjax.speculative_generate(
    target,
    drafter,
    prompts,
    lengths,
    gamma=6,
    max_new_tokens=NEW,
    sampling=sampling,
    key=jax.random.key(31),
  )
  # Verification really decides: some first iterations keep a node, some none.
  accepted = np.asarray(spec.stats.accepted_at_position)
  assert 0 < accepted[0] < ROWS, accepted
  assert chi_square_pvalue(spec.tokens, exact_joint(target, sampling)) > 1e-3


@pytest.mark.sample("token")
@pytest.mark.parametrize("verifier", ["token", "block"])
def test_cross_tokenizer_drafting_matches_target_law(pair, verifier):
  """TLI with a draft whose tokenizer shares "a", "b", "ab", "ca" with the
  target's (same ids) and has "x", "y", "xy" of its own; the target's "c", "bc",
  "abc" are spelled from draft ids (the draft lacks "c": fed as its first
  special). q is the draft's law restricted to the shared ids."""
  target, draft = pair
  specials = ["<eos>"]
  target_tok = word_tokenizer(["<eos>", "a", "b", "c", "ab", "bc", "ca", "abc"], specials)
  draft_tok = word_tokenizer(["<eos>", "a", "b", "x", "ab", "y", "ca", "xy"], specials)
  drafter = specjax.drafting.CrossTokenizerDrafter(draft, draft_tok, target_tok)
  assert drafter.shared == 4 and drafter.max_expansion == 2
  sampling = specjax.SamplingParams(temperature=1.0)
  spec = specjax.speculative_generate(
    target,
    drafter,
    jnp.tile(PROMPT, (ROWS, 1)),
    jnp.full((ROWS,), len(PROMPT), jnp.int32),
    gamma=2,
    max_new_tokens=NEW,
    sampling=sampling,
    key=jax.random.key(21),
    verifier=verifier,
  )
  rate = float(spec.stats.acceptance_rate)
  # The restricted law agrees less often (half the ids are not shared).
  assert 0.03 < rate < 0.95, f"draft should agree sometimes, not always: {rate}"
  assert chi_square_pvalue(spec.tokens, exact_joint(target, sampling)) > 1e-3
