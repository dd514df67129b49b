"""Prompts from the held-out test split: the opening lines of real functions."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np

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
