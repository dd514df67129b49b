"""Checkpoints as users name them: a local directory or a hub repo id, offline.

  resolve_checkpoint("Qwen/Qwen2.5-0.5B")          # the snapshot in the local HF cache
  resolve_checkpoint("/models/qwen", revision=None) # a directory is itself

A name that is not an existing directory but looks like a repo id (`org/name`)
is looked up in the local Hugging Face cache through `huggingface_hub`, with
`local_files_only=True` unless `allow_download` (the machines here have no
network). Errors say which of the two was tried, and where.
"""

from __future__ import annotations

import os
import re

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[A-Za-z0-9][\w.\-]*$")
# What loading a checkpoint reads; a download (allow_download) fetches only these.
CHECKPOINT_FILES = ("*.json", "*.safetensors", "tokenizer.model")


def resolve_checkpoint(
  name_or_path: str,
  revision: str | None = None,
  cache_dir: str | None = None,
  allow_download: bool = False,
) -> str:
  """The local directory of checkpoint `name_or_path`.

  Args:
    name_or_path: a checkpoint directory, or a hub repo id such as
      "Qwen/Qwen2.5-0.5B" (looked up when no such directory exists).
    revision: a branch, tag or commit of the repo (None: "main"); directories
      take none.
    cache_dir: the Hugging Face cache (None: `huggingface_hub`'s default,
      $HF_HUB_CACHE or ~/.cache/huggingface/hub).
    allow_download: fetch a repo missing from the cache (needs a network).

  Raises:
    FileNotFoundError: neither a directory nor a cached repo, naming both.
    ValueError: a revision given with a directory.
  """
  if not isinstance(name_or_path, str) or not name_or_path:
    raise ValueError(f"a checkpoint must be named by a non-empty string, got {name_or_path!r}.")
  if os.path.isdir(name_or_path):
    if revision is not None:
      raise ValueError(
        f"revision={revision!r} applies to hub repo ids; {name_or_path} is a local directory."
      )
    return name_or_path
  if not _REPO_ID.match(name_or_path):
    raise FileNotFoundError(
      f"checkpoint directory {name_or_path} does not exist (and it is not a hub repo id "
      "of the form 'org/name')"
    )
  from huggingface_hub import constants, snapshot_download

  where = cache_dir or constants.HF_HUB_CACHE
  try:
    return snapshot_download(
      name_or_path,
      revision=revision,
      cache_dir=cache_dir,
      local_files_only=not allow_download,
      allow_patterns=list(CHECKPOINT_FILES),
    )
  except Exception as e:  # huggingface_hub raises several types for "not cached"
    how = "downloading failed" if allow_download else "downloads are off (allow_download=False)"
    raise FileNotFoundError(
      f"{name_or_path}: no such local directory, and the Hugging Face cache {where} has no "
      f"snapshot of repo {name_or_path!r} at revision {revision or 'main'}; {how}. "
      f"({type(e).__name__}: {e})"
    ) from e
