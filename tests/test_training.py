"""Corpus, tokenizer, training, checkpoints and resume (issue 3), on a tiny config.

The corpus fixture copies a few real standard-library files per split into a
temporary root, keeping their relative paths (so their split is unchanged),
and trains a 512-token BPE on them, keeping the whole pipeline small.
"""

import json
import os
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from configs import train_tiny
from helpers import copy_corpus, tiny_token_data
from specjax import losses
from specjax.data import (
  SPLITS,
  TokenDataset,
  Tokenizer,
  corpus_files,
  prepare_splits,
  split_of,
  train_tokenizer,
)
from specjax.data.corpus import read_source
from specjax.training import (
  Checkpointer,
  CheckpointError,
  check_config,
  load_trained_model,
  train,
)

FILES_PER_SPLIT = {"train": 24, "validation": 3, "test": 3}


@pytest.fixture(scope="module")
def corpus_root(tmp_path_factory):
  return copy_corpus(tmp_path_factory.mktemp("stdlib"), FILES_PER_SPLIT)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, corpus_root):
  return tiny_token_data(str(tmp_path_factory.mktemp("data")), corpus_root)


def _config(corpus_root, data_dir, **changes):
  config = train_tiny.get_config()
  config.data.root = corpus_root
  config.data.dir = data_dir
  config.update(changes)
  return config


def test_splits_are_deterministic_and_disjoint():
  assert split_of("json/decoder.py") == split_of("json/decoder.py")
  files = {s: set(corpus_files(s)) for s in SPLITS}
  assert all(files.values())
  assert not (files["train"] & files["test"]) and not (files["validation"] & files["test"])
  total = sum(len(f) for f in files.values())
  assert 0.02 < len(files["test"]) / total < 0.08  # ~5% by the hash rule
  assert not any("site-packages" in p for f in files.values() for p in f)


def test_tokenizer_round_trips_real_files(data_dir):
  tokenizer = Tokenizer.from_file(os.path.join(data_dir, "tokenizer.json"))
  assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == (0, 1, 2)
  assert tokenizer.vocab_size == 512
  for path in corpus_files("test")[:5]:
    text = read_source(path)
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert max(ids) < 512 and len(ids) < len(text.encode())  # merges were learned


def test_bundled_tokenizer_round_trips_test_split():
  from specjax import pretrained

  tokenizer = Tokenizer.from_file(pretrained.TOKENIZER_FILE)
  assert tokenizer.vocab_size == 4096
  for path in corpus_files("test")[:10]:
    text = read_source(path)
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_tokenizer_errors_name_the_path(tmp_path):
  with pytest.raises(FileNotFoundError, match="nowhere/tokenizer.json"):
    Tokenizer.from_file(str(tmp_path / "nowhere" / "tokenizer.json"))
  bad = tmp_path / "tokenizer.json"
  bad.write_text("{not json")
  with pytest.raises(ValueError, match=str(bad)):
    Tokenizer.from_file(str(bad))


def test_token_files_and_batches(data_dir):
  meta = json.loads(pathlib.Path(data_dir, "train.json").read_text())
  data = TokenDataset(os.path.join(data_dir, "train.bin"))
  assert len(data) == meta["tokens"] and meta["files"] == FILES_PER_SPLIT["train"]
  a = data.batch(7, 4, 32, seed=0)
  assert a.shape == (4, 33) and a.dtype == np.int32
  np.testing.assert_array_equal(a, data.batch(7, 4, 32, seed=0))  # pure in (seed, step)
  assert not np.array_equal(a, data.batch(8, 4, 32, seed=0))
  halves = [data.batch(7, 4, 32, seed=0, process_index=i, process_count=2) for i in (0, 1)]
  np.testing.assert_array_equal(np.concatenate(halves), a)  # processes split one batch
  with pytest.raises(ValueError, match="divisible by the process count 3"):
    data.batch(0, 4, 32, seed=0, process_count=3)


def test_few_steps_lower_the_loss(tmp_path, corpus_root, data_dir):
  history = train(
    _config(
      corpus_root,
      data_dir,
      num_steps=12,
      learning_rate=1e-2,
      eval_every=12,
      log_every=12,
      checkpoint_every=12,
    ),
    str(tmp_path),
    echo=lambda _: None,
  )
  losses_ = [r["loss"] for r in history]
  assert len(losses_) == 12 and all(np.isfinite(losses_))
  assert np.mean(losses_[-3:]) < losses_[0] - 0.5


def test_resume_continues_with_identical_losses(tmp_path, corpus_root, data_dir):
  config = _config(corpus_root, data_dir)  # 6 steps, a checkpoint every 2
  straight = train(config, str(tmp_path / "a"), echo=lambda _: None)
  # Interrupted after step 3: the last checkpoint is step 2, so step 3 is redone.
  first = train(config, str(tmp_path / "b"), stop_after=3, echo=lambda _: None)
  lines = []
  resumed = train(config, str(tmp_path / "b"), echo=lines.append)
  assert "resuming at step 2/6" in lines[0]
  assert [r["step"] for r in first] == [1, 2, 3]
  assert [r["step"] for r in resumed] == [3, 4, 5, 6]
  expected = {r["step"]: r["loss"] for r in straight}
  assert [r["loss"] for r in first] == [expected[s] for s in (1, 2, 3)]
  assert [r["loss"] for r in resumed] == [expected[s] for s in (3, 4, 5, 6)]
  a, _ = load_trained_model(str(tmp_path / "a"))
  b, _ = load_trained_model(str(tmp_path / "b"))
  for x, y in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b))):
    np.testing.assert_array_equal(x, y)
  # metrics.jsonl holds each step once, although step 3 ran twice.
  steps = [
    json.loads(line)["step"]
    for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
    if "loss" in line
  ]
  assert steps == sorted(set(steps))


def test_checkpoint_save_restore_identical(tmp_path):
  from specjax.models.config import ModelConfig
  from specjax.models.transformer import Transformer

  model = Transformer(
    ModelConfig(
      vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=64, max_seq_len=32
    ),
    rngs=nnx.Rngs(3),
  )
  _, params = nnx.split(model, nnx.Param)
  tx = optax.adam(1e-3)
  opt_state = tx.init(params)
  _, opt_state = tx.update(jax.tree.map(jnp.ones_like, params), opt_state, params)
  saver = Checkpointer(str(tmp_path), save_every=1, keep=1)
  saver.save(5, params, opt_state, {"step": 5})
  saver.wait()
  blank = jax.tree.map(jnp.zeros_like, (params, opt_state))
  restored = saver.restore(5, *blank)
  saver.close()
  assert restored["meta"] == {"step": 5}
  for x, y in zip(
    jax.tree.leaves((params, opt_state)),
    jax.tree.leaves((restored["params"], restored["opt_state"])),
  ):
    np.testing.assert_array_equal(x, y)


def test_missing_and_corrupt_checkpoints_name_the_path(tmp_path, corpus_root, data_dir):
  with pytest.raises(FileNotFoundError, match="model_config.json"):
    load_trained_model(str(tmp_path / "empty"))
  run = tmp_path / "run"
  train(_config(corpus_root, data_dir, num_steps=2, eval_every=2), str(run), echo=lambda _: None)
  with pytest.raises(FileNotFoundError, match="no checkpoint for step 9 in .*checkpoints"):
    load_trained_model(str(run), step=9)
  # Corrupt every data file of the params item.
  params_dir = run / "checkpoints" / "2" / "params"
  for directory, _, files in os.walk(params_dir):
    for name in files:
      if not name.startswith("_"):
        with open(os.path.join(directory, name), "r+b") as f:
          f.write(b"\0" * 64)
  # It fails before orbax's concurrent reads start: reads still in flight when one
  # failed would land on orbax's closed event loop ("Event loop is closed").
  import orbax.checkpoint as ocp

  orbax_restores = []

  def restore(self, step, *args, **kwargs):
    orbax_restores.append(step)
    raise RuntimeError("orbax restore")

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(ocp.CheckpointManager, "restore", restore)
    with pytest.raises(CheckpointError, match=f"cannot restore checkpoint {run}/checkpoints/2"):
      load_trained_model(str(run))
  assert orbax_restores == []
  with pytest.raises(CheckpointError, match=f"cannot restore checkpoint {run}/checkpoints/2"):
    load_trained_model(str(run))
  # A run directory without checkpoints names the directory it looked in.
  shutil.rmtree(run / "checkpoints")
  with pytest.raises(FileNotFoundError, match=f"no checkpoint directory {run}/checkpoints"):
    load_trained_model(str(run))


@pytest.mark.parametrize(
  "changes, message",
  [
    (dict(loss="js"), r"config.loss must be one of \('ce', 'kl', 'tv', 'kl\+tv'\)"),
    (dict(loss="kl"), "config.teacher .* must be set exactly when"),
    (dict(teacher="/some/run"), "config.teacher .* must be set exactly when"),
    (dict(num_steps=0), "config.num_steps must be an integer >= 1"),
    (dict(warmup_steps=6), r"config.warmup_steps must be an int in \[0, num_steps=6\)"),
    (dict(learning_rate=0.0), "config.learning_rate must be in"),
    (dict(seq_len=100), "config.seq_len must be <= config.model.max_seq_len=64"),
  ],
)
def test_bad_train_config(changes, message):
  config = train_tiny.get_config()
  config.update(changes)
  with pytest.raises(ValueError, match=message):
    check_config(config)


def test_distillation_losses():
  key1, key2 = jax.random.split(jax.random.key(0))
  p = jax.random.normal(key1, (2, 3, 7))
  q = jax.random.normal(key2, (2, 3, 7))
  assert float(losses.forward_kl(p, p)) == pytest.approx(0.0, abs=1e-6)
  assert float(losses.total_variation(p, p)) == pytest.approx(0.0, abs=1e-6)
  pp, qq = jax.nn.softmax(p), jax.nn.softmax(q)
  assert float(losses.total_variation(p, q)) == pytest.approx(
    float(0.5 * jnp.abs(pp - qq).sum(-1).mean()), rel=1e-6
  )
  agree = losses.agreement(p, q)
  assert float(agree["alpha_t1"]) == pytest.approx(
    float(jnp.minimum(pp, qq).sum(-1).mean()), rel=1e-5
  )  # 1 - TV = sum min(p, q)
  assert float(agree["alpha_t0"]) == pytest.approx(float((p.argmax(-1) == q.argmax(-1)).mean()))


def test_distillation_moves_draft_toward_teacher(tmp_path, corpus_root, data_dir):
  teacher = str(tmp_path / "teacher")
  train(
    _config(
      corpus_root, data_dir, num_steps=12, learning_rate=1e-2, eval_every=12, checkpoint_every=12
    ),
    teacher,
    echo=lambda _: None,
  )
  train(
    _config(
      corpus_root,
      data_dir,
      loss="tv",
      teacher=teacher,
      num_steps=12,
      learning_rate=1e-2,
      eval_every=12,
      checkpoint_every=12,
      seed=1,
    ),
    str(tmp_path / "draft"),
    echo=lambda _: None,
  )
  with open(tmp_path / "draft" / "metrics.jsonl") as f:
    records = [json.loads(line) for line in f]
  steps = [r for r in records if "distill" in r]
  assert steps[-1]["distill"] < steps[0]["distill"]
  assert 0 <= records[-1]["val_alpha_t1"] <= 1
  assert records[-1]["val_alpha_t1"] > steps[0]["alpha_t1"]


def test_init_from_starts_from_another_run(tmp_path, corpus_root, data_dir):
  base = str(tmp_path / "base")
  train(
    _config(corpus_root, data_dir, num_steps=4, checkpoint_every=4, eval_every=4),
    base,
    echo=lambda _: None,
  )
  lines = []
  train(
    _config(
      corpus_root,
      data_dir,
      num_steps=2,
      init_from=base,
      eval_every=2,
      learning_rate=1e-9,
      warmup_steps=0,
    ),
    str(tmp_path / "fine"),
    echo=lines.append,
  )
  assert any(f"initialised from {base} step 4" in line for line in lines)
  base_model, _ = load_trained_model(base)
  fine_model, _ = load_trained_model(str(tmp_path / "fine"))
  for x, y in zip(jax.tree.leaves(nnx.state(base_model)), jax.tree.leaves(nnx.state(fine_model))):
    np.testing.assert_allclose(x, y, atol=1e-6)  # a tiny learning rate barely moves it
  bad = _config(corpus_root, data_dir, num_steps=2, init_from=base)
  bad.model.d_model = 64
  with pytest.raises(ValueError, match="holds a different model"):
    train(bad, str(tmp_path / "bad"), echo=lambda _: None)


def _copy_data(data_dir, dest):
  shutil.copytree(data_dir, dest)
  return str(dest)


def _silent(_):
  pass


def test_stale_token_files_are_refused(tmp_path, corpus_root, data_dir):
  # Token files of a 600-id tokenizer whose tokenizer.json is gone: a 512-id run
  # must not train a new tokenizer next to them and feed it their ids.
  stale = str(tmp_path / "stale")
  prepare_splits(
    stale,
    train_tokenizer(corpus_files("train", corpus_root), vocab_size=600),
    corpus_root,
    log=_silent,
  )
  with pytest.raises(ValueError, match=f"{stale}/train.bin .*600 ids.*512 ids"):
    train(_config(corpus_root, stale), str(tmp_path / "run"), echo=_silent)
  assert not os.path.exists(os.path.join(stale, "tokenizer.json"))
  # The same vocabulary size but another tokenizer: the hashes differ.
  from specjax.data.dataset import tokenizer_sha256

  other = train_tokenizer(corpus_files("train", corpus_root)[:12], vocab_size=512)
  other_path = str(tmp_path / "other.json")
  other.save(other_path)
  copy = _copy_data(data_dir, tmp_path / "copy")
  config = _config(corpus_root, copy)
  config.data.tokenizer = other_path
  with pytest.raises(
    ValueError, match=f"{copy}/train.bin .*sha256 [0-9a-f]{{64}}.*sha256 {tokenizer_sha256(other)}"
  ):
    train(config, str(tmp_path / "run2"), echo=_silent)


def test_validation_smaller_than_one_eval_batch(tmp_path, corpus_root, data_dir):
  small = _copy_data(data_dir, tmp_path / "data")
  val = os.path.join(small, "validation.bin")
  np.fromfile(val, np.uint16)[:100].tofile(val)
  meta = json.loads(pathlib.Path(small, "validation.json").read_text())
  with open(os.path.join(small, "validation.json"), "w") as f:
    json.dump(dict(meta, tokens=100), f)
  run = tmp_path / "run"
  with pytest.raises(ValueError, match=f"{val} holds 100 tokens.*batch_size 4 .*seq_len 32"):
    train(_config(corpus_root, small), str(run), echo=_silent)
  assert not os.path.exists(run / "checkpoints")


def test_failed_run_leaves_no_temporary_checkpoint(tmp_path, corpus_root, data_dir):
  def interrupt(line):
    if line.startswith("step 3/"):  # step 2's checkpoint is still being written
      raise RuntimeError("interrupted")

  with pytest.raises(RuntimeError, match="interrupted"):
    train(_config(corpus_root, data_dir), str(tmp_path), echo=interrupt)
  names = os.listdir(tmp_path / "checkpoints")
  assert "2" in names and not [n for n in names if "tmp" in n], names
  # A killed run's leftover is removed by the next start.
  leftover = tmp_path / "checkpoints" / "4.orbax-checkpoint-tmp"
  leftover.mkdir()
  train(_config(corpus_root, data_dir), str(tmp_path), stop_after=3, echo=_silent)
  assert not leftover.exists()


def test_resume_drops_a_partial_last_metrics_line(tmp_path, corpus_root, data_dir):
  config = _config(corpus_root, data_dir)
  train(config, str(tmp_path), stop_after=3, echo=_silent)
  path = tmp_path / "metrics.jsonl"
  with open(path, "a") as f:
    f.write('{"step": 4, "loss": 2.')  # killed during an append
  resumed = train(config, str(tmp_path), stop_after=4, echo=_silent)
  assert [r["step"] for r in resumed] == [3, 4]
  steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
  assert steps == sorted(steps) and steps[-1] == 4
  lines = path.read_text().splitlines(keepends=True)
  lines[1] = "garbage\n"
  path.write_text("".join(lines))
  with pytest.raises(ValueError, match=f"{path}:2"):
    train(config, str(tmp_path), echo=_silent)


def test_resume_with_another_model_is_refused_before_writing(tmp_path, corpus_root, data_dir):
  train(_config(corpus_root, data_dir, num_steps=2, eval_every=2), str(tmp_path), echo=_silent)
  files = ("model_config.json", "metrics.jsonl")
  before = {name: (tmp_path / name).read_bytes() for name in files}
  other = _config(corpus_root, data_dir, num_steps=4, eval_every=2)
  other.model.d_model = 64
  with pytest.raises(ValueError, match=r"model_config.json.*d_model \(32 saved, 64 configured\)"):
    train(other, str(tmp_path), echo=_silent)
  assert {name: (tmp_path / name).read_bytes() for name in files} == before
  assert load_trained_model(str(tmp_path))[1] == 2


def test_a_non_finite_loss_stops_the_run(tmp_path, corpus_root, data_dir, monkeypatch):
  monkeypatch.setattr(losses, "cross_entropy", lambda logits, targets: jnp.float32(jnp.nan))
  with pytest.raises(FloatingPointError, match="step 1: the loss is nan"):
    train(_config(corpus_root, data_dir), str(tmp_path), echo=_silent)


def test_bad_token_files_name_the_path(tmp_path, data_dir):
  copy = _copy_data(data_dir, tmp_path / "data")
  path = os.path.join(copy, "train.bin")
  size = os.path.getsize(path)
  os.truncate(path, size - 1)
  with pytest.raises(ValueError, match=f"{path} .*{size - 1} bytes.*not a multiple of 2"):
    TokenDataset(path)
  os.truncate(path, size - 2)
  with pytest.raises(
    ValueError, match=f"{path} holds {size // 2 - 1} tokens.*train.json records {size // 2}"
  ):
    TokenDataset(path)
  val = os.path.join(copy, "validation.bin")
  os.truncate(val, 0)
  with pytest.raises(ValueError, match=f"{val} holds no tokens"):
    TokenDataset(val)


def test_train_and_eval_steps_run_without_a_run_directory(tiny_cfg):
  from specjax.models.transformer import Transformer
  from specjax.training import trainer

  graphdef, params = nnx.split(Transformer(tiny_cfg, rngs=nnx.Rngs(0)), nnx.Param)
  optimizer = optax.adam(1e-2)
  opt_state = jax.jit(optimizer.init)(params)  # jitted: one program, not one per eager op
  batch = jax.random.randint(jax.random.key(0), (2, 17), 0, tiny_cfg.vocab_size)
  objective = jax.jit(trainer.objective, static_argnames="graphdef")
  loss, metrics = objective(params, batch, graphdef=graphdef)
  assert set(metrics) == {"ce"} and float(loss) == pytest.approx(float(metrics["ce"]))
  first = trainer.eval_step(params, batch, graphdef=graphdef)
  assert set(first) == {"ce"}
  for _ in range(5):
    params, opt_state, metrics = trainer.train_step(
      params, opt_state, batch, graphdef=graphdef, optimizer=optimizer
    )
  assert set(metrics) == {"ce", "loss", "grad_norm"}
  last = trainer.eval_step(params, batch, graphdef=graphdef)
  assert float(last["ce"]) < float(first["ce"]) - 0.5
  teacher = Transformer(tiny_cfg, rngs=nnx.Rngs(1))
  distill = trainer.eval_step(params, batch, teacher, graphdef=graphdef, loss="kl+tv")
  assert set(distill) == {"ce", "distill", "alpha_t0", "alpha_t1"}


def test_generated_data_ends_samples_with_the_tokenizers_eos(tmp_path, corpus_root):
  from tokenizers import ByteLevelBPETokenizer

  from specjax.training.continuations import write_continuations

  # Specials in another order: <eos> is id 0 here, not 2.
  bpe = ByteLevelBPETokenizer()
  bpe.train_from_iterator(
    (read_source(p) for p in corpus_files("train", corpus_root)),
    vocab_size=512,
    special_tokens=["<eos>", "<pad>", "<bos>"],
    show_progress=False,
  )
  tokenizer = Tokenizer(bpe._tokenizer)
  assert tokenizer.eos_id == 0
  data = str(tmp_path / "data")
  os.makedirs(data)
  tokenizer.save(os.path.join(data, "tokenizer.json"))
  prepare_splits(data, tokenizer, corpus_root, log=_silent)
  run = str(tmp_path / "run")
  train(_config(corpus_root, data, num_steps=2, eval_every=2), run, echo=_silent)
  out = str(tmp_path / "gen")
  meta = write_continuations(
    run, data, out, num_batches=2, batch_size=2, prompt_tokens=8, new_tokens=4, seed=0, log=_silent
  )
  tokens = np.fromfile(os.path.join(out, "train.bin"), np.uint16).reshape(4, 13)
  assert meta["tokens"] == tokens.size and (tokens[:, -1] == 0).all()
  assert TokenDataset(os.path.join(out, "train.bin")).path.endswith("train.bin")
  prepare_splits(out, tokenizer, corpus_root, log=_silent)  # its files match the tokenizer


def test_dtype_names_are_checked(tmp_path):
  config = train_tiny.get_config()
  config.model.param_dtype = "fp32"
  with pytest.raises(
    ValueError,
    match=r"config.model.param_dtype must be one of "
    r"\['bfloat16', 'float16', 'float32'\]",
  ):
    check_config(config)
  with pytest.raises(ValueError, match=r"^dtype must be one of"):
    load_trained_model(str(tmp_path / "nowhere"), dtype="fp16")


def test_a_missing_data_dir_is_built_only_as_the_corpus(tmp_path, corpus_root, data_dir):
  """Issue 28: phase 2 on a missing data dir (runs/data_gen) is refused before
  anything is written, naming --config.data.dir and the command that makes it;
  the config's corpus directory (or <workdir>/data) is encoded on first use."""
  from configs import distill_draft_gen, train_eagle
  from specjax.training.trainer import check_data

  gen = str(tmp_path / "data_gen")
  run = tmp_path / "eagle"
  config = train_eagle.get_config()
  config.data.dir = gen
  with pytest.raises(
    FileNotFoundError,
    match=rf"^--config.data.dir={gen}: no such directory\. Only the corpus directory "
    r"\(config.data.corpus_dir=runs/data\) .* python -m experiments.generate_data "
    rf"--target=.*stdlib_pair/target --data_dir=runs/data --out={gen} ",
  ):
    train(config, str(run), echo=_silent)
  assert not run.exists() and not os.path.exists(gen)
  # A directory with some splits only (an interrupted generate_data) is no better.
  os.makedirs(gen)
  shutil.copyfile(os.path.join(data_dir, "test.bin"), os.path.join(gen, "test.bin"))
  shutil.copyfile(os.path.join(data_dir, "test.json"), os.path.join(gen, "test.json"))
  with pytest.raises(FileNotFoundError, match="no token files train.bin, validation.bin"):
    check_data(config, str(run))
  # Distillation's phase 2 names its teacher in the command.
  config = distill_draft_gen.get_config()
  config.data.dir, config.teacher = str(tmp_path / "nowhere"), "runs/target"
  with pytest.raises(FileNotFoundError, match="generate_data --target=runs/target --data_dir"):
    check_data(config, str(run))
  # Built on first use: the corpus directory itself, <workdir>/data, and any
  # directory of a config that names no corpus directory (train_tiny).
  for dir_, corpus_dir in (("runs/data", "runs/data"), ("", "runs/data"), (gen, "")):
    config.data.dir, config.data.corpus_dir = dir_, corpus_dir
    check_data(config, str(run))
  # An existing data dir is used as it is.
  config.data.dir, config.data.corpus_dir = data_dir, "runs/data"
  check_data(config, str(run))


def test_runs_a_config_reads_are_checked_before_any_data(tmp_path, corpus_root):
  """A missing teacher or init_from run is one line naming the flag, before the
  corpus is encoded."""
  data = str(tmp_path / "data")
  for name, message in (
    ("teacher", r"^--config.teacher: .*nowhere: no such run directory$"),
    ("init_from", r"^--config.init_from: .*nowhere: no such run directory$"),
  ):
    config = _config(corpus_root, data, **{name: str(tmp_path / "nowhere")})
    if name == "teacher":
      config.loss = "kl"
    with pytest.raises(FileNotFoundError, match=message):
      train(config, str(tmp_path / "run"), echo=_silent)
  assert not os.path.exists(data) and not os.path.exists(tmp_path / "run")
