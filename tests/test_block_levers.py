"""The block drafters' levers (issue 74): target features from every depth, the
acceptance-shaped loss, and warm starts that keep what a drafter drafted.

The target is the TINY config (2 layers) with peaked weights; the drafters have
blocks of 4 and 2 layers.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from helpers import TINY
from specjax.heads import blocks, dflash, dspark, make_head
from specjax.heads import config as head_config
from specjax.heads.dflash import block_feature_layers

CFG = specjax.ModelConfig(**{**TINY, "init_std": 0.1})
DEEP = specjax.ModelConfig(**{**TINY, "init_std": 0.1, "n_layers": 3})


@pytest.fixture(scope="module")
def target():
  return specjax.Transformer(DEEP, rngs=nnx.Rngs(0))


def _head(kind="dflash", seed=1, cfg=DEEP, **settings):
  settings = {"block_size": 4, "draft_layers": 2, **settings}
  return make_head(head_config(kind, cfg, **settings), rngs=nnx.Rngs(seed))


def test_the_default_features_run_from_shallow_to_the_last_layer():
  assert block_feature_layers(6) == (2, 3, 4, 5, 6)  # the bundled target: all but the first
  assert block_feature_layers(22) == (2, 7, 12, 17, 22)  # the 1b preset
  assert block_feature_layers(36) == (2, 10, 19, 28, 36)
  assert block_feature_layers(3) == (1, 2, 3) and block_feature_layers(1) == (1,)
  for kind in ("dflash", "dspark"):  # both kinds' default, whatever their draft layers
    assert head_config(kind, DEEP, draft_layers=1).feature_layers == (1, 2, 3)


def _batch(seed=0, t=16):
  return jax.random.randint(jax.random.key(seed), (2, t + 1), 0, DEEP.vocab_size)


def test_the_loss_mixes_cross_entropy_with_the_l1_distance(target):
  head, batch = _head(), _batch()
  settings = dflash.DFlashLoss(num_anchors=6, loss_decay=2.0)  # l1_mix 0.9: the default
  value, m = dflash.dflash_objective(head, target, batch, None, loss="kl", settings=settings)
  assert settings.l1_mix == 0.9
  assert float(value) == pytest.approx(
    0.1 * float(m["block_ce"]) + 0.9 * float(m["block_l1"]), rel=1e-5
  )
  # L1 = 2 TV, so a position's alpha_t1 (1 - TV) is 1 - L1 / 2; every position reported.
  assert 0 < float(m["block_l1"]) <= 2
  assert {f"alpha_t{t}_pos{k}" for t in (0, 1) for k in (1, 2, 3)} <= set(m)
  # DFlash's own loss (l1_mix 0): the cross-entropy alone (tests/test_dflash_training.py).


def _draft_logits(head, target, prompt):
  """The block after `prompt [1, P]`'s context: laws of the next tokens `[1, n, V]`."""
  _, _, hidden = target.forward_cached(
    prompt, target.init_cache(1, 32), return_hidden=head.cfg.target_features
  )
  cache = head.init_cache(1, 32)
  cache = head.write_context(hidden[:, :-1], cache, jnp.zeros((1,), jnp.int32))
  cache = cache.with_lengths(jnp.array([prompt.shape[1] - 1], jnp.int32))
  return head.draft_logits(target, cache, prompt[:, -1])


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_a_warm_start_onto_more_layers_drafts_what_its_source_drafted(target, kind):
  source = _head(kind, seed=3, feature_layers=(2,))
  grown = blocks.transfer(_head(kind, seed=4), source, "the source")
  assert grown.cfg.feature_layers == (1, 2, 3)
  prompt = jax.random.randint(jax.random.key(1), (1, 9), 0, DEEP.vocab_size)
  np.testing.assert_allclose(
    _draft_logits(grown, target, prompt), _draft_logits(source, target, prompt), atol=1e-5
  )
  if kind == "dspark":  # its own heads come along
    np.testing.assert_array_equal(grown.markov_w1[...], source.markov_w1[...])


def test_a_warm_start_refuses_a_source_it_cannot_hold(target):
  with pytest.raises(ValueError, match=r"feature_layers \(1, 2\) must include the layers"):
    blocks.transfer(_head(feature_layers=(1, 2)), _head(feature_layers=(3,)), "x")
  with pytest.raises(ValueError, match=r"config.head.block_size is 4, but x has 6"):
    blocks.transfer(_head(), _head(block_size=6), "x")
  with pytest.raises(ValueError, match=r"x's \S+ has shape .*another markov_rank"):
    blocks.transfer(_head("dspark", markov_rank=8), _head("dspark", markov_rank=4), "x")


def test_the_sequential_drafter_scores_its_backbone_too(target):
  head, batch = _head("dspark", markov_rank=4), _batch(1)
  settings = dspark.DSparkLoss(num_anchors=6, loss_decay=2.0, base_weight=0.0)
  with_base = dataclasses.replace(settings, base_weight=0.5)
  value, m = dspark.dspark_objective(head, target, batch, None, loss="kl", settings=settings)
  more, mb = dspark.dspark_objective(head, target, batch, None, loss="kl", settings=with_base)
  assert float(more) == pytest.approx(float(value) + 0.5 * float(mb["base_loss"]), rel=1e-5)
  assert {"base_alpha_t0_pos1", "base_alpha_t1_pos3"} <= set(mb)
  assert "base_alpha_t0_pos1" in m  # the backbone's agreement, reported either way


def test_the_sequential_drafters_backbone_is_a_block_drafter(target):
  """`dspark.backbone`: the bundled block drafter is the bundled sequential one's backbone."""
  head = _head("dspark", seed=5, markov_rank=4)
  block = dspark.backbone(head)
  assert type(block) is dflash.DFlashHead and block.cfg.feature_layers == head.cfg.feature_layers
  prompt = jax.random.randint(jax.random.key(2), (1, 9), 0, DEEP.vocab_size)
  np.testing.assert_allclose(
    _draft_logits(block, target, prompt), _draft_logits(head, target, prompt), atol=1e-6
  )
