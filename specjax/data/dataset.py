"""Token arrays on disk and the deterministic batches drawn from them.

`prepare_splits` encodes each split once into `<split>.bin` (uint16 ids, each
file followed by `<eos>`) plus `<split>.json` (counts and provenance).
`TokenDataset` memory-maps a `.bin`, so a process touches only the windows it
reads.

A training batch is a pure function of `(seed, step)`: resuming at step s
reproduces exactly the batches an uninterrupted run would have seen, with no
iterator state to checkpoint. With several processes, each takes its own rows
of the same global batch (`process_index`, `process_count`).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from specjax.data.corpus import SPLITS, corpus_files, read_source
from specjax.data.tokenizer import Tokenizer

_DTYPE = np.uint16


def build_token_file(split: str, tokenizer: Tokenizer, path: str,
                     root: str | None = None) -> dict:
  """Encodes the `split` files into `path` (.bin) and writes `path`'s .json meta."""
  if tokenizer.vocab_size > np.iinfo(_DTYPE).max + 1:
    raise ValueError(f"vocab_size {tokenizer.vocab_size} does not fit uint16 ids.")
  files = corpus_files(split, root)
  chunks = []
  for start in range(0, len(files), 64):
    texts = [read_source(p) for p in files[start:start + 64]]
    for ids in tokenizer.encode_batch(texts):
      chunks.append(np.asarray(ids + [tokenizer.eos_id], _DTYPE))
  tokens = np.concatenate(chunks) if chunks else np.zeros((0,), _DTYPE)
  tmp = f"{path}.tmp{os.getpid()}"  # unique: several hosts may share data_dir
  tokens.tofile(tmp)
  os.replace(tmp, path)  # a crash never leaves a truncated .bin behind
  meta = {"split": split, "files": len(files), "tokens": int(tokens.size),
          "bytes": int(sum(os.path.getsize(p) for p in files)),
          "python": sys.version.split()[0], "vocab_size": tokenizer.vocab_size}
  with open(_meta_path(path), "w") as f:
    json.dump(meta, f, indent=2)
  return meta


def _meta_path(path: str) -> str:
  return os.path.splitext(path)[0] + ".json"


def prepare_splits(data_dir: str, tokenizer: Tokenizer, root: str | None = None,
                   log=print) -> dict[str, str]:
  """Builds `<data_dir>/<split>.bin` for every split that is missing; returns paths."""
  os.makedirs(data_dir, exist_ok=True)
  paths = {}
  for split in SPLITS:
    path = os.path.join(data_dir, f"{split}.bin")
    if not (os.path.exists(path) and os.path.exists(_meta_path(path))):
      meta = build_token_file(split, tokenizer, path, root)
      log(f"encoded {split}: {meta['files']} files, {meta['bytes'] / 1e6:.1f} MB "
          f"-> {meta['tokens']:,} tokens")
    paths[split] = path
  return paths


class TokenDataset:
  """A memory-mapped token array with deterministic batch sampling."""

  def __init__(self, path: str):
    if not os.path.isfile(path):
      raise FileNotFoundError(f"token file not found: {path}")
    self.path = path
    self.tokens = np.memmap(path, dtype=_DTYPE, mode="r")

  def __len__(self) -> int:
    return int(self.tokens.size)

  def _check_window(self, seq_len: int) -> None:
    if seq_len + 1 > len(self):
      raise ValueError(f"seq_len + 1 = {seq_len + 1} exceeds the {len(self)} tokens "
                       f"of {self.path}.")

  def batch(self, step: int, batch_size: int, seq_len: int, seed: int,
            process_index: int = 0, process_count: int = 1) -> np.ndarray:
    """Rows of the global batch for `step`: int32 `[batch_size // process_count, seq_len + 1]`.

    Inputs are `[:, :-1]`, targets `[:, 1:]`. Window starts are uniform over the
    array, drawn from `numpy.random.default_rng((seed, step))`.
    """
    self._check_window(seq_len)
    if batch_size % process_count:
      raise ValueError(f"batch_size {batch_size} must be divisible by the process "
                       f"count {process_count}.")
    rng = np.random.default_rng((seed, step))
    starts = rng.integers(0, len(self) - seq_len, size=batch_size)
    per = batch_size // process_count
    mine = starts[process_index * per:(process_index + 1) * per]
    return np.stack([self.tokens[s:s + seq_len + 1] for s in mine]).astype(np.int32)

  def eval_batches(self, batch_size: int, seq_len: int, num_batches: int):
    """Consecutive non-overlapping windows from the start: the same every call."""
    self._check_window(seq_len)
    stride = seq_len + 1
    usable = min(num_batches * batch_size, len(self) // stride)
    for start in range(0, usable - batch_size + 1, batch_size):
      rows = [self.tokens[(start + r) * stride:(start + r + 1) * stride]
              for r in range(batch_size)]
      yield np.stack(rows).astype(np.int32)
