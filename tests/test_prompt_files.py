"""Prompt files for evaluation (issue 46): plain text paragraphs, .jsonl rows with
text / prompt / turns and categories (Spec-Bench's question.jsonl), and errors naming
the file and line."""

import json

import pytest

from specjax.data.prompts import SAMPLE_FILE, Prompt, by_category, read_prompt_file


def _jsonl(path, rows) -> str:
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
  return str(path)


def test_a_text_file_is_one_prompt_per_paragraph(tmp_path):
  path = tmp_path / "p.txt"
  path.write_text("\n\ndef f(x):\n    return x\n\n \n# a comment\n\nlast line, no newline")
  assert read_prompt_file(str(path)) == [
    Prompt("def f(x):\n    return x\n"),
    Prompt("# a comment\n"),
    Prompt("last line, no newline"),
  ]


def test_jsonl_takes_text_prompt_or_the_first_turn_and_a_category(tmp_path):
  path = _jsonl(
    tmp_path / "p.jsonl",
    [
      {"text": "a\n"},
      "",  # blank lines are skipped
      {"prompt": "b", "category": "code"},
      # Spec-Bench's question.jsonl: the first turn (single-turn evaluation)
      {"question_id": 81, "category": "writing", "turns": ["first", "second"]},
      {"text": "c", "prompt": "not this", "category": "code"},
    ],
  )
  prompts = read_prompt_file(path)
  assert prompts == [
    Prompt("a\n", "default"),
    Prompt("b", "code"),
    Prompt("first", "writing"),
    Prompt("c", "code"),
  ]
  assert by_category(prompts) == {"default": [0], "code": [1, 3], "writing": [2]}


def test_the_sample_file_has_categories_for_the_bundled_pair():
  prompts = read_prompt_file(SAMPLE_FILE)
  assert list(by_category(prompts)) == ["code", "docstring", "comment"]
  assert all(p.text.strip() for p in prompts)


@pytest.mark.parametrize(
  "rows, message",
  [
    (['{"text": "a"}', "{not json"], r"p.jsonl:2: not a JSON object"),
    (['{"text": "a"}', '["a list"]'], r"p.jsonl:2: expected a JSON object, got list"),
    (['{"question": "a"}'], r"p.jsonl:1: expected a 'text' or 'prompt' string .* \['question'\]"),
    (['{"turns": []}'], r"p.jsonl:1: expected a 'text' or 'prompt' string or a 'turns'"),
    (['{"turns": [1]}'], r"p.jsonl:1: expected a 'text'"),
    (["", '{"text": " \\n"}'], r"p.jsonl:2: the prompt is empty"),
    (['{"text": "a", "category": 3}'], r"p.jsonl:1: 'category' must be a non-empty string"),
    (["", "  "], r"p.jsonl holds no prompts"),
  ],
)
def test_bad_jsonl_is_named_with_its_line(tmp_path, rows, message):
  path = _jsonl(tmp_path / "p.jsonl", rows)
  with pytest.raises(ValueError, match=message) as error:
    read_prompt_file(path, "config.prompt_file")
  assert str(error.value).startswith(f"config.prompt_file: {path}")


def test_bad_files_are_named(tmp_path):
  with pytest.raises(ValueError, match=r"^config.prompt_file: /no/such.jsonl: no such file"):
    read_prompt_file("/no/such.jsonl", "config.prompt_file")
  (tmp_path / "p.csv").write_text("a\n")
  with pytest.raises(ValueError, match=r"p.csv: the suffix must be one of .txt, .jsonl"):
    read_prompt_file(str(tmp_path / "p.csv"))
  (tmp_path / "blank.txt").write_text("\n  \n")
  with pytest.raises(ValueError, match=r"^prompt file: .*blank.txt holds no prompts"):
    read_prompt_file(str(tmp_path / "blank.txt"))
