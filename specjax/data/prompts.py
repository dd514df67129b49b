"""Prompts from the held-out test split: the opening lines of real functions."""

from __future__ import annotations

import re

from specjax.data.corpus import corpus_files, read_source

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
        prompts.append("".join(source[i:i + lines]))
        break
    if len(prompts) == count:
      return prompts
  raise ValueError(f"the test split has only {len(prompts)} prompts; asked for {count}.")
