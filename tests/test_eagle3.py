"""EAGLE-3 (issue 32, requirement 3): the head, its draft vocabulary, drafting,
the training-time test and the hub layout.

EAGLE-3 reads three distinct layer counts, so the targets here have 3 layers
(TINY otherwise). Greedy speculative decoding equals autoregressive decoding for
chains, static trees and EAGLE-2 trees with a reduced draft vocabulary; sampled
verification keeps the target's law on a vocabulary of 8 (test_distribution's
harness) with q = 0 off the draft ids; step j of the training-time test equals
drafting j tokens with the head's cache; training lowers the loss, records the
draft ids and resumes them; the hub tensors round-trip and bad ones are named.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_distribution import NEW, PROMPT, ROWS, chi_square_pvalue, exact_joint

import specjax
from configs import train_tiny
from helpers import TINY, copy_corpus, tiny_token_data
from specjax import pretrained
from specjax.data import TokenDataset
from specjax.heads import HeadConfig, eagle3, make_head
from specjax.heads import config as head_config
from specjax.heads.eagle import EagleDrafter
from specjax.hf.export import save_model
from specjax.training import heads as head_training
from specjax.training import load_head_config, load_trained_head, train
from specjax.training.trainer import eval_step

CFG3 = specjax.ModelConfig(**{**TINY, "n_layers": 3})
IDS = tuple(range(0, 512, 2))  # a draft vocabulary of the 256 even ids


def _head(target, seed=3, k=256, ids=IDS, **settings):
  cfg = head_config("eagle3", target.cfg, draft_vocab_size=k, draft_ids=ids, **settings)
  return make_head(cfg, rngs=nnx.Rngs(seed))


@pytest.fixture(scope="module")
def target3():
  return specjax.Transformer(CFG3.replace(init_std=0.1), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def prompts3():
  tokens = jax.random.randint(jax.random.key(42), (4, 9), 0, 512, dtype=jnp.int32)
  return tokens, jnp.array([9, 2, 6, 1], jnp.int32)


def test_config_defaults_and_refusals():
  assert head_config("eagle3", CFG3).feature_layers == (1, 2, 3)
  assert head_config("eagle3", CFG3.replace(n_layers=6)).feature_layers == (1, 3, 6)
  assert head_config("eagle3", CFG3.replace(n_layers=32)).feature_layers == (2, 16, 29)  # vLLM's
  cfg = head_config("eagle3", CFG3, draft_vocab_size=4, draft_ids=(1, 5, 9, 12))
  assert HeadConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
  assert head_config("eagle3", CFG3, draft_ids=tuple(range(512))).draft_ids == ()  # identity
  with pytest.raises(ValueError, match=r"feature_layers must be distinct layer counts in \[1, 2\]"):
    head_config("eagle3", CFG3.replace(n_layers=2))
  with pytest.raises(ValueError, match="feature_layers must be 3 layer counts"):
    head_config("eagle3", CFG3, feature_layers=(1, 2))
  with pytest.raises(ValueError, match=r"draft_vocab_size must be an int in \[0, 512\]"):
    head_config("eagle3", CFG3, draft_vocab_size=513)
  with pytest.raises(ValueError, match="draft_ids must be draft_vocab_size=3 ascending"):
    head_config("eagle3", CFG3, draft_vocab_size=3, draft_ids=(4, 2, 9))
  with pytest.raises(ValueError, match="cfg.draft_ids must hold 3 ids"):
    make_head(head_config("eagle3", CFG3, draft_vocab_size=3), rngs=nnx.Rngs(0))


def test_draft_vocab_ids_are_the_most_frequent_ascending():
  tokens = np.array([7, 7, 7, 3, 3, 9, 9, 1, 0])  # 3 and 9 tie: the lower id first
  assert eagle3.draft_vocab_ids(tokens, 12, 2) == (3, 7)
  assert eagle3.draft_vocab_ids(tokens, 12, 3) == (3, 7, 9)


def test_the_law_is_zero_off_the_draft_ids(target3):
  head = _head(target3)
  h = jax.random.normal(jax.random.key(1), (3, CFG3.d_model))
  full, own = head.logits(h), head.draft_logits(h)
  np.testing.assert_array_equal(full[:, np.array(IDS)], own)
  assert np.isneginf(np.delete(np.asarray(full), IDS, axis=1)).all()
  subset = head.logits(h, jnp.array([0, 1, 2, 4]))  # FR-Spec on top: the ids in both
  assert np.isfinite(subset).sum(-1).tolist() == [3, 3, 3]


@pytest.mark.sample("chain", "eagle2")
@pytest.mark.parametrize(
  "tree",
  [None, specjax.trees.from_paths([(0,), (1,), (0, 0)]), specjax.trees.DynamicTree(4, 3, 2, 2)],
  ids=["chain", "static_tree", "eagle2"],
)
def test_greedy_equals_autoregressive(target3, prompts3, tree):
  ref = specjax.autoregressive_generate(
    target3, *prompts3, max_new_tokens=16, sampling=specjax.GREEDY
  )
  drafter = EagleDrafter(target3, _head(target3), tree=tree)
  gamma = 3 if tree is None else (4 if isinstance(tree, specjax.trees.DynamicTree) else 3)
  out = specjax.speculative_generate(
    target3, drafter, *prompts3, gamma=gamma, max_new_tokens=16, sampling=specjax.GREEDY
  )
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  np.testing.assert_array_equal(out.num_generated, ref.num_generated)
  assert np.sum(out.stats.proposed) > 0


@pytest.mark.sample("eagle2")  # the chain's cases in the slow tier
@pytest.mark.parametrize(
  "verifier, tree, sampling",
  [
    ("token", None, specjax.SamplingParams(temperature=1.0)),
    ("block", None, specjax.SamplingParams(temperature=1.0, top_k=6, top_p=0.9)),
    ("auto", specjax.trees.DynamicTree(6, 3, 2, 2), specjax.SamplingParams(temperature=1.0)),
  ],
  ids=["token", "block_top_k_top_p", "eagle2"],
)
def test_sampled_verification_keeps_the_target_law(verifier, tree, sampling):
  """V = 8, draft ids {0, 1, 2, 4, 5, 7}: q is 0 on 3 and 6, the output law is the target's."""
  cfg = specjax.ModelConfig(
    vocab_size=8, d_model=32, n_layers=3, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=16,
    init_std=0.4,
  )  # fmt: skip
  target = specjax.Transformer(cfg, rngs=nnx.Rngs(0))
  head = _head(target, k=6, ids=(0, 1, 2, 4, 5, 7))
  spec = specjax.speculative_generate(
    target,
    EagleDrafter(target, head, tree=tree),
    jnp.tile(PROMPT, (ROWS, 1)),
    jnp.full((ROWS,), len(PROMPT), jnp.int32),
    gamma=2 if tree is None else tree.size,
    max_new_tokens=NEW,
    sampling=sampling,
    key=jax.random.key(29),
    verifier=verifier,
  )
  accepted = np.asarray(spec.stats.accepted_at_position)
  assert 0 < accepted[0] < ROWS, accepted  # verification really decides
  assert chi_square_pvalue(spec.tokens, exact_joint(target, sampling)) > 1e-3


def test_training_time_test_step_j_is_drafting_j_tokens(target3):
  """Row r of step j equals the head's own cached drafting: the pairs 0..r with the
  target's features, then j pairs (its previous output, token r + 1 + i)."""
  head = _head(target3)
  tokens = jax.random.randint(jax.random.key(5), (2, 12), 0, 512, dtype=jnp.int32)
  _, _, feats = target3.forward_cached(
    tokens, target3.init_cache(2, 12), return_hidden=head.cfg.target_features
  )
  steps = eagle3.ttt_unroll(head, target3, tokens, feats, 3)
  assert [s.shape[1] for s in steps] == [11, 10, 9]
  f = head.feature_space(feats)
  for r in (0, 4, 8):
    h, cache = head.forward_cached(
      target3, f[:, : r + 1], tokens[:, 1 : r + 2], head.init_cache(2, 16)
    )
    h = h[:, -1:]
    for j in range(3):
      np.testing.assert_allclose(steps[j][:, r], h[:, 0], atol=2e-4, err_msg=f"step {j} row {r}")
      if j < 2:
        h, cache = head.forward_cached(target3, h, tokens[:, r + 2 + j : r + 3 + j], cache)


def test_warm_start_reads_the_targets_norm_and_head(target3):
  head = eagle3.warm_start(_head(target3), target3)
  h = jax.random.normal(jax.random.key(1), (2, CFG3.d_model))  # drafts the target's law
  np.testing.assert_allclose(
    head.draft_logits(h), target3.features_to_logits(h)[:, np.array(IDS)], atol=1e-5
  )
  np.testing.assert_array_equal(head.norm.scale[...], target3.final_norm.scale[...])
  f = jax.random.normal(jax.random.key(2), (2, 3 * CFG3.d_model))
  np.testing.assert_allclose(head.feature_space(f), f[:, 2 * CFG3.d_model :], atol=1e-6)


def test_hub_layout_round_trips_and_refuses_misfits(target3):
  head = _head(target3)
  config, tensors = eagle3.hub_config(head), eagle3.hub_tensors(head)
  assert config["architectures"] == ["LlamaForCausalLMEagle3"]
  assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
  assert config["draft_vocab_size"] == 256 and not config["tie_word_embeddings"]
  d = CFG3.d_model
  assert tensors["fc.weight"].shape == (d, 3 * d)
  assert tensors["midlayer.self_attn.q_proj.weight"].shape == (d, 2 * d)
  assert tensors["midlayer.self_attn.k_proj.weight"].shape == (d // 2, 2 * d)  # 2 kv heads
  assert tensors["lm_head.weight"].shape == (256, d)
  assert tensors["d2t"].dtype == np.int64 and tensors["t2d"].dtype == bool
  np.testing.assert_array_equal(np.arange(256) + tensors["d2t"], IDS)
  back = eagle3.from_hub(config, tensors, target3, jnp.float32)
  assert back.cfg == head.cfg
  for x, y in zip(jax.tree.leaves(nnx.state(head)), jax.tree.leaves(nnx.state(back))):
    np.testing.assert_array_equal(x, y)
  with pytest.raises(ValueError, match="config hidden_size is 32; the target needs 64"):
    eagle3.from_hub({**config, "hidden_size": 32}, tensors, target3, jnp.float32)
  with pytest.raises(ValueError, match="config norm_before_residual is True"):
    eagle3.from_hub({**config, "norm_before_residual": True}, tensors, target3, jnp.float32)
  with pytest.raises(ValueError, match="tensor midlayer.hidden_norm.weight is missing"):
    eagle3.from_hub(
      config, {k: v for k, v in tensors.items() if "hidden_norm" not in k}, target3, jnp.float32
    )
  with pytest.raises(ValueError, match=r"tensors \['extra'\] are not part"):
    eagle3.from_hub(config, {**tensors, "extra": np.zeros(1)}, target3, jnp.float32)
  with pytest.raises(ValueError, match="tensor fc.weight has shape"):
    bad = {**tensors, "fc.weight": np.zeros((d, 2 * d))}
    eagle3.from_hub(config, bad, target3, jnp.float32)


def test_training_records_the_draft_vocabulary_and_decodes(tmp_path_factory):
  root = copy_corpus(tmp_path_factory.mktemp("stdlib"), {"train": 6, "validation": 2, "test": 1})
  data = tiny_token_data(str(tmp_path_factory.mktemp("data")), root)
  target_dir = str(tmp_path_factory.mktemp("target"))
  save_model(
    specjax.Transformer(CFG3.replace(init_std=0.1), rngs=nnx.Rngs(0)), target_dir, dtype="float32"
  )
  config = train_tiny.get_config()
  config.data.update(root=root, dir=data)
  config.loss = "kl"
  config.head.update(kind="eagle3", target=target_dir, d_ff=64)
  config.head.ttt_steps = 3
  config.head.draft_vocab_size = 128
  config.update(num_steps=12, learning_rate=1e-2, eval_every=12, checkpoint_every=4, log_every=12)
  run = str(tmp_path_factory.mktemp("run"))
  history = train(config, run, echo=lambda _: None)
  assert all(np.isfinite([r["loss"] for r in history]))
  assert {"alpha_t1_step2", "alpha_t0_step0", "alpha_t1"} <= set(history[-1])
  cfg = load_head_config(run)
  tokens = np.fromfile(os.path.join(data, "train.bin"), np.uint16)
  assert cfg.draft_ids == eagle3.draft_vocab_ids(tokens, 512, 128)
  head, step = load_trained_head(run)
  assert step == 12 and isinstance(head, eagle3.Eagle3Head)
  # Teacher-forced on the same validation windows, against the head it started from.
  target = head_training.load_target(target_dir)
  val = TokenDataset(os.path.join(data, "validation.bin"))

  def distill(h):
    graphdef, params = nnx.split(h, nnx.Param)
    settings = dict(graphdef=graphdef, loss="kl", head=eagle3.Eagle3Loss(ttt_steps=3))
    runs = [eval_step(params, b, target, **settings) for b in val.eval_batches(4, 32, 2)]
    return np.mean([r["distill"] for r in runs])

  before, after = distill(make_head(cfg, rngs=nnx.Rngs(config.seed))), distill(head)
  assert after < 0.98 * before, (before, after)
  # A resume keeps the run's draft ids; the trained head decodes exactly.
  config.num_steps = 14
  train(config, run, echo=lambda _: None)
  assert load_head_config(run).draft_ids == cfg.draft_ids
  drafter = pretrained.load_drafter("eagle", target, head=load_trained_head(run)[0])
  prompt = jnp.asarray(tokens[None, :20].astype(np.int32))
  lengths = jnp.array([20], jnp.int32)
  ref = specjax.autoregressive_generate(
    target, prompt, lengths, max_new_tokens=12, sampling=specjax.GREEDY
  )
  out = specjax.speculative_generate(
    target, drafter, prompt, lengths, gamma=3, max_new_tokens=12, sampling=specjax.GREEDY
  )
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  with pytest.raises(ValueError, match=r"config.head.ttt_steps must be an int in \[1, 16\]"):
    config.head.ttt_steps = 0
    head_training.check_config(config)
