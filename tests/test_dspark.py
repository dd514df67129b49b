"""The sequential block drafter (DSpark, issue 64 requirements 1, 2 and 4): its
settings; each drafted law is the block's corrected by the token drafted before it
(and a fresh head drafts what its backbone drafts); greedy output equals plain
greedy decoding, with the confidence-driven draft length too; the target's own law
at V = 8 under token and block verification, chains and trees whose children follow
their parent (chi-square); the objective trains the two heads alone on a frozen
backbone; calibration's reliability data.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_distribution import NEW, PROMPT, ROWS, chi_square_pvalue, exact_joint

import specjax
from helpers import TINY, dspark_drafter
from specjax import heads
from specjax.heads import HeadConfig
from specjax.heads import config as head_config
from specjax.heads.dflash import DFlashDrafter
from specjax.heads.dspark import OWN_PARAMS, DSparkDrafter, DSparkLoss, calibration
from specjax.training.heads import objective

CFG = specjax.ModelConfig(**TINY).replace(init_std=0.1)


def test_settings_round_trip_and_refusals():
  cfg = head_config("dspark", CFG, block_size=4, draft_layers=2, markov_rank=8)
  assert HeadConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
  for field, bad, message in [
    ("markov_rank", -1, r"markov_rank must be an int in \[0, 1024\]"),
    ("block_size", 1, r"block_size must be an int in \[2, 64\]"),
    (
      "confidence_head",
      1,
      r"confidence_head, confidence_with_markov, anchor_first, correct_first must be bools",
    ),
  ]:
    with pytest.raises(ValueError, match=message):
      head_config("dspark", CFG, **{field: bad})
  bare = heads.make_head(
    head_config("dspark", CFG, markov_rank=0, confidence_head=False), rngs=nnx.Rngs(0)
  )
  assert not hasattr(bare, "markov_w1") and not hasattr(bare, "confidence_hidden")


def test_each_law_is_corrected_by_the_token_before_it(target):
  """q_i = warp(l_i + W2 W1[token i - 1]) with l_i the block call's base logits; and a
  fresh head (W2 = 0) proposes exactly what a block drafter of its parameters does."""
  drafter = dspark_drafter(target)
  head, sampling = drafter.head, specjax.SamplingParams(temperature=1.0)
  prompts = jnp.asarray([[5, 9, 2, 7]], jnp.int32)
  state = _init(drafter, target, prompts)
  recent, key = prompts[:, -2:], jax.random.key(3)
  proposal, _ = drafter.propose(state, recent, key, jnp.array([3]), gamma=3, sampling=sampling)
  base = head.draft_logits(target, state.cache, recent[:, -1], count=3)
  previous = jnp.concatenate([recent[:, -1:], proposal.tokens[:, :-1]], axis=1)
  bias = head.markov_embed(previous) @ head.markov_w2[...]
  want = jax.nn.softmax(base + bias, axis=-1)
  np.testing.assert_allclose(proposal.probs, want, rtol=1e-5, atol=1e-6)
  assert proposal.confidence.shape == (1, 3)
  assert np.all((proposal.confidence > 0) & (proposal.confidence < 1))
  # correct_first=False: the first law is the block's own, the later ones corrected.
  cfg = dataclasses.replace(head.cfg, correct_first=False)
  graphdef = nnx.graphdef(heads.make_head(cfg, rngs=nnx.Rngs(0)))
  plain_first = drafter.replace(head=nnx.merge(graphdef, nnx.state(head)))
  other, _ = plain_first.propose(state, recent, key, jnp.array([3]), gamma=3, sampling=sampling)
  previous = jnp.concatenate([recent[:, -1:], other.tokens[:, :-1]], axis=1)
  bias = (head.markov_embed(previous) @ head.markov_w2[...]).at[:, 0].set(0.0)
  want = jax.nn.softmax(base + bias, axis=-1)
  np.testing.assert_allclose(other.probs, want, rtol=1e-5, atol=1e-6)
  # W2 = 0: the backbone's block drafter, token for token.
  fresh = heads.drafter(target, heads.make_head(drafter.head.cfg, rngs=nnx.Rngs(7)))
  block = DFlashDrafter(target, fresh.head)
  a, _ = fresh.propose(state, recent, key, jnp.array([3]), gamma=3, sampling=sampling)
  b, _ = block.propose(state, recent, key, jnp.array([3]), gamma=3, sampling=sampling)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_allclose(a.probs, b.probs, rtol=1e-6)


def _init(drafter, target, prompts):
  lengths = jnp.full((prompts.shape[0],), prompts.shape[1], jnp.int32)
  cache = target.init_cache(prompts.shape[0], 16)
  _, _, hidden = target.forward_cached(prompts, cache, return_hidden=drafter.target_features)
  return drafter.init(prompts, lengths, prompts[:, -1], 16, hidden=hidden)


@pytest.mark.sample("sample-3", "confidence-3", "anchor_first-4")  # argmax: the slow tier
@pytest.mark.parametrize(
  "draft, gamma, adaptive, anchor_first",
  [("sample", 3, None, False), ("argmax", 2, None, False), ("sample", 3, "confidence", False)]
  + [("sample", 4, None, True)],
  ids=["sample-3", "argmax-2", "confidence-3", "anchor_first-4"],
)
def test_greedy_equals_plain_greedy(
  target, prompts, greedy_reference, draft, gamma, adaptive, anchor_first
):
  """Anchor-first (DeepSpec's alignment): a block of 4 drafts 4 tokens."""
  drafter = dspark_drafter(target, anchor_first=anchor_first).replace(draft=draft)
  settings = dict(adaptive=adaptive, confidence_threshold=0.3) if adaptive else {}
  out = specjax.speculative_generate(
    target, drafter, *prompts, gamma=gamma, max_new_tokens=16, sampling=specjax.GREEDY, **settings
  )
  np.testing.assert_array_equal(out.tokens, greedy_reference.tokens)
  stats = out.stats
  assert int(stats.draft_calls) == int(stats.iterations) + 1  # one head call per iteration
  rows = int(np.sum(stats.row_iterations))
  if adaptive:  # the survival cut some rows' drafts short
    assert 0 < np.sum(stats.proposed) < gamma * rows
  else:
    assert np.sum(stats.proposed) == gamma * rows


def _small():
  cfg = specjax.ModelConfig(
    vocab_size=8, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=16,
    init_std=0.4,
  )  # fmt: skip
  return specjax.Transformer(cfg, rngs=nnx.Rngs(0))


@pytest.mark.sample("token-sample", "tree-wor")
@pytest.mark.parametrize(
  "verifier, draft, sampling, tree",
  [
    ("token", "sample", specjax.SamplingParams(temperature=1.0), None),
    ("block", "sample", specjax.SamplingParams(temperature=0.9, top_k=6), None),
    ("token", "argmax", specjax.SamplingParams(temperature=1.0), None),
    ("token", "sample", specjax.SamplingParams(temperature=1.0), "confidence"),
    ("auto", "sample", specjax.SamplingParams(temperature=1.0), "without_replacement"),
    ("auto", "sample", specjax.SamplingParams(temperature=0.8, top_p=0.9), "iid"),
  ],
  ids=[
    "token-sample", "block-sample-top_k", "token-argmax", "token-confidence", "tree-wor",
    "tree-iid-top_p",
  ],
)  # fmt: skip
def test_sampled_verification_keeps_the_target_law(verifier, draft, sampling, tree):
  """V = 8, a random Markov head: each law depends on the token before it (a tree
  node's children on the node's token); verification keeps the target's joint law, also
  when each row drafts only while its survival holds (a stopping rule: whether token i
  is drafted depends on the tokens before it)."""
  target = _small()
  drafter = dspark_drafter(target, seed=2, block_size=4, markov_rank=4).replace(draft=draft)
  gamma = 3
  if tree == "confidence":
    drafter, tree = drafter.with_confidence(0.2), None
  if tree:
    parents = specjax.trees.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    drafter, gamma = drafter.replace(tree=parents, tree_mode=tree), len(parents)
  spec = specjax.speculative_generate(
    target,
    drafter,
    jnp.tile(PROMPT, (ROWS, 1)),
    jnp.full((ROWS,), len(PROMPT), jnp.int32),
    gamma=gamma,
    max_new_tokens=NEW,
    sampling=sampling,
    key=jax.random.key(101),
    verifier=verifier,
  )
  accepted = np.asarray(spec.stats.accepted_at_position)
  assert 0 < accepted[0] < ROWS, accepted  # verification really decides
  assert chi_square_pvalue(spec.tokens, exact_joint(target, sampling)) > 1e-3


@pytest.mark.sample("last_layer")  # the frozen case in the slow tier
@pytest.mark.parametrize("train_only", [(), ("layers.1", "norm")], ids=["frozen", "last_layer"])
def test_frozen_backbone_gets_no_gradient_and_calibration_reports(target, train_only):
  """train_backbone=False: only the Markov and confidence heads have gradients (and the
  backbone's parameters under `train_only`); the loss carries the confidence term;
  calibration gives per-position and binned data."""
  drafter = dspark_drafter(target)
  graphdef, params = nnx.split(drafter.head, nnx.Param)
  batch = jax.random.randint(jax.random.key(0), (2, 17), 0, 512)
  settings = DSparkLoss(
    num_anchors=4, loss_decay=4.0, confidence_weight=1.0, train_backbone=False,
    train_only=train_only,
  )  # fmt: skip
  grads, metrics = jax.grad(
    lambda p: objective(p, batch, target, jax.random.key(1), graphdef=graphdef, settings=settings),
    has_aux=True,
  )(params)
  for path, g in nnx.to_flat_state(grads):
    moving = float(jnp.abs(g.get_value()).max()) > 0
    own = path[0] in OWN_PARAMS or path[:2] == ("layers", 1) or path[0] == "norm"
    assert moving == (own if train_only else path[0] in OWN_PARAMS), path
  for name in ("confidence_bce", "confidence_mean", "accept_mean", "base_alpha_t0_pos1"):
    assert np.isfinite(float(metrics[name])), name
  report = calibration(drafter.head, target, batch, num_anchors=4, bins=5)
  assert [p["position"] for p in report["positions"]] == [1, 2, 3]
  assert sum(b["count"] for b in report["bins"]) == sum(p["count"] for p in report["positions"])
  assert 0 <= report["ece"] <= 1


def test_a_dspark_drafter_is_a_block_drafter_with_confidence(target):
  drafter = dspark_drafter(target)
  assert isinstance(drafter, DSparkDrafter) and drafter.block_size == 4
  assert drafter.with_confidence(0.5).confidence == 0.5
  with pytest.raises(ValueError, match=r"confidence_threshold must be in \(0, 1\]"):
    drafter.with_confidence(0.0)
