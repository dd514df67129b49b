"""The block drafter (DFlash, issue 46 requirement 2): its settings, one head call per
iteration, greedy output identical to plain greedy decoding (argmax and sampled
drafts, a learned mask embedding and a vocabulary id, every gamma up to B - 1), and
the target's own law under token and block verification at V = 8 (chi-square).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_distribution import NEW, PROMPT, ROWS, chi_square_pvalue, exact_joint

import specjax
from helpers import TINY
from specjax.heads import HeadConfig, make_head
from specjax.heads import config as head_config
from specjax.heads.dflash import DFlashDrafter, dflash_feature_layers

CFG = specjax.ModelConfig(**TINY).replace(init_std=0.1)


def _drafter(target, seed=1, draft="sample", **settings):
  cfg = head_config("dflash", target.cfg, **{"block_size": 4, "draft_layers": 2, **settings})
  return DFlashDrafter(target, make_head(cfg, rngs=nnx.Rngs(seed)), draft=draft)


def test_settings_defaults_and_refusals():
  assert dflash_feature_layers(36, 5) == (2, 10, 18, 26, 34)  # ids 1, 9, 17, 25, 33 (Qwen3-8B)
  assert dflash_feature_layers(6, 2) == (2, 4)
  assert dflash_feature_layers(6, 1) == (4,)
  assert head_config("dflash", CFG, draft_layers=2).feature_layers == (1, 2)  # L = 2: both
  cfg = head_config("dflash", CFG, block_size=8, draft_layers=2, mask_token_id=7)
  assert HeadConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
  assert cfg.target_features == (1, 2)
  for field, bad, message in [
    ("block_size", 1, r"block_size must be an int in \[2, 64\]"),
    ("draft_layers", 0, r"draft_layers must be an int in \[1, 16\]"),
    ("mask_token_id", 512, r"mask_token_id must be an int in \[0, 512\) or -1"),
    ("feature_layers", (3,), r"feature_layers must be distinct layer counts in \[1, 2\]"),
  ]:
    with pytest.raises(ValueError, match=message):
      head_config("dflash", CFG, **{field: bad})
  head = make_head(head_config("dflash", CFG, mask_token_id=7), rngs=nnx.Rngs(0))
  assert not hasattr(head, "mask_embedding")  # a vocabulary id: the target's embedding
  with pytest.raises(ValueError, match="draft must be one of"):
    DFlashDrafter(specjax.Transformer(CFG, rngs=nnx.Rngs(0)), head, draft="beam")


def test_gamma_past_the_block_is_refused_before_compiling(target, prompts):
  with pytest.raises(ValueError, match=r"gamma must be in \[1, 3\] for a block drafter"):
    specjax.speculative_generate(target, _drafter(target), *prompts, gamma=4, max_new_tokens=4)


@pytest.mark.sample("sample-learned-3")
@pytest.mark.parametrize(
  "draft, mask_token_id, gamma",
  [("sample", -1, 3), ("argmax", 5, 2), ("sample", 5, 1)],
  ids=["sample-learned-3", "argmax-id-2", "sample-id-1"],
)
def test_greedy_equals_plain_greedy_with_one_head_call_per_iteration(
  target, prompts, greedy_reference, draft, mask_token_id, gamma
):
  drafter = _drafter(target, draft=draft, mask_token_id=mask_token_id)
  out = specjax.speculative_generate(
    target, drafter, *prompts, gamma=gamma, max_new_tokens=16, sampling=specjax.GREEDY
  )
  np.testing.assert_array_equal(out.tokens, greedy_reference.tokens)
  stats = out.stats
  assert int(stats.draft_calls) == int(stats.iterations) + 1  # the prefill, then one per iteration
  assert np.sum(stats.proposed) == gamma * int(np.sum(stats.row_iterations)) > 0


@pytest.mark.sample("token-sample")  # the other cases in the slow tier
@pytest.mark.parametrize(
  "verifier, draft, sampling",
  [
    ("token", "sample", specjax.SamplingParams(temperature=1.0)),
    ("token", "argmax", specjax.SamplingParams(temperature=1.0)),
    ("block", "sample", specjax.SamplingParams(temperature=1.0, top_k=6, top_p=0.9)),
  ],
  ids=["token-sample", "token-argmax", "block-sample-top_k_top_p"],
)
def test_sampled_verification_keeps_the_target_law(verifier, draft, sampling):
  """V = 8: each drafted token's law ignores the drafts before it, still a law for it
  given them; token and block verification give the target's joint law."""
  cfg = specjax.ModelConfig(
    vocab_size=8, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=16,
    init_std=0.4,
  )  # fmt: skip
  target = specjax.Transformer(cfg, rngs=nnx.Rngs(0))
  spec = specjax.speculative_generate(
    target,
    _drafter(target, seed=2, draft=draft, block_size=3),
    jnp.tile(PROMPT, (ROWS, 1)),
    jnp.full((ROWS,), len(PROMPT), jnp.int32),
    gamma=2,
    max_new_tokens=NEW,
    sampling=sampling,
    key=jax.random.key(101),
    verifier=verifier,
  )
  accepted = np.asarray(spec.stats.accepted_at_position)
  assert 0 < accepted[0] < ROWS, accepted  # verification really decides
  assert chi_square_pvalue(spec.tokens, exact_joint(target, sampling)) > 1e-3


def test_fr_spec_drafts_among_the_subset_and_keeps_greedy_output(target, prompts, greedy_reference):
  drafter = _drafter(target).with_vocab_subset(np.arange(0, 512, 2))
  state_key = jax.random.key(0)
  out = specjax.speculative_generate(
    target, drafter, *prompts, gamma=3, max_new_tokens=16, sampling=specjax.GREEDY, key=state_key
  )
  np.testing.assert_array_equal(out.tokens, greedy_reference.tokens)
  logits = drafter.head.draft_logits(
    target, drafter.head.init_cache(1, 8), jnp.array([3]), drafter.vocab_subset
  )
  assert np.isneginf(np.asarray(logits)[..., 1::2]).all()
  assert np.isfinite(np.asarray(logits)[..., ::2]).all()
