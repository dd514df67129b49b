"""Argument checks shared by the library and the launchers, run on the host.

Each failure is a `FieldError` (a `ValueError`) whose message begins with the
argument's name and gives its allowed range; `error.field` is that name, so a
caller that calls the argument something else (the HTTP API's `max_tokens` for
`max_new_tokens`) renames it without reading the message. Numbers may be
Python or numpy scalars (`np.int64(3)`, `np.float32(0.5)`); booleans are never
numbers here.
"""

from __future__ import annotations

import hashlib
import numbers
import os

import numpy as np


class FieldError(ValueError):
  """A ValueError about one named field: `field` is the name the raiser knows it
  by, and the message begins with it (`"top_k must be ..."`)."""

  def __init__(self, field: str, message: str):
    assert message.startswith(field), (field, message)
    super().__init__(message)
    self.field = field

  def __reduce__(self):  # pickle rebuilds it from both arguments, not the message alone
    return FieldError, (self.field, str(self))

  def renamed(self, name: str) -> FieldError:
    """The same error for a caller that calls the field `name`."""
    return FieldError(name, name + str(self)[len(self.field) :])

  def within(self, record: str) -> FieldError:
    """The same error seen from a record that holds the field's owner as `record`
    (a `Request`'s `sampling`): `record.field`."""
    return self.renamed(f"{record}.{self.field}")


def is_int(value) -> bool:
  """True for Python and numpy integers, False for bools."""
  return isinstance(value, (numbers.Integral, np.integer)) and not isinstance(
    value, (bool, np.bool_)
  )


def is_real(value) -> bool:
  """True for Python and numpy integers and floats (NaN included), False for bools."""
  return isinstance(value, (numbers.Real, np.integer, np.floating)) and not isinstance(
    value, (bool, np.bool_)
  )


def check_int(name: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
  """Returns `value` as a Python int; raises unless it is an integer in range."""
  if (
    not is_int(value)
    or (minimum is not None and value < minimum)
    or (maximum is not None and value > maximum)
  ):
    low = "-inf" if minimum is None else minimum
    high = "inf" if maximum is None else maximum
    raise FieldError(name, f"{name} must be an integer in [{low}, {high}], got {value!r}.")
  return int(value)


def check_positive_int(name: str, value, minimum: int = 1) -> int:
  """Returns `value` as a Python int; raises unless it is an integer >= minimum."""
  if not is_int(value) or value < minimum:
    raise FieldError(name, f"{name} must be an integer >= {minimum}, got {value!r}.")
  return int(value)


LOOPS = ("while", "chunked")


def check_loop(loop, loop_chunk, prefix: str = "") -> tuple[str, int]:
  """`(loop, loop_chunk)` checked: `loop` one of `LOOPS`, `loop_chunk` an integer
  >= 1; errors name them with `prefix` (a launcher's "config.")."""
  if not isinstance(loop, str) or loop not in LOOPS:
    raise FieldError(f"{prefix}loop", f"{prefix}loop must be one of {LOOPS}, got {loop!r}.")
  return loop, check_positive_int(f"{prefix}loop_chunk", loop_chunk)


def check_token_id(name: str, value, vocab_size: int) -> int | None:
  """None, or `value` as an int in [0, vocab_size)."""
  if value is None:
    return None
  if not is_int(value) or not 0 <= value < vocab_size:
    raise FieldError(
      name, f"{name} must be None or an integer in [0, vocab_size={vocab_size}), got {value!r}."
    )
  return int(value)


def check_token_ids(name: str, ids, vocab_size: int) -> np.ndarray:
  """`ids`, a non-empty sequence of token ids each in [0, vocab_size), as an
  integer array `[T]` (one prompt; `generation.validation.check_prompts`
  checks a padded batch)."""
  array = np.asarray(ids)
  if array.ndim != 1 or array.size == 0 or not np.issubdtype(array.dtype, np.integer):
    raise FieldError(
      name,
      f"{name} must be a non-empty list of token ids, got {array.size} items of dtype "
      f"{array.dtype}.",
    )
  bad = (array < 0) | (array >= vocab_size)
  if bad.any():
    i = int(np.argmax(bad))
    raise FieldError(
      name,
      f"{name} must hold token ids in [0, vocab_size={vocab_size}); got {array[i]} at "
      f"position {i}.",
    )
  return array


def check_eos_ids(name: str, value, vocab_size: int) -> int | tuple[int, ...] | None:
  """None, one id (an int), or a tuple of distinct ids from a non-empty sequence,
  each in [0, vocab_size)."""

  if value is None or is_int(value):
    return check_token_id(name, value, vocab_size)
  try:
    ids = tuple(value)
  except TypeError:
    ids = ()
  if (
    not ids or not all(is_int(i) and 0 <= i < vocab_size for i in ids) or len(set(ids)) != len(ids)
  ):
    raise FieldError(
      name,
      f"{name} must be None, an integer or a non-empty list of distinct integers in "
      f"[0, vocab_size={vocab_size}), got {value!r}.",
    )
  return ids[0] if len(ids) == 1 else tuple(int(i) for i in ids)


def check_output_path(name: str, path: str | None) -> str | None:
  """Makes sure a result can be written to `path` before any work starts.

  Creates missing parent directories; raises naming `name` when the path is a
  directory or its parent cannot be created or written.
  """
  if not path:
    return path
  if os.path.isdir(path):
    raise FieldError(name, f"{name} must be a file path, got the directory {path!r}.")
  parent = os.path.dirname(os.path.abspath(path))
  try:
    os.makedirs(parent, exist_ok=True)
  except OSError as e:
    raise FieldError(name, f"{name}: cannot create the directory {parent!r} ({e}).") from e
  if not os.access(parent, os.W_OK):
    raise FieldError(name, f"{name}: the directory {parent!r} is not writable.")
  return path


def file_sha256(path: str) -> str:
  """The hex sha256 of the file at `path`, read in chunks."""
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      digest.update(chunk)
  return digest.hexdigest()


def read_json_object(path: str) -> dict:
  """The JSON object in file `path`; a ValueError naming the file when it is not
  valid JSON or not an object (FileNotFoundError when it is missing)."""
  import json

  try:
    with open(path, encoding="utf-8") as f:
      value = json.load(f)
  except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError for binary bytes
    raise ValueError(f"{path} is not valid JSON: {e}") from e
  if not isinstance(value, dict):
    raise ValueError(f"{path} must hold a JSON object, got a {type(value).__name__}.")
  return value
