"""Token arrays on disk and the deterministic batches drawn from them.

`prepare_splits` encodes each split once into `<split>.bin` (uint16 ids, each
file followed by `<eos>`) plus `<split>.json` (counts and provenance, including
the vocabulary size and sha256 of the tokenizer that encoded it, so token files
are never read with another tokenizer). `TokenDataset` memory-maps a `.bin`, so
a process touches only the windows it reads.

A training batch is a pure function of `(seed, step)`: resuming at step s
reproduces exactly the batches an uninterrupted run would have seen, with no
iterator state to checkpoint. With several processes, each takes its own rows
of the same global batch (`process_index`, `process_count`).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from specjax.data.corpus import SPLITS, corpus_files, read_source
from specjax.data.tokenizer import Tokenizer

_DTYPE = np.uint16


def tokenizer_sha256(tokenizer: Tokenizer) -> str:
  """Hex sha256 of the tokenizer.json `tokenizer.save` writes (`sha256sum tokenizer.json`).

  Hashing what `save` writes, not a file the tokenizer came from, makes it
  independent of where (or whether) the tokenizer is stored.
  """
  with tempfile.TemporaryDirectory() as directory:
    path = os.path.join(directory, "tokenizer.json")
    tokenizer.save(path)
    with open(path, "rb") as f:
      return hashlib.sha256(f.read()).hexdigest()


def tokenizer_record(tokenizer: Tokenizer) -> dict[str, Any]:
  """The meta fields that identify the tokenizer a token file was encoded with."""
  return {"vocab_size": tokenizer.vocab_size, "tokenizer_sha256": tokenizer_sha256(tokenizer)}


def meta_path(path: str) -> str:
  """`<split>.json`, the meta file of token file `<split>.bin`."""
  return os.path.splitext(path)[0] + ".json"


def read_meta(path: str) -> dict[str, Any] | None:
  """The meta of token file `path`, or None when it has no meta file."""
  meta_file = meta_path(path)
  if not os.path.isfile(meta_file):
    return None
  try:
    with open(meta_file) as f:
      meta = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f"cannot read token-file meta {meta_file}: {e}") from e
  if not isinstance(meta, dict):
    raise ValueError(f"token-file meta {meta_file} is not a JSON object.")
  return meta


def _write_atomically(path: str, write: Callable[[str], None]) -> None:
  # Unique per process (several hosts may share a data dir); the rename means a
  # crash never leaves a truncated file under the final name.
  tmp = f"{path}.tmp{os.getpid()}"
  write(tmp)
  os.replace(tmp, path)


def write_meta(path: str, meta: dict[str, Any]) -> None:
  """Writes `meta` as token file `path`'s .json (last: it marks the .bin complete)."""

  def write(tmp):
    with open(tmp, "w") as f:
      json.dump(meta, f, indent=2)

  _write_atomically(meta_path(path), write)


def build_token_file(
  split: str, tokenizer: Tokenizer, path: str, root: str | None = None
) -> dict[str, Any]:
  """Encodes the `split` files into `path` (.bin) and writes `path`'s .json meta."""
  if tokenizer.vocab_size > np.iinfo(_DTYPE).max + 1:
    raise ValueError(f"vocab_size {tokenizer.vocab_size} does not fit uint16 ids.")
  if tokenizer.eos_id is None:
    raise ValueError("the tokenizer has no <eos> token to end each file with.")
  files = corpus_files(split, root)
  chunks = []
  for start in range(0, len(files), 64):
    texts = [read_source(p) for p in files[start : start + 64]]
    for ids in tokenizer.encode_batch(texts):
      chunks.append(np.asarray(ids + [tokenizer.eos_id], _DTYPE))
  tokens = np.concatenate(chunks) if chunks else np.zeros((0,), _DTYPE)
  _write_atomically(path, tokens.tofile)
  meta = {
    "split": split,
    "files": len(files),
    "tokens": int(tokens.size),
    "bytes": int(sum(os.path.getsize(p) for p in files)),
    "python": sys.version.split()[0],
    **tokenizer_record(tokenizer),
  }
  write_meta(path, meta)
  return meta


def check_tokenizer(path: str, tokenizer: Tokenizer, log: Callable[[str], None] = print) -> None:
  """Raises ValueError unless token file `path` was encoded with `tokenizer`.

  The meta's recorded vocabulary size and tokenizer sha256 must equal
  `tokenizer`'s. Metas written before the sha256 was recorded are checked on
  the vocabulary size and on the ids in the file.
  """
  meta = read_meta(path)
  if meta is None:
    raise ValueError(f"{path} has no {meta_path(path)}: cannot tell which tokenizer encoded it.")
  want_vocab, want_sha = tokenizer.vocab_size, tokenizer_sha256(tokenizer)
  vocab, sha = meta.get("vocab_size"), meta.get("tokenizer_sha256")
  if (vocab is not None and vocab != want_vocab) or (sha is not None and sha != want_sha):
    raise ValueError(
      f"{path} was encoded with a tokenizer of {vocab} ids (sha256 {sha}), but the "
      f"tokenizer in use has {want_vocab} ids (sha256 {want_sha}); use the tokenizer that "
      "encoded it (config.data.tokenizer) or encode the corpus into another directory."
    )
  if sha is None:
    largest = int(TokenDataset(path).tokens.max())
    if largest >= want_vocab:
      raise ValueError(
        f"{path} holds token id {largest}, outside the tokenizer's "
        f"{want_vocab} ids; encode the corpus into another directory."
      )
    log(
      f"{meta_path(path)} records no tokenizer sha256 (an older file): checked only "
      "that its ids fit the tokenizer"
    )


def missing_splits(data_dir: str) -> list[str]:
  """The splits (in `SPLITS` order) without a complete `<data_dir>/<split>.bin`.

  A .bin without its meta is an interrupted encoding (the meta is written
  last), so it counts as missing.
  """
  paths = {split: os.path.join(data_dir, f"{split}.bin") for split in SPLITS}
  return [s for s, p in paths.items() if not (os.path.isfile(p) and os.path.isfile(meta_path(p)))]


def check_data_dir(data_dir: str, name: str, files: Sequence[str]) -> None:
  """Raises FileNotFoundError, naming `name` (the flag that gave `data_dir`),
  unless `data_dir` is a directory holding every one of `files`.

  Launchers call it before any work: a missing data directory is reported as
  one line, not after a model has loaded.
  """
  if not os.path.isdir(data_dir):
    raise FileNotFoundError(f"{name}: {data_dir}: no such data directory")
  missing = [f for f in files if not os.path.isfile(os.path.join(data_dir, f))]
  if missing:
    raise FileNotFoundError(f"{name}: data directory {data_dir} lacks {', '.join(missing)}")


def prepare_splits(
  data_dir: str, tokenizer: Tokenizer, root: str | None = None, log: Callable[[str], None] = print
) -> dict[str, str]:
  """`<data_dir>/<split>.bin` for every split, encoding those that are missing.

  Existing token files are checked against `tokenizer` (`check_tokenizer`)
  before anything is encoded. Returns {split: path}.
  """
  paths = {split: os.path.join(data_dir, f"{split}.bin") for split in SPLITS}
  done = [split for split in SPLITS if split not in missing_splits(data_dir)]
  for split in done:
    check_tokenizer(paths[split], tokenizer, log)
  os.makedirs(data_dir, exist_ok=True)
  for split, path in paths.items():
    if split not in done:
      meta = build_token_file(split, tokenizer, path, root)
      log(
        f"encoded {split}: {meta['files']} files, {meta['bytes'] / 1e6:.1f} MB "
        f"-> {meta['tokens']:,} tokens"
      )
  return paths


def prepare_file_splits(
  data_dir: str,
  paths: list[str],
  tokenizer: Tokenizer,
  eos_id: int,
  template=None,
  every: int = 10,
  log: Callable[[str], None] = print,
) -> dict[str, str]:
  """`<data_dir>/{train,validation}.bin` of the documents of `paths`
  (`specjax.data.files`), encoded once; an encoded data dir is checked instead
  against `tokenizer` and the files (ValueError naming what differs)."""
  from specjax.data import files

  out = {split: os.path.join(data_dir, f"{split}.bin") for split in SPLITS[:2]}
  if all(os.path.isfile(meta_path(p)) for p in out.values()):
    for p in out.values():
      check_tokenizer(p, tokenizer, log)
    meta = read_meta(out["train"])
    if meta.get("every") != every:  # None: not encoded from files (the corpus?)
      raise ValueError(
        f"config.data.dir: {data_dir} holds token files not encoded from config.data.files "
        f"with validation_every={every}; name a new data directory."
      )
    files.check_sources(meta["sources"], paths, data_dir)
    return out
  os.makedirs(data_dir, exist_ok=True)

  def write(split, tokens, meta):
    _write_atomically(out[split], tokens.tofile)
    write_meta(out[split], {**meta, "tokens": int(tokens.size), **tokenizer_record(tokenizer)})
    log(f"encoded {split}: {meta['documents']} documents -> {tokens.size:,} tokens")

  files.encode_files(paths, tokenizer, eos_id, template, every, write)
  return out


class TokenDataset:
  """A memory-mapped token array with deterministic batch sampling.

  Raises FileNotFoundError for a missing file and ValueError, naming the path,
  for one that is empty, truncated mid-token, or holds another number of tokens
  than its meta records.
  """

  def __init__(self, path: str):
    if not os.path.isfile(path):
      raise FileNotFoundError(f"token file not found: {path}")
    self.path = path
    self.meta = read_meta(path)
    # uint16 unless the meta says otherwise (uint32 for vocabularies past 65,536 ids).
    dtype = np.dtype((self.meta or {}).get("dtype", _DTYPE))
    size = os.path.getsize(path)
    if size % dtype.itemsize:
      raise ValueError(
        f"{path} is {size} bytes, not a multiple of {dtype.itemsize} "
        f"({dtype.name} token ids): it is truncated."
      )
    if not size:
      raise ValueError(f"{path} holds no tokens.")
    count = size // dtype.itemsize
    if self.meta is not None and self.meta.get("tokens", count) != count:
      raise ValueError(
        f"{path} holds {count} tokens but {meta_path(path)} records "
        f"{self.meta['tokens']}: the file is truncated or was overwritten."
      )
    self.tokens = np.memmap(path, dtype=dtype, mode="r")

  def __len__(self) -> int:
    return int(self.tokens.size)

  def check_window(self, seq_len: int) -> None:
    """Raises ValueError unless one window of `seq_len + 1` tokens fits."""
    if seq_len + 1 > len(self):
      raise ValueError(
        f"seq_len + 1 = {seq_len + 1} exceeds the {len(self)} tokens of {self.path}."
      )

  def check_eval(self, batch_size: int, seq_len: int) -> None:
    """Raises ValueError unless one eval batch (`batch_size` disjoint windows) fits."""
    needed = batch_size * (seq_len + 1)
    if needed > len(self):
      raise ValueError(
        f"{self.path} holds {len(self)} tokens, fewer than one eval batch of "
        f"batch_size {batch_size} windows of seq_len {seq_len} + 1 tokens "
        f"({needed} tokens)."
      )

  def batch(
    self,
    step: int,
    batch_size: int,
    seq_len: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
  ) -> np.ndarray:
    """Rows of the global batch for `step`: int32 `[batch_size // process_count, seq_len + 1]`.

    Inputs are `[:, :-1]`, targets `[:, 1:]`. Window starts are uniform over the
    array, drawn from `numpy.random.default_rng((seed, step))`.
    """
    self.check_window(seq_len)
    if batch_size % process_count:
      raise ValueError(
        f"batch_size {batch_size} must be divisible by the process count {process_count}."
      )
    rng = np.random.default_rng((seed, step))
    starts = rng.integers(0, len(self) - seq_len, size=batch_size)
    per = batch_size // process_count
    mine = starts[process_index * per : (process_index + 1) * per]
    return np.stack([self.tokens[s : s + seq_len + 1] for s in mine]).astype(np.int32)

  def eval_batches(self, batch_size: int, seq_len: int, num_batches: int) -> Iterator[np.ndarray]:
    """Up to `num_batches` int32 `[batch_size, seq_len + 1]` batches of consecutive
    non-overlapping windows from the start: the same every call, at least one.

    Raises ValueError (here, not when iterated) when not even one batch fits.
    """
    self.check_eval(batch_size, seq_len)
    stride = seq_len + 1
    usable = min(num_batches * batch_size, len(self) // stride)
    return (
      np.stack(
        [self.tokens[(start + r) * stride : (start + r + 1) * stride] for r in range(batch_size)]
      ).astype(np.int32)
      for start in range(0, usable - batch_size + 1, batch_size)
    )
