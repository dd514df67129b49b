"""Two tokenizers' vocabularies mapped onto each other, for drafting across tokenizers.

Two ids are the same token only when they stand for the same bytes: `token_bytes`
reads them (byte-level BPE, SentencePiece "▁" and "<0x41>" byte fallback, else
UTF-8; specials have none) and `build_vocab_map` builds the `VocabMap` tables
`specjax.drafting.CrossTokenizerDrafter` needs. A target id outside the
intersection expands to the draft's own encoding when it gives back the same
bytes, else a longest-match split (unspellable bytes: `<unk>`); an id without
bytes to the draft special of the same name, else the first special (else id 0).
The guide: docs/cross_tokenizer.md.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from typing import Any

import numpy as np

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
  """The inverse of GPT-2's byte-to-printable-character table (byte-level BPEs)."""
  printable = (
    list(range(ord("!"), ord("~") + 1))
    + list(range(ord("¡"), ord("¬") + 1))
    + list(range(ord("®"), ord("ÿ") + 1))
  )
  chars, extra = {}, 0
  for b in range(256):
    if b in printable:
      chars[chr(b)] = b
    else:
      chars[chr(256 + extra)] = b
      extra += 1
  return chars


def backend_of(tokenizer: Any):
  """The `tokenizers.Tokenizer` behind `tokenizer` (specjax's wrapper or the Rust
  tokenizer itself); ValueError for anything else."""
  backend = getattr(tokenizer, "_backend", tokenizer)
  if not all(hasattr(backend, name) for name in ("to_str", "get_vocab", "encode_batch")):
    raise ValueError(
      "expected a tokenizers.Tokenizer or a specjax.data.Tokenizer, got "
      f"{type(tokenizer).__name__}."
    )
  return backend


def _decoder_types(spec: dict | None) -> list[dict]:
  if not spec:
    return []
  if spec.get("type") == "Sequence":
    return [d for child in spec.get("decoders", []) for d in _decoder_types(child)]
  return [spec]


def token_bytes(tokenizer: Any) -> list[bytes | None]:
  """The bytes each id of `tokenizer` stands for; None for special tokens. A
  tokenizer with no `tokenizers` backend may say so itself (`token_bytes()`)."""
  if hasattr(tokenizer, "token_bytes"):
    return tokenizer.token_bytes()

  backend = backend_of(tokenizer)
  spec = json.loads(backend.to_str())
  decoders = _decoder_types(spec.get("decoder"))
  kinds = {d.get("type") for d in decoders}
  specials = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
  space = None  # the character a SentencePiece-style vocabulary writes for " "
  for d in decoders:
    if d.get("type") == "Metaspace":
      space = d.get("replacement", "▁")
    elif d.get("type") == "Replace" and d.get("content") == " ":
      space = d.get("pattern", {}).get("String", space)
  byte_fallback = "ByteFallback" in kinds or bool(spec.get("model", {}).get("byte_fallback"))
  byte_level = "ByteLevel" in kinds
  to_byte = _unicode_to_byte()

  vocab = backend.get_vocab(with_added_tokens=True)
  out: list[bytes | None] = [None] * (max(vocab.values(), default=-1) + 1)
  for text, i in vocab.items():
    if i in specials:
      continue
    if byte_fallback and (m := _BYTE_FALLBACK.match(text)):
      out[i] = bytes([int(m.group(1), 16)])
    elif byte_level and all(c in to_byte for c in text):
      out[i] = bytes(to_byte[c] for c in text)
    else:
      out[i] = (text.replace(space, " ") if space else text).encode("utf-8")
  return out


def special_tokens(tokenizer: Any) -> dict[str, int]:
  """{content: id} of the tokenizer's special tokens."""
  spec = json.loads(backend_of(tokenizer).to_str())
  return {t["content"]: t["id"] for t in spec.get("added_tokens", []) if t.get("special")}


@dataclasses.dataclass(frozen=True)
class VocabMap:
  """The static tables of one draft/target tokenizer pair (numpy, int32).

  Attributes:
    draft_to_target: `[V_d]` the target id of the same bytes, -1 off the
      intersection; target_to_draft `[V_t]` the inverse.
    expansion: `[V_t, L]` each target id as draft ids, padded with the fallback;
      expansion_lengths `[V_t]` in [1, L].
    shared: ids in the intersection.
    uncovered: bytes the draft could not spell (fed as `<unk>`).
    fallback: the draft id of an id without text or a same-named special.

  """

  draft_to_target: np.ndarray
  target_to_draft: np.ndarray
  expansion: np.ndarray
  expansion_lengths: np.ndarray
  shared: int
  uncovered: int
  fallback: int

  @property
  def max_expansion(self) -> int:
    """L, the most draft ids one target id becomes."""
    return int(self.expansion.shape[1])

  def report(self) -> dict[str, Any]:
    """Sizes and coverage, for logs."""
    lengths = self.expansion_lengths
    return {
      "draft_vocab": int(self.draft_to_target.size),
      "target_vocab": int(self.target_to_draft.size),
      "shared": self.shared,
      "shared_fraction_of_target": self.shared / max(1, self.target_to_draft.size),
      "max_expansion": self.max_expansion,
      "mean_expansion": float(lengths.mean()) if lengths.size else 0.0,
      "uncovered_bytes": self.uncovered,
    }


def check_size(name: str, tokenizer_size: int, model_size: int | None) -> int:
  """The model's vocabulary size (`tokenizer_size` when None); ValueError naming
  `name` when the model has fewer rows than the tokenizer has ids."""
  if model_size is None:
    return tokenizer_size
  if int(model_size) < tokenizer_size:
    raise ValueError(
      f"{name} has {tokenizer_size} ids but its model's vocab_size is {model_size}: the "
      "model must have a row for every id of its tokenizer (it may have more)."
    )
  return int(model_size)


def build_vocab_map(
  draft_tokenizer: Any,
  target_tokenizer: Any,
  draft_vocab_size: int | None = None,
  target_vocab_size: int | None = None,
) -> VocabMap:
  """The tables mapping `draft_tokenizer`'s ids onto `target_tokenizer`'s.

  Args:
    draft_tokenizer, target_tokenizer: `tokenizers.Tokenizer` or
      `specjax.data.Tokenizer`.
    draft_vocab_size, target_vocab_size: the models' vocabulary sizes, at
      least their tokenizers' (ids past a tokenizer have no text); None = the
      tokenizer's size.

  Raises:
    ValueError: a tokenizer with more ids than its model.
  """
  draft_bytes = token_bytes(draft_tokenizer)
  target_bytes = token_bytes(target_tokenizer)
  vd = check_size("draft_tokenizer", len(draft_bytes), draft_vocab_size)
  vt = check_size("target_tokenizer", len(target_bytes), target_vocab_size)
  by_bytes, d2t, t2d = _intersection(draft_bytes, target_bytes, vd, vt)
  draft_specials = special_tokens(draft_tokenizer)
  default = min(draft_specials.values(), default=0)
  unk = draft_specials.get("<unk>", by_bytes.get(b"<unk>", default))
  spell = _Speller(draft_tokenizer, draft_bytes, by_bytes, unk)
  target_specials = {i: name for name, i in special_tokens(target_tokenizer).items()}
  pieces = _pieces(target_bytes, t2d, spell, draft_specials, target_specials, default)
  width = max(len(p) for p in pieces)
  expansion = np.full((vt, width), default, np.int32)
  for i, p in enumerate(pieces):
    expansion[i, : len(p)] = p
  return VocabMap(
    draft_to_target=d2t,
    target_to_draft=t2d,
    expansion=expansion,
    expansion_lengths=np.array([len(p) for p in pieces], np.int32),
    shared=int((t2d >= 0).sum()),
    uncovered=spell.uncovered,
    fallback=default,
  )


def _intersection(
  draft_bytes: list[bytes | None], target_bytes: list[bytes | None], vd: int, vt: int
) -> tuple[dict[bytes, int], np.ndarray, np.ndarray]:
  """`(by_bytes, draft_to_target [V_d], target_to_draft [V_t])`: the draft id that
  stands for each draft text (the lowest of several), and the ids whose bytes both
  vocabularies hold (-1 off the intersection; ids past a tokenizer have no text)."""
  by_bytes: dict[bytes, int] = {}
  for i, b in enumerate(draft_bytes):
    if b and b not in by_bytes:  # several ids of one text: the lowest stands for it
      by_bytes[b] = i
  d2t = np.full((vd,), -1, np.int32)
  t2d = np.full((vt,), -1, np.int32)
  for i, b in enumerate(target_bytes):
    j = by_bytes.get(b) if b else None
    if j is not None and d2t[j] < 0:
      d2t[j], t2d[i] = i, j
  return by_bytes, d2t, t2d


def _pieces(
  target_bytes: list[bytes | None],
  t2d: np.ndarray,
  spell: _Speller,
  draft_specials: dict[str, int],
  target_specials: dict[int, str],
  default: int,
) -> list[list[int]]:
  """Each target id (of `t2d`'s V_t) as draft ids: its draft id in the
  intersection, its bytes spelled by `spell` off it, and for an id without bytes
  the draft special of the same name (else `default`)."""
  pieces: list[list[int]] = []
  to_spell: dict[int, bytes] = {}  # spelled in one batch below
  for i in range(t2d.size):
    b = target_bytes[i] if i < len(target_bytes) else None
    if t2d[i] >= 0:
      pieces.append([int(t2d[i])])
    elif b:
      pieces.append([])
      to_spell[i] = b
    else:
      pieces.append([draft_specials.get(target_specials.get(i, ""), default)])
  for i, ids in zip(to_spell, spell(list(to_spell.values()))):
    pieces[i] = ids
  return pieces


class _Speller:
  """Spells byte strings in draft ids: the draft tokenizer's own encoding where it
  gives back exactly those bytes, else longest match over the draft's byte strings."""

  def __init__(self, tokenizer, draft_bytes, by_bytes, unk):
    self.backend = backend_of(tokenizer)
    self.draft_bytes = draft_bytes
    self.by_bytes = by_bytes
    self.longest = max((len(b) for b in by_bytes), default=1)
    self.unk = unk
    self.uncovered = 0

  def __call__(self, strings: list[bytes]) -> list[list[int]]:
    texts = [b.decode("utf-8", errors="replace") for b in strings]
    encodings = self.backend.encode_batch(texts, add_special_tokens=False)
    out = []
    for b, enc in zip(strings, encodings):
      ids = list(enc.ids)
      spelled = [self.draft_bytes[i] if i < len(self.draft_bytes) else None for i in ids]
      ok = ids and None not in spelled and b"".join(spelled) == b
      out.append(ids if ok else self._longest_match(b))
    return out

  def _longest_match(self, b: bytes) -> list[int]:
    out, k = [], 0
    while k < len(b):
      for n in range(min(self.longest, len(b) - k), 0, -1):
        j = self.by_bytes.get(b[k : k + n])
        if j is not None:
          out.append(j)
          k += n
          break
      else:
        self.uncovered += 1
        if not out or out[-1] != self.unk:  # a run of unspellable bytes: one <unk>
          out.append(self.unk)
        k += 1
    return out
