"""A user's own documents (`config.data.files`) as token files `TokenDataset` reads.

  .txt      one document per file
  .jsonl    one document per line: {"text": str} or {"messages": [{role, content}, ...]}
  .parquet  a `text` or `messages` column (needs pyarrow)

Chats are rendered with the target's chat template; each document is followed by
its EOS id; every `every`-th goes to validation. The meta records each source's
size and sha256, so a changed file is named on resume (docs/training.md).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from specjax.data.chat import ChatTemplate, check_messages
from specjax.validation import file_sha256

SUFFIXES = (".txt", ".jsonl", ".parquet")


def source_files(spec: str, name: str = "config.data.files") -> list[str]:
  """The files of "PATH[,PATH...]" (directories taken recursively), each list sorted."""
  paths = []
  for part in filter(None, (p.strip() for p in spec.split(","))):
    if os.path.isdir(part):
      found = sorted(
        os.path.join(d, f) for d, _, fs in os.walk(part) for f in fs if f.endswith(SUFFIXES)
      )
      if not found:
        raise FileNotFoundError(f"{name}: {part} holds no {'/'.join(SUFFIXES)} files")
      paths += found
    elif not os.path.isfile(part):
      raise FileNotFoundError(f"{name}: {part}: no such file or directory")
    elif not part.endswith(SUFFIXES):
      raise ValueError(f"{name}: {part}: the suffix must be one of {SUFFIXES}")
    else:
      paths.append(part)
  if not paths:
    raise ValueError(f"{name} must name files or directories, got {spec!r}.")
  return paths


def records(path: str) -> Iterator[tuple[str, Any]]:
  """(where, record) for each document of `path`: where is "path:line" or "path row i"
  (`specjax.data.prompts.read_prompt_file` reads .jsonl prompts with it too)."""
  if path.endswith(".txt"):
    with open(path, "rb") as f:
      yield path, {"text": f.read().decode("utf-8", errors="replace")}
  elif path.endswith(".jsonl"):
    with open(path, encoding="utf-8") as f:
      for number, line in enumerate(f, 1):
        if line.strip():
          try:
            yield f"{path}:{number}", json.loads(line)
          except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not a JSON object: {e}") from e
  else:
    try:
      import pyarrow.parquet as pq
    except ImportError as e:
      from specjax.hf.optional import MissingPackagesError

      raise MissingPackagesError(
        f"{path}: reading .parquet needs pyarrow: pip install pyarrow"
      ) from e
    table = pq.read_table(path)
    column = next((c for c in ("text", "messages") if c in table.column_names), None)
    if column is None:
      raise ValueError(f"{path}: expected a 'text' or 'messages' column, got {table.column_names}")
    for i, value in enumerate(table.column(column).to_pylist()):
      yield f"{path} row {i}", {column: value}


def read_documents(
  path: str, template: ChatTemplate | None, prompt: bool = False
) -> Iterator[tuple[str, str, list | None]]:
  """`(where, text, messages)` for each document of `path`; messages None for text.

  With `prompt`, a chat is cut after its last user turn and rendered with the
  generation prompt (what `experiments.generate_data` answers).
  """
  for where, row in records(path):
    if isinstance(row, dict) and isinstance(row.get("text"), str):
      yield where, row["text"], None
      continue
    if not isinstance(row, dict) or "messages" not in row:
      raise ValueError(f"{where}: expected an object with a 'text' string or 'messages' list")
    messages = check_messages(row["messages"], f"{where}: messages")
    if template is None:
      raise ValueError(
        f"{where}: a chat, but the target has no chat template (tokenizer_config.json "
        "chat_template); give its documents as 'text' instead."
      )
    if prompt:
      users = [i for i, m in enumerate(messages) if m["role"] == "user"]
      if not users:
        raise ValueError(f"{where}: a prompt chat needs a user turn")
      messages = messages[: users[-1] + 1]
    yield where, template.render(messages, add_generation_prompt=prompt), messages


def eos_of(target: str | None, tokenizer) -> int:
  """The id ending each document: the checkpoint's `eos_token_id` (generation_config.json,
  then config.json; a list's first), else the tokenizer's `<eos>`."""
  for name in ("generation_config.json", "config.json"):
    file = os.path.join(target or "", name)
    if target and os.path.isfile(file):
      with open(file) as f:
        eos = json.load(f).get("eos_token_id")
      eos = eos[0] if isinstance(eos, list) and eos else eos
      if isinstance(eos, int):
        return eos
  if tokenizer.eos_id is None:
    raise ValueError(f"the target {target} names no eos_token_id and its tokenizer has no <eos>.")
  return tokenizer.eos_id


def file_record(path: str) -> dict[str, Any]:
  """{path, bytes, sha256} of a source file."""
  return {
    "path": os.path.abspath(path),
    "bytes": os.path.getsize(path),
    "sha256": file_sha256(path),
  }


def check_sources(recorded: list[dict], paths: list[str], data_dir: str) -> None:
  """Raises ValueError naming the first file that differs from what `data_dir` was encoded from."""
  old = {r["path"]: r for r in recorded}
  new = {r["path"]: r for r in map(file_record, paths)}
  for path in sorted(old.keys() | new.keys()):
    if old.get(path) != new.get(path):
      what = "is new" if path not in old else "is gone" if path not in new else "changed"
      raise ValueError(
        f"config.data.files: {path} {what} since {data_dir} was encoded from these files; "
        "restore it, or encode into a new data directory (config.data.dir) for a new run."
      )


def encode_files(
  paths: list[str],
  tokenizer,
  eos_id: int,
  template: ChatTemplate | None,
  every: int,
  write: Callable[[str, np.ndarray, dict[str, Any]], None],
) -> None:
  """Encodes `paths`' documents; `write(split, tokens, meta)` stores train and validation."""
  docs = [(w, t) for p in paths for w, t, _ in read_documents(p, template)]
  ids = tokenizer.encode_batch([t for _, t in docs], special=False)
  dtype = np.uint16 if max(tokenizer.vocab_size, eos_id + 1) <= 1 << 16 else np.uint32
  meta = {"sources": [file_record(p) for p in paths], "every": every, "dtype": dtype.__name__}
  for split in ("train", "validation"):
    mine = [x + [eos_id] for i, x in enumerate(ids) if ((i + 1) % every == 0) == (split != "train")]
    if not mine:
      raise ValueError(
        f"config.data.files: {len(docs)} documents leave the {split} split empty "
        f"(every {every}-th is validation: config.data.validation_every)."
      )
    tokens = np.concatenate([np.asarray(x, dtype) for x in mine])
    write(split, tokens, {**meta, "split": split, "documents": len(mine), "eos_id": eos_id})
