"""Checkpoints as users name them: a local directory or a hub repo id, offline.

  resolve_checkpoint("Qwen/Qwen2.5-0.5B")          # the snapshot in the local HF cache
  resolve_checkpoint("/models/qwen", revision=None) # a directory is itself

A name that is not an existing directory but looks like a repo id (`org/name`)
is looked up in the local Hugging Face cache through `huggingface_hub`, with
`local_files_only=True` unless `allow_download` (the machines here have no
network). Errors are one line that names the flag (`flag`) and says which of
the two was tried, and where.
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
  flag: str | None = None,
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
    flag: the flag or field that named the checkpoint (e.g. "--config.target"),
      put first in error messages.

  Raises:
    FileNotFoundError: neither a directory nor a cached repo, in one line: a
      name that reads as a path (not of the form 'org/name', or whose first
      part is a local directory, like runs/target) is reported as a missing
      directory; a repo id as missing from the local cache.
    ValueError: a revision given with a directory.
  """
  prefix = f"{flag}: " if flag else ""
  if not isinstance(name_or_path, str) or not name_or_path:
    raise ValueError(
      f"{prefix}a checkpoint must be named by a non-empty string, got {name_or_path!r}."
    )
  if os.path.isdir(name_or_path):
    if revision is not None:
      raise ValueError(
        f"{prefix}revision={revision!r} applies to hub repo ids; {name_or_path} is a local "
        "directory."
      )
    return name_or_path
  if not _REPO_ID.match(name_or_path):
    raise FileNotFoundError(
      f"{prefix}checkpoint directory {name_or_path} does not exist (and it is not a hub repo "
      "id of the form 'org/name')"
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
    raise _not_cached(name_or_path, revision, allow_download, where, prefix, e) from e


def _not_cached(
  name: str, revision: str | None, allow_download: bool, where: str, prefix: str, e: Exception
) -> FileNotFoundError:
  """The one-line error for a repo id `name` that `snapshot_download` could not
  resolve (`e`) from the cache `where`: a missing directory when `name` reads as
  a path under an existing directory, else a repo missing from the cache."""
  parent = name.split("/")[0]
  if os.path.isdir(parent) and revision is None:
    # runs/target: a path whose directory exists, not a repo someone forgot to fetch.
    return FileNotFoundError(
      f"{prefix}{name}: no such checkpoint directory ({parent}/ holds no "
      f"{name.split('/', 1)[1]}; nor is it a repo in the Hugging Face cache {where})"
    )
  if allow_download:
    how = f"downloading failed ({type(e).__name__}: {e})"
  else:
    how = (
      "downloads are off: specjax reads checkpoints offline, with no network download "
      f"(fetch it into the cache first, e.g. `hf download {name}`, or name a "
      "local directory)"
    )
  return FileNotFoundError(
    f"{prefix}{name}: no such local directory, and the Hugging Face cache {where} "
    f"has no snapshot of repo {name!r} at revision {revision or 'main'}; {how}"
  )
