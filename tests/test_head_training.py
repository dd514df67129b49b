"""Training draft heads on a frozen target (issue 11): EAGLE, Medusa and early exit.

The target is the TINY config with peaked weights (its laws depend on the
context, unlike a freshly initialised model's near-uniform ones), saved as a
Hugging Face checkpoint; the heads train on a few real standard-library files
tokenized with a 512-token BPE, as in test_training.py. Every run shares one
batch shape, so each kind compiles one train step and one eval step.
"""

import dataclasses
import importlib
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import train_dspark, train_tiny
from helpers import TINY, copy_corpus, tiny_token_data
from specjax import ModelConfig, Transformer, heads, pretrained
from specjax.data import TokenDataset
from specjax.heads import config as head_config
from specjax.heads import dflash, dspark, eagle, eagle3, early_exit, make_head
from specjax.heads.dflash import DFlashHead
from specjax.heads.dspark import DSparkHead
from specjax.heads.eagle import EagleHead
from specjax.heads.early_exit import ExitAdapter
from specjax.heads.medusa import MedusaHeads
from specjax.hf.export import save_model
from specjax.training import (
  Checkpointer,
  check_config,
  load_head_config,
  load_trained_head,
  train,
)
from specjax.training import heads as head_training
from specjax.training.checkpoint import save_head_config
from specjax.training.optimizer import make_optimizer
from specjax.training.trainer import eval_step, train_step

FILES_PER_SPLIT = {"train": 16, "validation": 3, "test": 1}
KINDS = ("eagle", "medusa", "early_exit")


def _silent(_):
  pass


@pytest.fixture(scope="module")
def corpus_root(tmp_path_factory):
  return copy_corpus(tmp_path_factory.mktemp("stdlib"), FILES_PER_SPLIT)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, corpus_root):
  return tiny_token_data(str(tmp_path_factory.mktemp("data")), corpus_root)


def _save_target(path, **overrides) -> str:
  # init_std 0.1 instead of 0.02: logits of a few units, so the target's law is
  # peaked and moves with the context.
  cfg = ModelConfig(**{**TINY, "init_std": 0.1, **overrides})
  save_model(Transformer(cfg, rngs=nnx.Rngs(0)), str(path), dtype="float32")
  return str(path)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
  return _save_target(tmp_path_factory.mktemp("target"))


def _config(corpus_root, data_dir, target, kind, **changes):
  config = train_tiny.get_config()  # batch 4 x 32 tokens, 6 steps, checkpoints every 2
  config.data.root = corpus_root
  config.data.dir = data_dir
  config.loss = "kl"
  config.head.update(
    kind=kind,
    target=target,
    num_heads=3,
    exit_layer=1,
    d_ff=64,
    feature_weight=0.1,
    feature_noise=0.1 if kind == "eagle" else 0.0,
  )
  config.update(changes)
  return config


def _teacher_forced(head, target, data_dir) -> dict[str, float]:
  """The head's metrics on the first two validation batches (no noise)."""
  graphdef, params = nnx.split(head, nnx.Param)
  settings = heads.of(head.cfg).training.loss()  # the kind's defaults: no feature weight
  data = TokenDataset(os.path.join(data_dir, "validation.bin"))
  runs = [
    eval_step(params, batch, target, graphdef=graphdef, loss="kl", head=settings)
    for batch in data.eval_batches(4, 32, 2)
  ]
  return {k: float(np.mean([r[k] for r in runs])) for k in runs[0]}


@pytest.mark.sample("eagle")
@pytest.mark.parametrize("kind", KINDS)
def test_training_a_head_lowers_its_loss_and_raises_alpha(
  tmp_path, corpus_root, data_dir, target_dir, kind
):
  run = str(tmp_path / kind)
  config = _config(
    corpus_root,
    data_dir,
    target_dir,
    kind,
    num_steps=16,
    learning_rate=2e-2,
    log_every=16,
    eval_every=16,
    checkpoint_every=16,
  )
  lines = []
  history = train(config, run, echo=lines.append)
  losses_ = [r["loss"] for r in history]
  assert len(losses_) == 16 and all(np.isfinite(losses_))
  assert np.mean(losses_[-3:]) < 0.9 * losses_[0], losses_
  assert f"{kind} head" in lines[1]
  with open(os.path.join(run, "metrics.jsonl")) as f:
    final = [json.loads(line) for line in f][-1]
  assert {"val_alpha_t0", "val_alpha_t1", "val_distill", "val_ce"} <= set(final)
  if kind == "medusa":
    assert {f"val_alpha_t1_head{k}" for k in range(3)} <= set(final)
  else:
    assert "val_feature" in final
  # The run directory records the head, not a model.
  assert not os.path.exists(os.path.join(run, "model_config.json"))
  target_cfg = head_training.target_config(target_dir)
  own = {"medusa": dict(num_heads=3), "early_exit": dict(exit_layer=1)}.get(kind, {})
  cfg = head_config(kind, target_cfg, d_ff=64, **own)
  assert load_head_config(run) == cfg
  trained, step = load_trained_head(run)
  assert step == 16 and type(trained) is type(make_head(cfg, rngs=nnx.Rngs(0)))
  # Teacher-forced on the same validation windows: the trained head against the
  # one it started from (the trainer builds it from config.seed).
  target = head_training.load_target(target_dir)
  before = _teacher_forced(make_head(cfg, rngs=nnx.Rngs(config.seed)), target, data_dir)
  after = _teacher_forced(trained, target, data_dir)
  assert after["distill"] < before["distill"]
  assert after["alpha_t1"] > before["alpha_t1"], (before, after)
  if kind != "medusa":  # Medusa's heads guess a random target's later laws: argmaxes stay rare
    assert after["alpha_t0"] > before["alpha_t0"], (before, after)


def test_checkpoint_restores_a_head_bit_exactly(tmp_path, target_dir):
  cfg = head_config(kind="eagle", target=head_training.target_config(target_dir), d_ff=64)
  head = make_head(cfg, rngs=nnx.Rngs(4))
  graphdef, params = nnx.split(head, nnx.Param)
  keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(params))))
  params = jax.tree.map(lambda x: x + jax.random.normal(next(keys), x.shape, x.dtype), params)
  save_head_config(str(tmp_path), cfg)
  saver = Checkpointer(str(tmp_path), save_every=1, keep=1)
  saver.save(3, params, make_optimizer(train_tiny.get_config()).init(params), {"step": 3})
  saver.close()
  restored, step = load_trained_head(str(tmp_path))
  assert step == 3 and restored.cfg == cfg and isinstance(restored, EagleHead)
  expected = jax.tree.leaves(params)
  got = jax.tree.leaves(nnx.state(restored, nnx.Param))
  assert len(got) == len(expected)
  for x, y in zip(expected, got):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(x, y)


@pytest.mark.slow  # exact resume: tests/test_training.py's for drafts
def test_resume_continues_with_identical_losses(tmp_path, corpus_root, data_dir, target_dir):
  # EAGLE with feature noise: the noise, too, must be a function of the step.
  config = _config(corpus_root, data_dir, target_dir, "eagle")  # 6 steps, checkpoints every 2
  straight = train(config, str(tmp_path / "a"), echo=_silent)
  first = train(config, str(tmp_path / "b"), stop_after=3, echo=_silent)
  lines = []
  resumed = train(config, str(tmp_path / "b"), echo=lines.append)
  assert any("resuming at step 2/6" in line for line in lines)
  expected = {r["step"]: r["loss"] for r in straight}
  assert [r["loss"] for r in first] == [expected[s] for s in (1, 2, 3)]
  assert [r["loss"] for r in resumed] == [expected[s] for s in (3, 4, 5, 6)]
  a, _ = load_trained_head(str(tmp_path / "a"))
  b, _ = load_trained_head(str(tmp_path / "b"))
  for x, y in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b))):
    np.testing.assert_array_equal(x, y)
  # Without noise the losses differ: the noise was really there.
  quiet = _config(corpus_root, data_dir, target_dir, "eagle", num_steps=2, warmup_steps=0)
  quiet.head.feature_noise = 0.0
  plain = train(quiet, str(tmp_path / "c"), echo=_silent)
  assert plain[1]["loss"] != expected[2]

  # Another target shape (d_model 32) in the same run directory: refused before
  # anything is written or compiled.
  other = _save_target(tmp_path / "small", d_model=32, n_heads=2, n_kv_heads=1)
  metrics = (tmp_path / "b" / "metrics.jsonl").read_text()
  moved = _config(corpus_root, data_dir, other, "eagle")
  with pytest.raises(ValueError, match=r"cannot resume .*target.d_model \(64 saved, 32 configured"):
    train(moved, str(tmp_path / "b"), echo=_silent)
  assert (tmp_path / "b" / "metrics.jsonl").read_text() == metrics
  # A model run's directory is no place for a head, nor the other way round.
  with pytest.raises(ValueError, match="checkpoints are of a draft head"):
    train(train_tiny.get_config(), str(tmp_path / "b"), echo=_silent)


def test_head_for_another_target_is_refused_before_compiling(target_dir):
  target_cfg = head_training.target_config(target_dir)
  small = target_cfg.replace(d_model=32, n_heads=2, n_kv_heads=1)
  head = make_head(head_config(kind="medusa", target=small, num_heads=2), rngs=nnx.Rngs(0))
  target = Transformer(target_cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(head, nnx.Param)
  optimizer = make_optimizer(train_tiny.get_config())
  with pytest.raises(ValueError, match=r"trained for another target: d_model 64 \(head .* 32\)"):
    train_step(
      params,
      optimizer.init(params),
      jnp.zeros((2, 9), jnp.int32),
      target,
      graphdef=graphdef,
      optimizer=optimizer,
      loss="kl",
      head=heads.LossSettings(),
    )


def test_each_kind_reads_its_own_loss_settings():
  """`config.head` -> the kind's own settings (a frozen dataclass in its file, with its
  defaults: a jit static argument), and `keyed` says whether its objective draws."""
  got = {
    kind: head_training.loss_settings(importlib.import_module(f"configs.train_{kind}").get_config())
    for kind in heads.names()
  }
  assert got == {
    "eagle": eagle.EagleLoss(feature_weight=0.1, feature_noise=0.2),
    "medusa": heads.LossSettings(),
    "early_exit": early_exit.EarlyExitLoss(feature_weight=0.1),
    "eagle3": eagle3.Eagle3Loss(ttt_steps=7),
    # The block drafters' acceptance-shaped recipe: 0.1 CE + 0.9 L1, 1 - TV confidence.
    "dflash": dflash.DFlashLoss(num_anchors=64, loss_decay=4.0, l1_mix=0.9),
    "dspark": dspark.DSparkLoss(
      num_anchors=64, loss_decay=4.0, l1_mix=0.9, base_weight=0.5, confidence_target="sampled"
    ),
  }
  assert all(hash(s) == hash(dataclasses.replace(s)) for s in got.values())
  assert {k for k, s in got.items() if s.keyed} == {"eagle", "dflash", "dspark"}
  assert not eagle.EagleLoss(feature_weight=0.1).keyed  # no noise: nothing to draw
  # Each kind's defaults are its own (the sequential block drafter's confidence loss is on).
  assert heads.kind("dspark").training.loss().confidence_weight == 1.0
  config = train_dspark.get_config()
  config.head.train_only = "layers.1, norm"
  assert head_training.loss_settings(config).train_only == ("layers.1", "norm")


@pytest.mark.parametrize(
  "changes, message",
  [
    (dict(kind="lookahead"), r"config.head.kind must be '' or one of \('eagle', 'medusa'"),
    (dict(num_heads=0), r"config.head.num_heads must be an int in \[1, 16\]"),
    (dict(num_heads=32), r"config.head.num_heads must be an int in \[1, 16\]"),
    (dict(kind="early_exit", exit_layer=0), "config.head.exit_layer must be an int >= 1"),
    (dict(feature_layers=(1, 1)), "config.head.feature_layers must be distinct"),
    (dict(d_ff=-1), "config.head.d_ff must be an int >= 0"),
    (dict(feature_weight=-0.5), "config.head.feature_weight must be a finite number >= 0"),
    (dict(feature_noise=float("nan")), "config.head.feature_noise must be a finite number"),
    (dict(loss="ce"), r"config.loss must be one of \('kl', 'tv', 'kl\+tv'\) when training a head"),
    (dict(teacher="runs/target"), "config.teacher must be empty when training a head"),
    (dict(init_from="runs/draft"), "config.init_from must be empty when training a head"),
  ],
)
def test_bad_head_config(changes, message):
  config = _config("", "", "", "medusa")
  for name in ("loss", "teacher", "init_from"):
    if name in changes:
      config[name] = changes.pop(name)
  config.head.update(changes)
  with pytest.raises(ValueError, match=message):
    check_config(config)


@pytest.mark.parametrize(
  "kind, changes, message",
  [
    ("early_exit", dict(exit_layer=2), r"config.head.exit_layer must be an int in \[1, 1\] .*2"),
    ("eagle", dict(feature_layers=(1, 3)), r"config.head.feature_layers .* in \[1, 2\]"),
    ("eagle", dict(seq_len=200), "config.seq_len must be <= the target's max_seq_len=128"),
  ],
)
def test_head_config_checked_against_the_target(
  tmp_path, corpus_root, data_dir, target_dir, kind, changes, message
):
  config = _config(corpus_root, data_dir, target_dir, kind)
  if "seq_len" in changes:
    config.seq_len = changes.pop("seq_len")
  config.head.update(changes)
  with pytest.raises(ValueError, match=message):
    train(config, str(tmp_path / "run"), echo=_silent)
  assert not os.path.exists(tmp_path / "run")
  config = _config(corpus_root, data_dir, str(tmp_path / "nowhere"), kind)
  with pytest.raises(FileNotFoundError, match="config.head.target: the target directory"):
    train(config, str(tmp_path / "run"), echo=_silent)


@pytest.mark.skipif(
  not os.path.exists(pretrained.HEADS_CARD_FILE), reason="no bundled heads in this checkout"
)
def test_bundled_heads_load_and_are_checked(tmp_path, monkeypatch):
  from specjax.hf import load_model

  target, _ = load_model(pretrained.TARGET_DIR, dtype=jnp.float32)
  card = pretrained.heads_card()
  kinds = (*KINDS, "dflash", "dspark")
  for kind, cls in zip(kinds, (EagleHead, MedusaHeads, ExitAdapter, DFlashHead, DSparkHead)):
    head = pretrained.load_head(kind, target)
    assert isinstance(head, cls) and head.cfg.kind == kind
    assert {x.dtype for x in jax.tree.leaves(nnx.state(head, nnx.Param))} == {jnp.dtype("float32")}
    assert card["heads"][kind]["params"] == head_training.num_params(head)
  match = r"kind must be one of \('eagle', 'medusa', 'early_exit', 'dflash', 'dspark'\)"
  with pytest.raises(ValueError, match=match):
    pretrained.load_head("hydra", target)
  tiny = Transformer(ModelConfig(**TINY), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="trained for another target: vocab_size 512"):
    pretrained.load_head("medusa", tiny)
  # A changed file is refused, naming it.
  copy = tmp_path / "heads"
  shutil.copytree(pretrained.HEADS_DIR, copy)
  monkeypatch.setattr(pretrained, "HEADS_DIR", str(copy))
  monkeypatch.setattr(pretrained, "HEADS_CARD_FILE", str(copy / "card.json"))
  weights = copy / "medusa" / "model.safetensors"
  data = bytearray(weights.read_bytes())
  data[-1] ^= 1
  weights.write_bytes(bytes(data))
  with pytest.raises(ValueError, match=f"{weights} is corrupt or was changed"):
    pretrained.load_head("medusa", target)


def test_a_data_dir_encoded_with_a_given_tokenizer_keeps_a_copy_of_it(
  tmp_path, corpus_root, data_dir
):
  """A head's corpus is encoded with the target's tokenizer (config.data.tokenizer);
  the data dir then holds that tokenizer.json too, as generate_data reads it."""
  from specjax.training.trainer import prepare_data

  config = train_tiny.get_config()
  config.data.root = corpus_root
  config.data.dir = str(tmp_path / "encoded")
  config.data.tokenizer = os.path.join(data_dir, "tokenizer.json")
  tokenizer, paths = prepare_data(config, str(tmp_path / "run"), log=_silent)
  copied = os.path.join(config.data.dir, "tokenizer.json")
  with open(copied) as a, open(config.data.tokenizer) as b:
    assert json.load(a) == json.load(b)
  assert sorted(paths) == ["test", "train", "validation"]
