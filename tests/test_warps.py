"""Penalties, logit bias, min-p and stop settings as warps (issue 65, requirement 1).

The warp at each position reads the row's text up to it, drafted tokens included
(`TokenHistory.along`): the speculative rules keep the target's law of the first
three tokens with every warp on (chi-square on V = 8, as tests/test_distribution.py),
greedy speculation gives plain greedy decoding, coupled speculation the plain
coupled text, and the stop settings stop rows where they should.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from helpers import chisquare_pvalue, sequence_counts, tiny_pair
from specjax.sampling import RowSampling, TokenHistory

V, ROWS, NEW = 8, 20_000, 3
PROMPT = jnp.array([1, 5, 2, 7], jnp.int32)

# Every warp that reads the text, on at once (temperature above 1 keeps the law wide).
WARPED = specjax.SamplingParams(
  temperature=1.2,
  presence_penalty=0.6,
  frequency_penalty=0.8,
  repetition_penalty=1.5,
  logit_bias={3: 1.5, 6: -2.0},
  min_p=0.05,
)


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
  draft = specjax.Transformer(cfg, rngs=nnx.Rngs(1))
  params = nnx.state(target, nnx.Param)
  noise = nnx.state(draft, nnx.Param)
  nnx.update(draft, jax.tree.map(lambda p, n: p + 0.6 * n, params, noise))
  return target, draft


@jax.jit
def _warped(target, seqs, sampling):
  """Each sequence's warped laws of its last three tokens, each read with the
  generated tokens before it (the prompt: the first len(PROMPT) ids)."""
  n = len(PROMPT)
  logits = target(seqs)[:, n - 1 :]  # [S, 3, V], before t1, t2, t3
  generated = seqs[:, n:]  # [S, 2]
  history = TokenHistory.of_prompts(
    seqs[:, :n], jnp.full((seqs.shape[0],), n, jnp.int32), V
  ).along(generated)
  return specjax.warp_probs(logits, sampling.with_history(history, None))


def exact_joint(target, params):
  """`[V, V, V]` law of the first three tokens under `params`, from full forwards
  and the penalties of each prefix."""
  pairs = jnp.array(list(itertools.product(range(V), repeat=2)), jnp.int32)
  seqs = jnp.concatenate([jnp.tile(PROMPT, (V * V, 1)), pairs], axis=1)
  probs = np.asarray(_warped(target, seqs, RowSampling.of(params, V * V)), np.float64)
  p1 = probs[0, 0]
  p2 = probs[::V, 1].reshape(V, V)
  p3 = probs[:, 2].reshape(V, V, V)
  return p1[:, None, None] * p2[:, :, None] * p3


def pvalue(tokens, joint):
  return chisquare_pvalue(sequence_counts(tokens, V), joint)


def _rows():
  return jnp.tile(PROMPT, (ROWS, 1)), jnp.full((ROWS,), len(PROMPT), jnp.int32)


def test_the_warp_changes_the_law(pair):
  """The harness sees the penalties: the warped law is not the plain one."""
  target, _ = pair
  warped = exact_joint(target, WARPED)
  plain = exact_joint(target, specjax.SamplingParams(temperature=1.2))
  assert np.abs(warped - plain).sum() > 0.2
  # Plain decoding follows the warped law (the harness itself is right).
  prompts, lengths = _rows()
  ar = specjax.autoregressive_generate(
    target, prompts, lengths, max_new_tokens=NEW, sampling=WARPED, key=jax.random.key(1)
  )
  assert pvalue(ar.tokens, warped) > 1e-3
  assert pvalue(ar.tokens, plain) < 1e-6


TREE = specjax.trees.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)])


@pytest.mark.parametrize("rule", ["token", "block", "tree", "coupled"])
def test_speculative_rules_keep_the_warped_law(pair, rule):
  """Chain drafts (the draft model advances its counts along the chain) under the
  token and block rules, a token tree (whose drafter warps q with the committed
  counts only: still exact, q is the law it drew from) and the coupled rule
  (per-row keys; equal to plain coupled decoding) follow the warped law."""
  target, draft = pair
  prompts, lengths = _rows()
  joint = exact_joint(target, WARPED)
  run = dict(max_new_tokens=NEW, sampling=WARPED)
  if rule == "tree":
    drafter = specjax.drafting.TreeDrafter(draft, TREE, tree_mode="without_replacement")
    spec = specjax.speculative_generate(
      target, drafter, prompts, lengths, gamma=len(TREE), key=jax.random.key(3), **run
    )
  elif rule == "coupled":
    keys = jax.random.split(jax.random.key(4), ROWS)
    spec = specjax.speculative_generate(
      target, draft, prompts, lengths, gamma=2, key=keys, verifier="coupled", **run
    )
    ar = specjax.autoregressive_generate(target, prompts, lengths, key=keys, **run)
    np.testing.assert_array_equal(spec.tokens, ar.tokens)
  else:
    spec = specjax.speculative_generate(
      target, draft, prompts, lengths, gamma=2, key=jax.random.key(5), verifier=rule, **run
    )
  accepted = np.asarray(spec.stats.accepted_at_position)
  assert 0 < accepted[0] < ROWS, accepted  # verification really decides
  assert pvalue(spec.tokens, joint) > 1e-3
