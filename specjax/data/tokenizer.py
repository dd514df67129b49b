"""A Hugging Face `tokenizers` tokenizer behind a small API.

The one tokenizer type specjax hands out: `train_tokenizer`,
`specjax.pretrained.load_pair` and `specjax.hf.load_model` all return it. Both
models of a pair share one `tokenizer.json`. In the byte-level BPEs trained here
ids 0, 1, 2 are the specials `<pad>`, `<bos>`, `<eos>`, and `decode(encode(text))
== text` for any text.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")


class Tokenizer:
  """`encode(text) -> list[int]`, `decode(ids) -> str`, and the special ids.

  `pad_id`, `bos_id` and `eos_id` are the ids of `<pad>`, `<bos>` and `<eos>`,
  None for a tokenizer without that token (most downloaded checkpoints name their
  specials differently; their `config.json` holds the ids).
  """

  def __init__(self, backend):
    self._backend = backend  # a `tokenizers.Tokenizer`
    ids = [backend.token_to_id(t) for t in SPECIAL_TOKENS]
    self.pad_id, self.bos_id, self.eos_id = ids

  @classmethod
  def from_file(cls, path: str) -> Tokenizer:
    """Loads a `tokenizer.json`; a missing or unreadable file names the path."""
    from tokenizers import Tokenizer as Backend

    if not os.path.isfile(path):
      raise FileNotFoundError(f"tokenizer file not found: {path}")
    try:
      return cls(Backend.from_file(path))
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
      raise ValueError(f"cannot read tokenizer {path}: {e}") from e

  @property
  def vocab_size(self) -> int:
    return self._backend.get_vocab_size()

  def get_vocab(self) -> dict[str, int]:
    """Token string -> id, specials included."""
    return self._backend.get_vocab()

  def encode(self, text: str) -> list[int]:
    return self._backend.encode(text).ids

  def encode_batch(self, texts: Sequence[str], special: bool = True) -> list[list[int]]:
    """Ids of each text; `special=False` adds no BOS (rendered chats carry their own)."""
    return [e.ids for e in self._backend.encode_batch(list(texts), add_special_tokens=special)]

  def decode(self, ids: Iterable[int]) -> str:
    """Text of `ids`; special tokens are dropped."""
    return self._backend.decode([int(i) for i in ids])

  def save(self, path: str) -> None:
    # Compact, merges as "a b" strings (tokenizers reads both forms; byte-level
    # pieces hold no spaces): the bundled pair ships in a size budget.
    data = json.loads(self._backend.to_str(pretty=False))
    merges = data.get("model", {}).get("merges") or []
    if all(isinstance(m, list) and " " not in "".join(m) for m in merges):
      data["model"]["merges"] = [" ".join(m) for m in merges]
    with open(path, "w", encoding="utf-8") as f:
      f.write(json.dumps(data, ensure_ascii=False, separators=(",", ":")))


def train_tokenizer(
  files: Sequence[str], vocab_size: int = 4096, min_frequency: int = 2
) -> Tokenizer:
  """Trains a byte-level BPE with the specials on `files` (deterministic)."""
  from tokenizers import ByteLevelBPETokenizer

  if vocab_size < 256 + len(SPECIAL_TOKENS):
    raise ValueError(
      f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} (256 bytes + specials), got {vocab_size}."
    )
  if not files:
    raise ValueError("train_tokenizer needs at least one file.")
  from specjax.data.corpus import read_source

  bpe = ByteLevelBPETokenizer()
  # From text, not paths: a few stdlib test fixtures are not valid UTF-8.
  bpe.train_from_iterator(
    (read_source(p) for p in files),
    vocab_size=vocab_size,
    min_frequency=min_frequency,
    special_tokens=list(SPECIAL_TOKENS),
    show_progress=False,
  )
  # The wrapper class only adds Python helpers; keep the plain Rust tokenizer.
  return Tokenizer(bpe._tokenizer)
