"""Training on your own files (issue 32): .txt, .jsonl (text or chats) and .parquet
documents, tokenized with the target's tokenizer and chat template; errors naming the
file and line; exact resume; a hub repo id as the target."""

import json
import os

import numpy as np
import pytest

from configs import train_tiny
from data_fixtures import TEMPLATE, user_chats, user_checkpoint
from helpers import COMMIT, copy_corpus, hub_cache
from specjax import pretrained
from specjax.data import TokenDataset
from specjax.data.chat import ChatTemplate
from specjax.data.dataset import write_meta
from specjax.data.files import encode_files, read_documents, source_files
from specjax.hf import load_tokenizer
from specjax.training import train


def _silent(_):
  pass


@pytest.fixture(scope="module")
def corpus_root(tmp_path_factory):
  return copy_corpus(tmp_path_factory.mktemp("stdlib"), {"train": 6, "validation": 1, "test": 1})


@pytest.fixture(scope="module")
def target(tmp_path_factory, corpus_root):
  return user_checkpoint(str(tmp_path_factory.mktemp("target")), corpus_root)


@pytest.fixture(scope="module")
def chats(tmp_path_factory, corpus_root):
  return user_chats(str(tmp_path_factory.mktemp("user")), corpus_root)


def _write(path, text):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    f.write(text)
  return path


def test_source_files_sorted_recursive_and_named_errors(tmp_path):
  for name in ("b/z.jsonl", "b/a/y.txt", "a.parquet", "b/skip.csv"):
    _write(str(tmp_path / name), "")
  assert source_files(f"{tmp_path}/b,{tmp_path}/a.parquet") == [
    f"{tmp_path}/b/a/y.txt",
    f"{tmp_path}/b/z.jsonl",
    f"{tmp_path}/a.parquet",
  ]
  with pytest.raises(FileNotFoundError, match="config.data.files: .*nope: no such file"):
    source_files(f"{tmp_path}/nope")
  with pytest.raises(ValueError, match="skip.csv: the suffix must be one of"):
    source_files(f"{tmp_path}/b/skip.csv")


@pytest.mark.parametrize(
  "line, error",
  [
    ("{not json", r"bad.jsonl:2: not a JSON object"),
    ('{"txt": "a"}', r"bad.jsonl:2: expected an object with a 'text' string or 'messages'"),
    ('{"messages": [{"role": "bot", "content": "x"}]}', r"bad.jsonl:2: messages\[0\].role"),
  ],
)
def test_bad_jsonl_lines_are_named(tmp_path, line, error):
  path = _write(str(tmp_path / "bad.jsonl"), '{"text": "fine"}\n' + line + "\n")
  with pytest.raises(ValueError, match=error):
    list(read_documents(path, ChatTemplate(TEMPLATE)))


def test_a_chat_needs_the_targets_template(tmp_path):
  path = _write(
    str(tmp_path / "c.jsonl"), json.dumps({"messages": [{"role": "user", "content": "hi"}]})
  )
  with pytest.raises(ValueError, match="c.jsonl:1: a chat, but the target has no chat template"):
    list(read_documents(path, None))


def test_parquet_text_and_messages_columns(tmp_path):
  pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
  messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
  pq.write_table(pa.table({"text": ["one", "two"]}), tmp_path / "t.parquet")
  pq.write_table(pa.table({"messages": [messages]}), tmp_path / "m.parquet")
  pq.write_table(pa.table({"body": ["x"]}), tmp_path / "bad.parquet")
  template = ChatTemplate(TEMPLATE, {"bos_token": "<bos>", "eos_token": "<eos>"})
  assert [d[1] for d in read_documents(str(tmp_path / "t.parquet"), template)] == ["one", "two"]
  ((where, text, got),) = read_documents(str(tmp_path / "m.parquet"), template)
  assert where.endswith("m.parquet row 0") and got == messages
  assert text == "<bos><|user|>\nhi<eos><|assistant|>\nyo<eos>"
  with pytest.raises(ValueError, match="bad.parquet: expected a 'text' or 'messages' column"):
    list(read_documents(str(tmp_path / "bad.parquet"), template))


class _WideTokenizer:
  """A 100,000-id vocabulary (as Llama-3's 128k): each text's ids are fixed large values."""

  vocab_size = 100_000

  def encode_batch(self, texts, special=True):
    return [[70_000 + len(t), 99_999] for t in texts]


def test_documents_end_in_eos_split_every_kth_and_widen_to_uint32(tmp_path):
  path = _write(str(tmp_path / "d.jsonl"), "".join(f'{{"text": "{"x" * i}"}}\n' for i in range(6)))
  written = {}

  def write(split, tokens, meta):
    out = str(tmp_path / f"{split}.bin")
    tokens.tofile(out)
    write_meta(out, {**meta, "tokens": int(tokens.size)})
    written[split] = TokenDataset(out)

  encode_files([path], _WideTokenizer(), 99_998, None, 3, write)
  # Documents 3 and 6 (1-based) are validation, each followed by the EOS.
  np.testing.assert_array_equal(
    written["validation"].tokens, [70_002, 99_999, 99_998, 70_005, 99_999, 99_998]
  )
  assert written["train"].meta["dtype"] == "uint32" and len(written["train"]) == 12
  assert written["train"].meta["sources"][0]["sha256"]


def _config(target, files, **changes):
  config = train_tiny.get_config()  # batch 4 x 32 tokens, 6 steps, checkpoints every 2
  config.loss = "kl"
  config.data.files = files
  config.data.validation_every = 6
  config.head.update(kind="eagle", target=target, d_ff=64, feature_noise=0.1)
  config.update(changes)
  return config


def test_chats_train_with_the_targets_template_and_resume_exactly(tmp_path, target, chats):
  """A user's checkpoint and folder of chats: encoded once with the target's
  tokenizer and template, and a resumed run gives the uninterrupted run's losses."""
  config = _config(target, chats)
  full = train(config, str(tmp_path / "a"), echo=_silent)
  data = str(tmp_path / "a" / "data")
  tokenizer = load_tokenizer(target)
  val = TokenDataset(os.path.join(data, "validation.bin"))
  assert val.meta["documents"] == 4 and val.meta["eos_id"] == 2
  # The first validation document: the chat rendered by the target's template, then EOS.
  with open(os.path.join(chats, "part-0.jsonl")) as f:
    sixth = json.loads(f.readlines()[5])["messages"]
  template = ChatTemplate.from_checkpoint(target)
  first = tokenizer.encode_batch([template.render(sixth)], special=False)[0] + [2]
  np.testing.assert_array_equal(val.tokens[: len(first)], first)
  assert val.tokens[0] == tokenizer.bos_id  # the template's BOS, once

  train(config, str(tmp_path / "b"), stop_after=3, echo=_silent)
  resumed = train(config, str(tmp_path / "b"), echo=_silent)
  assert [r["step"] for r in resumed] == [3, 4, 5, 6]  # from the checkpoint at step 2
  assert [r["loss"] for r in resumed] == [r["loss"] for r in full[2:]]

  # A changed file is named on resume; so is other data for the same run.
  with open(os.path.join(chats, "part-1.jsonl"), "a") as f:
    f.write(json.dumps({"text": "one more"}) + "\n")
  try:
    with pytest.raises(ValueError, match=r"part-1.jsonl changed since"):
      train(config, str(tmp_path / "b"), echo=_silent)
    other = _config(target, chats, num_steps=8)
    other.data.dir = str(tmp_path / "other")
    with pytest.raises(ValueError, match="config.data.files: the run in .* other data"):
      train(other, str(tmp_path / "b"), echo=_silent)
  finally:
    with open(os.path.join(chats, "part-1.jsonl")) as f:
      lines = f.readlines()[:-1]
    with open(os.path.join(chats, "part-1.jsonl"), "w") as f:
      f.writelines(lines)


def test_target_as_a_hub_repo_id(tmp_path, monkeypatch, target, chats):
  from huggingface_hub import constants

  cache = hub_cache(tmp_path / "hub", "org/tiny", target)
  monkeypatch.setattr(constants, "HF_HUB_CACHE", cache)
  history = train(_config("org/tiny", chats, num_steps=2), str(tmp_path / "run"), echo=_silent)
  assert len(history) == 2
  assert os.path.isdir(os.path.join(cache, "models--org--tiny", "snapshots", COMMIT))
  with pytest.raises(FileNotFoundError, match="config.head.target: org/missing"):
    train(_config("org/missing", chats), str(tmp_path / "run2"), echo=_silent)


def test_the_trained_head_decodes_with_experiments_decode(tmp_path, target, chats):
  """The user's case end to end: train on the chats, then `experiments.decode
  --config.drafter=eagle --config.head=RUN` drafts for that target, exactly."""
  from configs import decode as decode_config
  from specjax.jobs import decode

  run = str(tmp_path / "head")
  train(_config(target, chats, num_steps=2), run, echo=_silent)
  config = decode_config.get_config()
  config.update(target=target, draft=target, drafter="eagle", head=run, prompt="def f(x):")
  config.update(max_new_tokens=8, num_runs=3, report_floor=False)
  result = decode.run(config)
  assert result["texts_identical"] is True and result["draft"] == f"eagle: {run}"


def test_a_model_trains_on_txt_files_with_config_data_tokenizer(tmp_path, target, corpus_root):
  from specjax.data import corpus_files
  from specjax.data.corpus import read_source

  for i, path in enumerate(corpus_files("train", corpus_root)):
    _write(str(tmp_path / "docs" / f"{i}.txt"), read_source(path)[:3000])
  config = train_tiny.get_config()
  config.update(num_steps=2, eval_every=2)
  config.data.update(files=str(tmp_path / "docs"), validation_every=3)
  with pytest.raises(ValueError, match="config.data.tokenizer must name the tokenizer.json"):
    train(config, str(tmp_path / "run"), echo=_silent)
  config.data.tokenizer = os.path.join(target, "tokenizer.json")
  assert len(train(config, str(tmp_path / "run"), echo=_silent)) == 2
  meta = TokenDataset(str(tmp_path / "run" / "data" / "validation.bin")).meta
  assert meta["documents"] == 2 and meta["dtype"] == "uint16" and meta["eos_id"] == 2


def test_parquet_without_pyarrow_says_how_to_install(tmp_path, monkeypatch):
  import sys

  monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # an import of it fails
  path = _write(str(tmp_path / "t.parquet"), "")
  with pytest.raises(ValueError, match="t.parquet: reading .parquet needs pyarrow: pip install"):
    list(read_documents(path, None))


def test_a_target_without_tokenizer_json_needs_its_own_tokenizer(tmp_path, target, chats):
  """The head configs' default tokenizer is the bundled pair's: never used for another target."""
  import shutil

  bare = shutil.copytree(target, str(tmp_path / "bare"))
  os.remove(os.path.join(bare, "tokenizer.json"))
  config = _config(bare, chats)
  config.data.tokenizer = pretrained.TOKENIZER_FILE
  with pytest.raises(ValueError, match="config.data.tokenizer must name the tokenizer.json"):
    train(config, str(tmp_path / "run"), echo=_silent)
