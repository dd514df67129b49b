"""The bundled trained pair: sizes, one-call loading, greedy exactness, the main job."""

import os

import jax
import numpy as np
import pytest

import specjax
from configs import decode as decode_config
from experiments import decode
from specjax import pretrained
from specjax.data.prompts import test_prompts
from specjax.training.evaluate import encode_prompts


@pytest.fixture(scope="module")
def pair():
  return pretrained.load_pair()


def test_bundle_sizes(pair):
  size = sum(os.path.getsize(os.path.join(d, f))
             for d, _, files in os.walk(pretrained.PAIR_DIR) for f in files)
  assert size <= 25 * 2**20
  assert pair.target.num_params >= 5_000_000
  assert pair.draft.num_params * 8 <= pair.target.num_params
  assert pair.tokenizer.vocab_size == pair.target.cfg.vocab_size == pair.draft.cfg.vocab_size
  card = pretrained.model_card()
  assert card["target"]["params"] == pair.target.num_params
  assert card["draft"]["params"] == pair.draft.num_params


def test_greedy_speculative_equals_autoregressive_on_test_prompts(pair):
  prompts, lengths = encode_prompts(pair.tokenizer, test_prompts(3))
  assert len(set(np.asarray(lengths).tolist())) > 1  # ragged rows
  kwargs = dict(max_new_tokens=32, key=jax.random.key(0))
  ar = specjax.autoregressive_generate(pair.target, prompts, lengths, **kwargs)
  spec = specjax.speculative_generate(pair.target, pair.draft, prompts, lengths, gamma=4,
                                      **kwargs)
  np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(ar.tokens))
  # A trained, distilled draft: far above what random weights accept (~0).
  assert float(spec.stats.acceptance_rate) > 0.5


def test_main_job_runs_with_no_arguments():
  config = decode_config.get_config()
  config.max_new_tokens = 16
  result = decode.run(config)
  assert result["prompt"] == test_prompts(1)[0]
  assert result["target"] == pretrained.TARGET_DIR
  assert result["texts_identical"] is True and result["ar_text"] == result["spec_text"]
  for key in ("acceptance_rate", "tokens_per_iteration", "speedup", "ar_ms_per_token",
              "spec_ms_per_token", "gamma", "temperature"):
    assert key in result
  assert 0 < result["acceptance_rate"] <= 1 and result["tokens_per_iteration"] >= 1


def test_load_pair_names_a_missing_file(monkeypatch, tmp_path):
  monkeypatch.setattr(pretrained, "DRAFT_DIR", str(tmp_path / "draft"))
  with pytest.raises(FileNotFoundError, match=str(tmp_path / "draft")):
    pretrained.load_pair()
