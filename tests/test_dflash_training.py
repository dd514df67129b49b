"""Training the block drafter (DFlash; issue 46, requirement 3).

The target is the TINY config with peaked weights; the drafter has blocks of 4
and 2 layers. Training reads each block exactly as drafting does: the training
form's laws at random anchors equal `DFlashDrafter`'s proposal laws after its
context is written. One update lowers the decayed cross-entropy; the config
checks name each field and its range; a short run of configs/train_dflash.py on
real files resumes and decodes exactly with the trained head.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import specjax
from configs import train_dflash
from helpers import TINY, copy_corpus, tiny_token_data
from specjax.data import TokenDataset
from specjax.drafting.base import Commit
from specjax.heads import config as head_config
from specjax.heads import make_head
from specjax.heads.blocks import block_anchors
from specjax.heads.dflash import DFlashDrafter, DFlashHead, DFlashLoss
from specjax.hf.export import save_model
from specjax.training import heads as head_training
from specjax.training import load_trained_head, train
from specjax.training.trainer import eval_step, train_step

CFG = specjax.ModelConfig(**{**TINY, "init_std": 0.1})
BLOCK = 4
SETTINGS = DFlashLoss(num_anchors=8, loss_decay=2.0, l1_mix=0.0)  # DFlash's own loss


@pytest.fixture(scope="module")
def target():
  return specjax.Transformer(CFG, rngs=nnx.Rngs(0))


def _head(seed=1, **settings):
  cfg = head_config("dflash", CFG, block_size=BLOCK, draft_layers=2, **settings)
  return make_head(cfg, rngs=nnx.Rngs(seed))


def test_anchors_are_distinct_in_range_and_fixed_without_a_key():
  drawn = np.asarray(block_anchors(jax.random.key(0), 3, 20, 8))
  assert drawn.shape == (3, 8) and drawn.min() >= 1 and drawn.max() <= 19
  assert all(len(set(row)) == 8 for row in drawn.tolist())
  assert block_anchors(jax.random.key(0), 1, 5, 8).shape == (1, 4)  # at most T - 1
  even = np.asarray(block_anchors(None, 2, 20, 4))
  np.testing.assert_array_equal(even, [[1, 7, 13, 19]] * 2)


@pytest.mark.parametrize("mask_token_id", [-1, 5])
def test_drafting_reads_what_training_read(target, mask_token_id):
  """The training form's logits of block j (anchor a) equal the drafter's proposal
  laws after a prompt of a tokens (context s[:-1], s[-1] = tokens[a]), row by row
  at ragged anchors, and `draft_logits` after `write_context`."""
  head = _head(mask_token_id=mask_token_id)
  b, t = 3, 24
  tokens = jax.random.randint(jax.random.key(4), (b, t), 0, CFG.vocab_size, dtype=jnp.int32)
  features = target.forward_cached(
    tokens, target.init_cache(b, t), return_hidden=head.cfg.target_features
  )[2]
  anchors = block_anchors(jax.random.key(5), b, t, 6)
  trained = head(target, features, tokens, anchors)  # [B, A, BLOCK - 1, V]
  drafter = DFlashDrafter(target, head)
  sampling = specjax.SamplingParams(temperature=1.0)
  for j in range(anchors.shape[1]):
    a = anchors[:, j]
    last = jnp.take_along_axis(tokens, a[:, None], axis=1)  # s[-1] = tokens[a]
    state = drafter.init(tokens, a, last[:, 0], 32, hidden=features)
    proposal, _ = drafter.propose(
      state, last, jax.random.key(j), jnp.full((b,), BLOCK - 1), gamma=BLOCK - 1, sampling=sampling
    )
    np.testing.assert_allclose(proposal.probs, jax.nn.softmax(trained[:, j]), atol=1e-5)
    logits = head.draft_logits(target, state.cache, last[:, 0])
    np.testing.assert_allclose(logits, trained[:, j], atol=1e-4, rtol=1e-5)


def test_a_tree_draws_each_depth_from_its_block_position(target):
  """With a tree, one call drafts every depth: a node at depth d was drawn from the
  training form's law at block position d (q its parent's row), and at temperature
  0 the children of every depth-d node are that position's top-k."""
  head = _head()
  b, t, p = 2, 24, 9
  tokens = jax.random.randint(jax.random.key(6), (b, t), 0, CFG.vocab_size, dtype=jnp.int32)
  features = target.forward_cached(
    tokens, target.init_cache(b, t), return_hidden=head.cfg.target_features
  )[2]
  want = head(target, features, tokens, jnp.full((b, 1), p))[:, 0]  # [B, BLOCK - 1, V]
  tree = specjax.trees.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1)])
  drafter = DFlashDrafter(target, head, tree=tree)
  state = drafter.init(tokens, jnp.full((b,), p), tokens[:, p], 32, hidden=features)
  propose = lambda sampling: drafter.propose(
    state, tokens[:, p : p + 1], jax.random.key(2), jnp.full((b,), 7), gamma=7, sampling=sampling
  )[0]
  depth = np.asarray(specjax.trees.tree_depths(tree)) - 1
  sampled = propose(specjax.SamplingParams(temperature=1.0))
  assert sampled.calls == 1 and sampled.tree is not None
  np.testing.assert_allclose(sampled.probs, jax.nn.softmax(want[:, depth]), atol=1e-5)
  greedy = np.asarray(propose(specjax.GREEDY).tokens)
  top = np.argsort(-np.asarray(want), axis=-1)  # [B, BLOCK - 1, V]
  rank = np.asarray(specjax.trees.sibling_ranks(tree))
  np.testing.assert_array_equal(greedy, top[:, depth, rank])


def test_drafting_after_a_commit_reads_what_training_read(target):
  """After one iteration commits (rows keeping 1, 3 and all BLOCK tokens, a row
  that stopped), the next draft's logits equal the training form's at the new
  s[-1]: `commit` writes the kept tokens' features at the right slots and moves
  each row's context length exactly (a misaligned commit would only lower the
  acceptance, which the exactness tests cannot see)."""
  head = _head()
  b, t, p, g = 4, 24, 10, BLOCK - 1
  tokens = jax.random.randint(jax.random.key(8), (b, t), 0, CFG.vocab_size, dtype=jnp.int32)
  features = target.forward_cached(
    tokens, target.init_cache(b, t), return_hidden=head.cfg.target_features
  )[2]
  drafter = DFlashDrafter(target, head)
  state = drafter.init(tokens[:, :p], jnp.full((b,), p), tokens[:, p], 32, hidden=features[:, :p])
  old = jnp.full((b,), p + 1)  # len(s); s[-1] = tokens[p]
  kept = jnp.array([1, 3, BLOCK, 2])
  goes_on = jnp.array([True, True, True, False])
  emitted, hidden = tokens[:, p + 1 : p + 2 + g], features[:, p : p + g + 1]
  state = drafter.commit(state, Commit(emitted, old, old + kept, goes_on, hidden))
  anchors = jnp.where(goes_on, p + kept, p)  # the index of the new s[-1]
  np.testing.assert_array_equal(state.cache.lengths, anchors)
  last = jnp.take_along_axis(tokens, anchors[:, None], axis=1)[:, 0]
  want = head(target, features, tokens, anchors[:, None])[:, 0]  # [B, BLOCK - 1, V]
  np.testing.assert_allclose(
    head.draft_logits(target, state.cache, last), want, atol=1e-4, rtol=1e-5
  )


def test_one_update_lowers_the_decayed_cross_entropy(target):
  head = _head()
  graphdef, params = nnx.split(head, nnx.Param)
  batch = jax.random.randint(jax.random.key(6), (4, 33), 0, CFG.vocab_size, dtype=jnp.int32)
  key, optimizer = jax.random.key(7), optax.adam(1e-2)

  def loss(p, settings=SETTINGS):
    return head_training.objective(p, batch, target, key, graphdef=graphdef, settings=settings)

  before = float(loss(params)[0])
  params, _, metrics = train_step(
    params,
    optimizer.init(params),
    batch,
    target,
    key,
    graphdef=graphdef,
    optimizer=optimizer,
    loss="kl",
    head=SETTINGS,
  )
  assert float(metrics["loss"]) == pytest.approx(before, rel=1e-5)
  assert float(loss(params)[0]) < before
  keys = {"distill", "ce", "alpha_t0", "alpha_t1", "block_ce", "block_accept"}
  assert keys | {f"alpha_t0_pos{k}" for k in (1, 2, 3)} <= set(metrics)
  # The decayed divergence, added with a weight, raises the loss by that much.
  value, m = loss(params, DFlashLoss(num_anchors=8, loss_decay=2.0, l1_mix=0.0, distill_weight=0.5))
  assert float(value) == pytest.approx(float(m["block_ce"] + 0.5 * m["distill"]), rel=1e-5)


def _base_config(**head):
  config = train_dflash.get_config()
  config.seq_len = 32
  config.head.update(**head)
  return config


@pytest.mark.parametrize(
  ("field", "value", "message"),
  [
    ("block_size", 1, r"config.head.block_size must be an int in \[2, 64\], got 1"),
    ("block_size", 32, r"config.seq_len must be > config.head.block_size=32"),
    ("draft_layers", 17, r"config.head.draft_layers must be an int in \[1, 16\], got 17"),
    ("mask_token_id", -2, r"config.head.mask_token_id must be an int >= -1, got -2"),
    ("num_anchors", 0, r"config.head.num_anchors must be an int in \[1, 1024\], got 0"),
    ("loss_decay", 0.0, r"config.head.loss_decay must be a finite number > 0, got 0.0"),
    ("distill_weight", -1.0, r"config.head.distill_weight must be a finite number >= 0"),
  ],
)
def test_config_refusals_name_the_field_and_range(field, value, message):
  with pytest.raises(ValueError, match=message):
    head_training.check_config(_base_config(**{field: value}))


def test_head_config_passes_the_block_settings_and_checks_the_mask_id():
  config = _base_config(block_size=6, draft_layers=3, mask_token_id=7)
  head_training.check_config(config)
  cfg = head_training.head_config(config, CFG)
  assert (cfg.block_size, cfg.draft_layers, cfg.mask_token_id) == (6, 3, 7)
  assert cfg.feature_layers == (1, 2)  # dflash_feature_layers(2, 3) on the 2-layer target
  settings = head_training.loss_settings(config)
  assert isinstance(settings, DFlashLoss) and settings.keyed
  fields = (settings.num_anchors, settings.loss_decay, settings.l1_mix, settings.distill_weight)
  assert fields == (64, 4.0, 0.9, 0.0)
  match = r"config.head.mask_token_id must be an int in \[0, 512\) or -1"
  with pytest.raises(ValueError, match=match):
    head_training.head_config(_base_config(mask_token_id=512), CFG)


def test_training_resumes_and_the_trained_head_decodes_exactly(tmp_path_factory):
  root = copy_corpus(tmp_path_factory.mktemp("stdlib"), {"train": 6, "validation": 2, "test": 1})
  data = tiny_token_data(str(tmp_path_factory.mktemp("data")), root)
  target_dir = str(tmp_path_factory.mktemp("target"))
  save_model(specjax.Transformer(CFG, rngs=nnx.Rngs(0)), target_dir, dtype="float32")
  config = train_dflash.get_config()
  config.data.update(root=root, dir=data, tokenizer="", corpus_dir="")
  # DFlash's own loss (cross-entropy alone), whose fall the test reads.
  config.head.update(target=target_dir, block_size=BLOCK, d_ff=64, num_anchors=8, l1_mix=0.0)
  config.update(
    seq_len=32,
    num_steps=12,
    learning_rate=1e-2,
    warmup_steps=1,
    eval_every=12,
    eval_batches=2,
    checkpoint_every=4,
    log_every=12,
  )
  run = str(tmp_path_factory.mktemp("run"))
  history = train(config, run, echo=lambda _: None)
  assert all(np.isfinite([r["loss"] for r in history]))
  head, step = load_trained_head(run)
  assert step == 12 and isinstance(head, DFlashHead) and head.cfg.block_size == BLOCK
  target = head_training.load_target(target_dir)
  val = TokenDataset(os.path.join(data, "validation.bin"))

  def block_ce(h):  # teacher-forced on the same validation windows, anchors evenly spaced
    graphdef, params = nnx.split(h, nnx.Param)
    settings = dict(graphdef=graphdef, loss="kl", head=head_training.loss_settings(config))
    return np.mean(
      [eval_step(params, b, target, **settings)["block_ce"] for b in val.eval_batches(4, 32, 2)]
    )

  before, after = block_ce(make_head(head.cfg, rngs=nnx.Rngs(config.seed))), block_ce(head)
  assert after < 0.95 * before, (before, after)
  config.num_steps = 14  # a resume goes on from step 12
  assert [r["step"] for r in train(config, run, echo=lambda _: None)] == [13, 14]
  drafter = DFlashDrafter(target, load_trained_head(run)[0], draft="argmax")
  tokens = np.fromfile(os.path.join(data, "train.bin"), np.uint16)
  prompt = jnp.asarray(tokens[None, :20].astype(np.int32))
  lengths = jnp.array([20], jnp.int32)
  kwargs = dict(max_new_tokens=12, sampling=specjax.GREEDY)
  ref = specjax.autoregressive_generate(target, prompt, lengths, **kwargs)
  out = specjax.speculative_generate(target, drafter, prompt, lengths, gamma=BLOCK - 1, **kwargs)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
