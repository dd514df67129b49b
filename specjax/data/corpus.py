"""The corpus: `*.py` files of the running interpreter's standard library.

About 1,800 files / 31 MB of real code on CPython 3.11, present offline on every
machine. `site-packages` (third-party code) and `__pycache__` are excluded.

Split rule (documented in docs/training.md): a file's split is a function of its path
relative to the stdlib root only, so it is the same on every machine and
independent of which other files exist:

  bucket = int(sha256(relative_path)[:8], 16) % 100
  test if bucket < 5, validation if bucket < 10, train otherwise

The files' contents follow the Python version; the model card records it.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig

SPLITS = ("train", "validation", "test")
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_TEST_PERCENT, _VALIDATION_PERCENT = 5, 5


def stdlib_root() -> str:
  """The directory of the running interpreter's pure-Python standard library."""
  return sysconfig.get_paths()["stdlib"]


def split_of(relative_path: str) -> str:
  """`train`, `validation` or `test` for a path relative to the stdlib root."""
  digest = hashlib.sha256(relative_path.replace(os.sep, "/").encode()).hexdigest()
  bucket = int(digest[:8], 16) % 100
  if bucket < _TEST_PERCENT:
    return "test"
  if bucket < _TEST_PERCENT + _VALIDATION_PERCENT:
    return "validation"
  return "train"


def corpus_files(split: str, root: str | None = None) -> list[str]:
  """Sorted absolute paths of the `*.py` files in `split` (one of SPLITS)."""
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}.")
  root = root or stdlib_root()
  if not os.path.isdir(root):
    raise FileNotFoundError(f"standard-library directory not found: {root}")
  paths = []
  for directory, subdirs, files in os.walk(root):
    subdirs[:] = sorted(d for d in subdirs if d not in _EXCLUDED_DIRS)
    for name in files:
      if name.endswith(".py"):
        path = os.path.join(directory, name)
        if split_of(os.path.relpath(path, root)) == split:
          paths.append(path)
  return sorted(paths)


def read_source(path: str) -> str:
  """A file's text; undecodable bytes (a few test fixtures) become U+FFFD."""
  with open(path, "rb") as f:
    return f.read().decode("utf-8", errors="replace")


def copy_subset(dest: str, files_per_split: dict[str, int], root: str | None = None) -> str:
  """Copies the first `files_per_split[split]` files of each split under `dest`,
  keeping their paths relative to the corpus root (so each stays in its split):
  a corpus small enough to tokenize and train on in a test or a quick run.
  Returns `dest`."""
  import shutil

  root = root or stdlib_root()
  for split, count in files_per_split.items():
    for path in corpus_files(split, root)[:count]:
      target = os.path.join(dest, os.path.relpath(path, root))
      os.makedirs(os.path.dirname(target), exist_ok=True)
      shutil.copyfile(path, target)
  return dest
