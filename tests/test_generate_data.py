"""Self-distilled data (issue 32): the bundled target answers prompts from jsonl, txt
and parquet files; the shards are deterministic, resumable and read back as training
documents."""

import json

import jax
import pytest

from experiments.generate_data import write_responses
from specjax import pretrained
from specjax.data.chat import ChatTemplate
from specjax.data.files import read_documents, source_files

SMALL = dict(batch_size=4, max_new_tokens=6, max_prompt_tokens=64)


def _silent(_):
  pass


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
  root = tmp_path_factory.mktemp("prompts")
  with open(root / "chats.jsonl", "w") as f:
    for i in range(4):
      messages = [
        {"role": "user", "content": f"def f{i}(x):"},
        {"role": "assistant", "content": "  return x"},
        {"role": "user", "content": f"import os{i}"},
        {"role": "assistant", "content": "old answer, replaced"},
      ]
      f.write(json.dumps({"messages": messages}) + "\n")
    f.write(json.dumps({"text": "class A:"}) + "\n")
  (root / "long.txt").write_text("x = 1\n" * 200)  # over max_prompt_tokens: skipped
  return str(root)


def _lines(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


def test_responses_are_chats_deterministic_and_resume_exactly(tmp_path, prompts):
  target = pretrained.TARGET_DIR
  meta = write_responses(target, prompts, str(tmp_path / "a"), **SMALL, log=_silent)
  assert meta["prompts"] == 6 and meta["skipped"] == 1 and meta["written"] == 5
  shard = tmp_path / "a" / "part-00000-of-00001.jsonl"
  assert meta["file"] == str(shard)
  lines = _lines(shard)
  assert len(lines) == 5 and lines[0]["source"].endswith("chats.jsonl:1")
  # Cut after the last user turn, then the target's own answer.
  first = lines[0]["messages"]
  assert [m["role"] for m in first] == ["user", "assistant", "user", "assistant"]
  assert first[2]["content"] == "import os0" and first[3]["content"] != "old answer, replaced"
  assert lines[4]["messages"][0] == {"role": "user", "content": "class A:"}
  # The shard reads back as training documents in the target's template.
  template = ChatTemplate.from_checkpoint(target)
  docs = list(read_documents(source_files(str(tmp_path / "a"))[0], template))
  assert docs[0][1] == template.render(first)

  # An interrupted run (one whole batch and half a line written) resumes to the same file.
  with open(shard) as f:
    text = f.read()
  cut = tmp_path / "b" / shard.name
  cut.parent.mkdir()
  kept = text.splitlines(keepends=True)
  cut.write_text("".join(kept[:4]) + kept[4][:10])
  resumed = write_responses(target, prompts, str(tmp_path / "b"), **SMALL, log=_silent)
  assert resumed["resumed_batches"] == 1
  assert cut.read_text() == text
  # A finished shard is left as it is.
  assert (
    write_responses(target, prompts, str(tmp_path / "b"), **SMALL, log=_silent)["resumed_batches"]
    == 2
  )
  assert cut.read_text() == text


def test_each_process_writes_its_own_shard(tmp_path, prompts, monkeypatch):
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  meta = write_responses(pretrained.TARGET_DIR, prompts, str(tmp_path), **SMALL, log=_silent)
  lines = _lines(tmp_path / "part-00001-of-00002.jsonl")
  assert meta["prompts"] == 3  # prompts 1, 3, 5 of 6
  assert [line["source"].rsplit(":", 1)[-1] for line in lines] == ["2", "4"]


def test_sampled_responses_follow_the_seed(tmp_path, prompts):
  def run(name, seed):
    write_responses(
      pretrained.TARGET_DIR,
      prompts,
      str(tmp_path / name),
      **SMALL,
      temperature=1.0,
      seed=seed,
      log=_silent,
    )
    return (tmp_path / name / "part-00000-of-00001.jsonl").read_text()

  assert run("a", 0) == run("b", 0) != run("c", 1)


@pytest.mark.parametrize(
  "changes, error",
  [
    (dict(prompts="nope.jsonl"), "--prompts: nope.jsonl: no such file"),
    (dict(max_prompt_tokens=600), r"--max_prompt_tokens must be in \[16, 506\]"),
    (dict(target="org/missing"), "--target: org/missing"),
  ],
)
def test_bad_arguments_are_named(tmp_path, prompts, changes, error):
  args = dict(target=pretrained.TARGET_DIR, prompts=prompts, out=str(tmp_path), **SMALL)
  with pytest.raises((ValueError, FileNotFoundError), match=error):
    write_responses(**{**args, **changes}, log=_silent)
