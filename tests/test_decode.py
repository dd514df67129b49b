"""The decode command end to end on tiny local Hugging Face checkpoints."""

import json
import os
import sys

import pytest

from configs import decode as decode_config
from experiments.make_hf_checkpoint import make_checkpoint
from helpers import COMMIT, hub_cache
from specjax.jobs import decode, drafters

# Runs in tests/test_front_door.py's process when the whole suite runs.
pytestmark = pytest.mark.front_door


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  root = tmp_path_factory.mktemp("decode")
  target = make_checkpoint(str(root / "target"), "llama", "tiny", 512, seed=0)
  draft = make_checkpoint(str(root / "draft"), "llama", "tiny", 512, seed=1)
  return target, draft


def _config(pair, **changes):
  config = decode_config.get_config()
  config.target, config.draft = pair
  config.max_new_tokens = 12
  config.report_floor = False  # measured once, in test_launchers.py's decode step
  config.update(changes)
  return config


@pytest.mark.slow  # transformers parity itself: tests/test_hf.py
def test_decode_compares_with_transformers(pair):
  result = json.loads(
    json.dumps(decode.run(_config(pair, compare_transformers=True, stop_at_eos=False)))
  )
  assert result["texts_identical"] is True
  assert result["hf_assisted_matches_spec"] is True  # same greedy tokens as transformers
  assert result["ar_text"] == result["spec_text"] and result["ar_text"]
  for key in (
    "acceptance_rate",
    "tokens_per_iteration",
    "speedup",
    "ar_ms_per_token",
    "spec_ms_per_token",
    "hf_ms_per_token",
    "hf_assisted_ms_per_token",
    "spec_over_hf_assisted",
  ):
    assert result[key] >= 0, key
  assert result["speedup"] == result["ar_ms_per_token"] / result["spec_ms_per_token"]


def test_decode_with_verify_lengths_measures_costs_and_keeps_the_text(pair):
  result = decode.run(_config(pair, verify_lengths=(1, 3), num_runs=3))
  assert result["gamma"] == 3 and result["verify_lengths"] == [1, 3]
  assert len(result["verify_costs"]) == 2 and max(result["verify_costs"]) == 1.0
  assert result["texts_identical"] is True
  assert 1 <= result["verified_per_iteration"] <= 3


def test_decode_sampled_batch(pair):
  result = decode.run(
    _config(
      pair,
      temperature=1.0,
      top_p=0.9,
      batch_size=2,
      verifier="block",
      drafter="layer_skip",
      layer_skip=1,
    )
  )
  assert "texts_identical" not in result
  assert 0 <= result["acceptance_rate"] <= 1


def test_decode_pairs_a_draft_of_another_tokenizer(pair, tmp_path_factory):
  """A GPT-2 draft with its own 300-id tokenizer for the Llama target: refused as a
  plain draft model, decoded exactly through TLI and SLEM."""
  gpt2 = make_checkpoint(str(tmp_path_factory.mktemp("gpt2") / "d"), "gpt2", "tiny", 300, seed=1)
  with pytest.raises(ValueError, match="tokenizer"):
    decode.run(_config((pair[0], gpt2)))
  for drafter in ("cross_tokenizer", "string_level"):
    result = decode.run(_config((pair[0], gpt2), drafter=drafter))
    assert result["texts_identical"] is True and result["ar_text"]
    assert 0 < result["vocab_map"]["shared"] < 300
  assert result["string_level_timings"]["iterations"] > 0


def test_decode_takes_hub_ids_and_the_checkpoints_generation_config(pair, tmp_path, monkeypatch):
  from huggingface_hub import constants

  cache = tmp_path / "hub"
  hub_cache(cache, "org/big", pair[0])
  hub_cache(cache, "org/small", pair[1])
  gen = {"do_sample": False, "temperature": 0.6, "eos_token_id": [2, 7]}
  snapshot = cache / "models--org--big" / "snapshots" / COMMIT
  (snapshot / "generation_config.json").write_text(json.dumps(gen))
  monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
  result = decode.run(_config(("org/big", "org/small"), checkpoint_sampling=True))
  assert result["target"] == str(snapshot) and result["texts_identical"] is True
  assert result["temperature"] == 0 and result["eos_ids"] == [2, 7]  # do_sample false: greedy


@pytest.mark.parametrize(
  "changes, message",
  [
    (dict(target=""), "config.target and config.draft must both name"),
    (dict(compare_transformers=True, batch_size=2), "config.batch_size must be 1"),
    (dict(dtype="int8"), "config.dtype must be float32 or bfloat16"),
    (dict(num_runs=2), r"config.num_runs must be an integer >= 3"),
    (dict(drafter="hydra"), "config.drafter must be one of model, ngram, layer_skip, eagle"),
    (dict(drafter="eagle"), "with your own config.target needs config.head"),
    (dict(draft=""), "config.target and config.draft must both name"),
    # A head drafts without a draft checkpoint: the pair check lets it through.
    (dict(drafter="eagle", draft=""), "with your own config.target needs config.head"),
    (dict(drafter="eagle", vocab_subset=-1), r"config.vocab_subset \(0: all ids\)"),
    (dict(drafter="ngram", vocab_subset=8), "config.vocab_subset applies to a draft head's"),
    (dict(head="runs/eagle"), "config.head drafts as its kind's drafter: set config.drafter"),
    (dict(compare_transformers=True, drafter="ngram"), "needs config.drafter='model'"),
    (dict(draft_dtype="float16"), r"config.draft_dtype must be '' \(config.dtype\)"),
    (dict(scale="2b"), r"config.scale must be '' \(the bundled pair as trained\) or one of 160m"),
    (dict(scale="1b"), "config.scale grows the bundled pair: it takes no config.target"),
    (dict(gamma=4, verify_lengths=(1, 2)), r"verify_lengths must be .* \[1, gamma=4\]"),
    (dict(drafter="ngram", verify_lengths=(1, 4)), "NGramDrafter does not"),
  ],
)
def test_decode_rejects(pair, changes, message):
  with pytest.raises(ValueError, match=message):
    decode.run(_config(pair, **changes))


@pytest.mark.parametrize(
  "changes, message",
  [
    (dict(constraint="sigature"), r"config.constraint must be one of '' \(none\), signature"),
    (dict(constraint="json:{not json"), "config.constraint: inline JSON is not JSON"),
    (dict(constraint="json:/nonexistent.json"), "config.constraint=json:/nonexistent.json: no"),
    (dict(constraint="choice:a||b"), "config.constraint must be one of"),
    (dict(constraint="regex:"), "config.constraint must be one of"),
    (dict(constraint="signature", drafter="string_level"), "config.constraint needs a jitted"),
    (dict(constraint="signature", stop_at_eos=False), "config.constraint needs config.stop_at"),
    (dict(prompt_set="tests"), r"config.prompt_set must be '' \(the constraint's task\)"),
  ],
)
def test_decode_rejects_a_bad_constraint_before_loading(changes, message, monkeypatch):
  """A bad config.constraint (or prompt set) is named before any model loads."""
  monkeypatch.setattr(decode, "_inputs", lambda config: pytest.fail("loaded before the check"))
  config = decode_config.get_config()
  config.update(changes)
  with pytest.raises(ValueError, match=message):
    decode.run(config)


@pytest.mark.parametrize(
  "changes, message",
  [
    (dict(prompt_file="/no/such.jsonl"), r"^config.prompt_file: /no/such.jsonl: no such file"),
    (dict(prompt="def f():"), r"config.prompt_file takes no config.prompt \("),
    (dict(constraint="signature"), r"config.prompt_file takes no config.constraint"),
    (dict(compare_transformers=True), r"config.prompt_file takes no config.compare_transformers"),
    (dict(rows='{"text": "a"}\n{"turns": "a"}\n'), r"^config.prompt_file: .*p.jsonl:2: expected"),
  ],
)
def test_decode_rejects_a_bad_prompt_file_before_loading(changes, message, tmp_path, monkeypatch):
  """A missing or malformed config.prompt_file, or one with settings it cannot go
  with, is named before any model loads."""
  monkeypatch.setattr(decode, "_inputs", lambda config: pytest.fail("loaded before the check"))
  path = tmp_path / "p.jsonl"
  path.write_text(changes.pop("rows", '{"text": "a"}\n'))
  config = decode_config.get_config()
  config.prompt_file = str(path)
  config.update(changes)
  with pytest.raises(ValueError, match=message):
    decode.run(config)


def test_decode_checks_output_json_before_decoding(tmp_path, monkeypatch):
  """An unusable --output_json fails at once, not after the whole decode."""
  blocker = tmp_path / "blocker"
  blocker.write_text("")  # a regular file where the JSON's directory should be
  monkeypatch.setattr(decode, "run", lambda config: pytest.fail("decoded before the check"))
  with pytest.raises(ValueError, match="--output_json"):
    decode.decode_and_report(decode_config.get_config(), str(blocker / "result.json"))


def test_default_gamma_falls_with_the_batch():
  """One rule for every job (`specjax.jobs.drafters`), read from the drafter itself."""
  from helpers import head_drafter, tiny_pair
  from specjax.drafting import NGramDrafter
  from specjax.jobs.drafters import default_gamma, resolve_gamma

  target, draft = tiny_pair()
  assert [default_gamma(draft, b) for b in (1, 2, 7, 8, 16, 64)] == [4, 4, 4, 1, 1, 1]
  assert [default_gamma(NGramDrafter(64, 3), b) for b in (1, 8)] == [4, 1]
  early_exit = head_drafter("early_exit", target, exit_layer=1)
  assert [default_gamma(early_exit, b) for b in (1, 8)] == [1, 1]
  block = head_drafter("dflash", target, block_size=8)
  assert [default_gamma(block, b) for b in (1, 7, 8)] == [7, 7, 1]
  assert resolve_gamma(3, block) == 3
  with pytest.raises(ValueError, match=r"config.gamma must be in \[1, 7\] for a block drafter"):
    resolve_gamma(8, block)


def test_the_result_describes_the_drafter_that_decoded():
  """Issue 28: `draft` and `draft_params` describe the drafter used (a head, the
  n-gram lookup, the target's first layers, the cross draft), not the unused
  draft model."""
  from specjax import pretrained
  from specjax.training.heads import num_params

  target, draft, tokenizer = pretrained.load_pair()
  cross, cross_tokenizer = pretrained.load_cross_draft()
  seen = {}
  for kind in decode.drafter_names():
    config = decode_config.get_config()
    config.drafter = kind
    if kind in decode.CROSS_DRAFTERS:
      args = (cross, cross_tokenizer, tokenizer, pretrained.CROSS_DRAFT_DIR)
    else:
      args = (draft, tokenizer, tokenizer, pretrained.DRAFT_DIR)
    drafter, fields = decode._drafter(config, target, args[0], *args[1:])
    seen[kind] = fields
    if kind in drafters.head_drafters():
      head = pretrained.load_head(kind, target)
      assert fields == {
        "draft": f"{kind}: {os.path.join(pretrained.HEADS_DIR, kind)}",
        "draft_params": num_params(head),
      }
  assert seen["model"] == {"draft": pretrained.DRAFT_DIR, "draft_params": draft.num_params}
  assert seen["ngram"] == {
    "draft": "ngram: prompt lookup of n-grams up to n = 3",
    "draft_params": 0,
  }
  assert seen["layer_skip"] == {
    "draft": "layer_skip: the target's first 2 of 6 layers",
    "draft_params": 0,
  }
  for kind in decode.CROSS_DRAFTERS:
    assert seen[kind] == {"draft": pretrained.CROSS_DRAFT_DIR, "draft_params": cross.num_params}
  assert len({f["draft_params"] for f in seen.values()}) == 8  # 0, draft, 5 heads, cross


def test_decode_reports_the_ngram_drafter(pair):
  result = decode.run(_config(pair, drafter="ngram", num_runs=3))
  assert result["draft"] == "ngram: prompt lookup of n-grams up to n = 3"
  assert result["draft_params"] == 0 and result["texts_identical"] is True
  assert result["draft_calls_per_iteration"] == 0  # calls counted as calls: no model


def test_compare_transformers_without_transformers_fails_before_loading(pair, monkeypatch):
  monkeypatch.setitem(sys.modules, "transformers", None)
  monkeypatch.setattr(decode, "_load", lambda *_: pytest.fail("loaded before the check"))
  with pytest.raises(
    ValueError,
    match=r"^--config.compare_transformers needs transformers, which is not installed: "
    r"pip install transformers$",
  ):
    decode.run(_config(pair, compare_transformers=True))


def test_decode_table_checks_every_row_before_the_first_runs():
  from configs import decode_table as table_config
  from specjax.jobs import decode_table

  config = table_config.get_config()
  config.rows = (dict(temperature=0.0), dict(temprature=1.0))
  with pytest.raises(ValueError, match=r"config.rows: \['temprature'\] are not fields"):
    decode_table.run(config)
  config.rows = (dict(temperature=0.0), dict(dtype="int8"))
  with pytest.raises(ValueError, match="config.dtype must be float32 or bfloat16"):
    decode_table.run(config)
  with pytest.raises(ValueError, match="preset must be one of"):
    table_config.get_config("2b")
