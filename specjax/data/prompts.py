"""Test prompts: the opening lines of real functions from the held-out test
split (`held_out_prompts`), or a user's prompt file with categories
(`read_prompt_file`), and their encoding (`encode_prompts`).

A prompt file is one of

  .txt    one prompt per paragraph: blocks of lines separated by blank lines,
          each kept as written (its lines with their line ends); category "default"
  .jsonl  one JSON object per line: the prompt is its "text" or "prompt" string, or
          the first string of its "turns" list (Spec-Bench's question.jsonl, whose
          single-turn evaluation decodes the first turn; no chat template is
          applied); an optional "category" string ("default" without one)

so Spec-Bench's `{"question_id": 1, "category": "translation", "turns": [...]}`
rows read as they are. `specjax/data/sample_prompts.jsonl` is a small example
for the bundled pair (Python code, docstrings and comments).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from specjax.data.corpus import corpus_files, read_source
from specjax.data.files import records

PROMPT_SUFFIXES = (".txt", ".jsonl")
DEFAULT_CATEGORY = "default"  # a prompt's category when its row names none
SAMPLE_FILE = os.path.join(os.path.dirname(__file__), "sample_prompts.jsonl")

_DEF = re.compile(r"^[ \t]*def \w+\(.*\):[ \t]*$")


def held_out_prompts(count: int, lines: int = 4, root: str | None = None) -> list[str]:
  """`count` prompts, each a complete one-line `def` plus the `lines - 1` lines after it.

  Taken in order from the sorted test-split files (the first such function of
  each file), so the same interpreter always gives the same prompts. The text
  ends with a newline, which is where a continuation starts naturally.
  """
  if count < 1:
    raise ValueError(f"count must be >= 1, got {count}.")
  prompts = []
  for path in corpus_files("test", root):
    source = read_source(path).splitlines(keepends=True)
    for i, line in enumerate(source):
      if _DEF.match(line) and i + lines <= len(source):
        prompts.append("".join(source[i : i + lines]))
        break
    if len(prompts) == count:
      return prompts
  raise ValueError(f"the test split has only {len(prompts)} prompts; asked for {count}.")


def encode_prompts(tokenizer, texts: list[str], name: str = "prompts"):
  """Right-padded prompt ids `[B, P]` int32 (pad 0) and their lengths `[B]`.

  Raises ValueError (naming `name`) if a text encodes to no tokens.
  """
  ids = [tokenizer.encode(t) for t in texts]
  if not all(ids):
    raise ValueError(f"{name} encodes to no tokens.")
  tokens = np.zeros((len(ids), max(map(len, ids))), np.int32)
  for row, row_ids in enumerate(ids):
    tokens[row, : len(row_ids)] = row_ids
  return jnp.asarray(tokens), jnp.asarray([len(i) for i in ids], jnp.int32)


class Prompt(NamedTuple):
  """One prompt of a prompt file: its text and its category (`DEFAULT_CATEGORY`
  when the file names none)."""

  text: str
  category: str = DEFAULT_CATEGORY


def read_prompt_file(path: str, name: str = "prompt file") -> list[Prompt]:
  """The prompts of `path` (.txt or .jsonl; the module doc gives the layouts), in
  file order.

  Args:
    path: the file.
    name: what the caller calls it (e.g. "config.prompt_file"), first in every error.

  Raises:
    ValueError: naming `name`, the file and (.jsonl) the line: a missing file, another
      suffix, a line that is not a JSON object, a row with no prompt, an empty
      prompt, a category that is not a non-empty string, a file with no prompts.
  """
  if not os.path.isfile(path):
    raise ValueError(f"{name}: {path}: no such file.")
  if not path.endswith(PROMPT_SUFFIXES):
    raise ValueError(f"{name}: {path}: the suffix must be one of {', '.join(PROMPT_SUFFIXES)}.")
  prompts = _paragraphs(path) if path.endswith(".txt") else _jsonl_prompts(path, name)
  if not prompts:
    raise ValueError(f"{name}: {path} holds no prompts.")
  return prompts


def _paragraphs(path: str) -> list[Prompt]:
  """A .txt file's paragraphs (runs of lines that are not blank), each as written."""
  with open(path, encoding="utf-8") as f:
    lines = f.read().splitlines(keepends=True)
  paragraphs, current = [], []
  for line in [*lines, "\n"]:  # a final blank line closes the last paragraph
    if line.strip():
      current.append(line)
    elif current:
      paragraphs.append(Prompt("".join(current)))
      current = []
  return paragraphs


def _jsonl_prompts(path: str, name: str) -> list[Prompt]:
  """A .jsonl file's prompts: "text", "prompt" or the first of "turns", and "category"."""
  prompts = []
  try:
    rows = list(records(path))  # "path:line" and the parsed object of each non-blank line
  except ValueError as e:
    raise ValueError(f"{name}: {e}") from None
  for where, row in rows:
    if not isinstance(row, dict):
      raise ValueError(f"{name}: {where}: expected a JSON object, got {type(row).__name__}.")
    text = _row_text(row)
    if text is None:
      raise ValueError(
        f"{name}: {where}: expected a 'text' or 'prompt' string or a 'turns' list of "
        f"strings; got the keys {sorted(row)}."
      )
    if not text.strip():
      raise ValueError(f"{name}: {where}: the prompt is empty.")
    category = row.get("category", DEFAULT_CATEGORY)
    if not isinstance(category, str) or not category:
      raise ValueError(f"{name}: {where}: 'category' must be a non-empty string, got {category!r}.")
    prompts.append(Prompt(text, category))
  return prompts


def _row_text(row: dict) -> str | None:
  """The prompt of a .jsonl row (None when it has none): "text", then "prompt", then
  the first of "turns" (Spec-Bench's single-turn evaluation)."""
  for field in ("text", "prompt"):
    if isinstance(row.get(field), str):
      return row[field]
  turns = row.get("turns")
  if isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns):
    return turns[0]
  return None


def by_category(prompts: Sequence[Prompt | str]) -> dict[str, list[int]]:
  """category -> the indices of its prompts (`Prompt`s, or their categories),
  categories in order of first appearance."""
  groups: dict[str, list[int]] = {}
  for i, prompt in enumerate(prompts):
    groups.setdefault(getattr(prompt, "category", prompt), []).append(i)
  return groups
