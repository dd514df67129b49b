"""Checkpoints as users name them: hub repo ids from a local Hugging Face cache,
generation settings from the checkpoint, and the pair check. Offline: the
tests build the cache layout on disk."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
import specjax.hf
from experiments.make_hf_checkpoint import make_checkpoint
from helpers import COMMIT, hub_cache


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  return make_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "tiny"), "llama", "tiny", 512)


def test_repo_ids_load_offline_from_the_cache(checkpoint, tmp_path):
  cache = hub_cache(tmp_path / "hub", "org/tiny", checkpoint)
  model, tokenizer = specjax.hf.load_model("org/tiny", dtype=jnp.float32, cache_dir=cache)
  local, _ = specjax.hf.load_model(checkpoint, dtype=jnp.float32)
  same = jax.tree.map(np.array_equal, nnx.state(model, nnx.Param), nnx.state(local, nnx.Param))
  assert all(jax.tree.leaves(same)) and tokenizer.vocab_size == 512
  by_commit = specjax.hf.resolve_checkpoint("org/tiny", revision=COMMIT, cache_dir=cache)
  assert by_commit.endswith(COMMIT)


@pytest.mark.parametrize(
  "name, revision, error, message",
  [
    (
      "org/missing",
      None,
      FileNotFoundError,
      r"org/missing: no such local directory, and the "
      r"Hugging Face cache .*hub has no snapshot of repo 'org/missing' at revision main",
    ),
    ("org/tiny", "v2", FileNotFoundError, r"at revision v2; downloads are off"),
    ("/no/such/dir", None, FileNotFoundError, r"/no/such/dir does not exist \(and it is not a hub"),
    ("", None, ValueError, r"must be named by a non-empty string"),
  ],
)
def test_unresolvable_names_say_what_was_tried(
  checkpoint, tmp_path, name, revision, error, message
):
  cache = hub_cache(tmp_path / "hub", "org/tiny", checkpoint)
  with pytest.raises(error, match=message):
    specjax.hf.resolve_checkpoint(name, revision=revision, cache_dir=cache)
  with pytest.raises(ValueError, match=r"revision='v1' applies to hub repo ids"):
    specjax.hf.resolve_checkpoint(checkpoint, revision="v1")


def _with_generation_config(checkpoint, tmp_path, **gen):
  path = tmp_path / "ckpt"
  shutil.copytree(checkpoint, path)
  if gen:
    (path / "generation_config.json").write_text(json.dumps(gen))
  return str(path)


def test_generation_settings_follow_transformers(checkpoint, tmp_path):
  plain = specjax.hf.generation_settings(checkpoint)  # config.json's ids only
  assert plain == specjax.hf.GenerationSettings(specjax.GREEDY, (2,), 0)
  path = _with_generation_config(
    checkpoint, tmp_path, do_sample=True, temperature=0.7, top_p=0.9, eos_token_id=[2, 5]
  )
  settings = specjax.hf.generation_settings(path)
  # top_k left out: transformers' default 50.
  assert settings.sampling == specjax.SamplingParams(temperature=0.7, top_k=50, top_p=0.9)
  assert settings.eos_ids == (2, 5) and settings.pad_id == 0
  assert specjax.hf.sampling_from_checkpoint(path) == settings.sampling
  greedy = _with_generation_config(checkpoint, tmp_path / "g", do_sample=False, temperature=0.6)
  assert specjax.hf.sampling_from_checkpoint(greedy) == specjax.GREEDY
  # transformers' repetition penalty is specjax's (prompt and generated tokens), greedy too.
  penalised = _with_generation_config(checkpoint, tmp_path / "r", repetition_penalty=1.2)
  assert specjax.hf.sampling_from_checkpoint(penalised) == specjax.SamplingParams(
    temperature=0.0, repetition_penalty=1.2
  )


@pytest.mark.parametrize(
  "gen, error, message",
  [
    (dict(repetition_penalty=3.0), specjax.hf.UnsupportedConfigError, r"repetition_penalty=3.0"),
    (dict(min_p=0.1), specjax.hf.UnsupportedConfigError, r"min_p=0.1 is not supported"),
    (dict(num_beams=4), specjax.hf.UnsupportedConfigError, r"num_beams=4 is not supported"),
    (dict(do_sample=True, top_p=0.0), ValueError, r"generation_config.json: top_p must be"),
    (dict(eos_token_id="</s>"), ValueError, r"eos_token_id must be an id or a list of ids"),
  ],
)
def test_generation_settings_refuse_what_they_cannot_reproduce(
  checkpoint, tmp_path, gen, error, message
):
  with pytest.raises(error, match=message):
    specjax.hf.generation_settings(_with_generation_config(checkpoint, tmp_path, **gen))


def test_check_pair_reports_how_to_draft(checkpoint, tmp_path):
  same = specjax.hf.check_pair(checkpoint, checkpoint)
  assert same.drafter == "model" and not same.problems
  other = make_checkpoint(str(tmp_path / "gpt2"), "gpt2", "tiny", 300, seed=1)
  report = specjax.hf.check_pair(checkpoint, other)
  assert report.drafter == "cross_tokenizer" and not report.problems
  assert 0 < report.details["vocab_map"]["shared"] < 300
  assert "CrossTokenizerDrafter" in str(report)
  small = _with_generation_config(checkpoint, tmp_path)
  config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
  (tmp_path / "ckpt" / "config.json").write_text(json.dumps({**config, "vocab_size": 100}))
  assert "below its tokenizer's 512 ids" in specjax.hf.check_pair(small, checkpoint).problems[0]
