"""The bundled trained draft/target pair, loaded offline in one call.

  target, draft, tokenizer = specjax.pretrained.load_pair()

Both models were trained on the Python standard library's source (see the
model card in the README and `stdlib_pair/card.json`); the draft is distilled
toward the target. The files are ordinary Hugging Face Llama checkpoints
(`stdlib_pair/target`, `stdlib_pair/draft`) sharing `stdlib_pair/tokenizer.json`,
so `specjax.hf.load_model` and transformers read them too.
"""

from __future__ import annotations

import hashlib
import os
from typing import NamedTuple

import jax.numpy as jnp

from specjax.data.tokenizer import Tokenizer
from specjax.dtypes import dtype_name
from specjax.hf.loader import load_model
from specjax.models.transformer import Transformer
from specjax.validation import read_json_object

PAIR_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stdlib_pair")
TARGET_DIR = os.path.join(PAIR_DIR, "target")
DRAFT_DIR = os.path.join(PAIR_DIR, "draft")
TOKENIZER_FILE = os.path.join(PAIR_DIR, "tokenizer.json")
CARD_FILE = os.path.join(PAIR_DIR, "card.json")
# The files whose sha256 `card.json` records, relative to the pair's directory.
BUNDLED_FILES = (
  "target/config.json",
  "target/model.safetensors",
  "draft/config.json",
  "draft/model.safetensors",
  "tokenizer.json",
)
_REBUILD = "reinstall specjax, or rebuild it with experiments/bundle_pair.py"


class Pair(NamedTuple):
  target: Transformer
  draft: Transformer
  tokenizer: Tokenizer


def file_sha256(path: str) -> str:
  """The hex sha256 of the file at `path`, read in chunks."""
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      digest.update(chunk)
  return digest.hexdigest()


def file_sums(directory: str) -> dict[str, str]:
  """{relative path: sha256} of the BUNDLED_FILES under `directory` (for card.json)."""
  return {rel: file_sha256(os.path.join(directory, rel)) for rel in BUNDLED_FILES}


def _verify_sums(sums) -> None:
  """Raises ValueError unless every bundled file has the sha256 `card.json` records."""
  if not isinstance(sums, dict):
    raise ValueError(f"{CARD_FILE} has no 'sha256' table of the bundled files ({_REBUILD}).")
  for rel in BUNDLED_FILES:
    expected = sums.get(rel)
    if not isinstance(expected, str):
      raise ValueError(f"{CARD_FILE}: 'sha256' has no entry for {rel} ({_REBUILD}).")
    path = os.path.join(PAIR_DIR, rel)
    actual = file_sha256(path)
    if actual != expected:
      raise ValueError(
        f"{path} is corrupt or was changed: card.json records sha256 "
        f"{expected}, the file has {actual} ({_REBUILD})."
      )


def load_pair(dtype=jnp.float32) -> Pair:
  """`(target, draft, tokenizer)` of the bundled pair; weights cast to `dtype`.

  The files hold bfloat16 weights; float32 (the default) computes in float32,
  which keeps greedy speculative and autoregressive outputs bit-identical.
  Every file is checked against the sha256 in `card.json` before it is loaded.

  Raises:
    FileNotFoundError: a bundled file is missing.
    ValueError: a bad `dtype`, or a file whose sha256 differs from the card's.
  """
  dtype_name(dtype)  # a bad dtype fails before any file is read
  for path in (TARGET_DIR, DRAFT_DIR, TOKENIZER_FILE, CARD_FILE):
    if not os.path.exists(path):
      raise FileNotFoundError(f"the bundled pair is incomplete: {path} is missing ({_REBUILD})")
  _verify_sums(model_card().get("sha256"))
  tokenizer = Tokenizer.from_file(TOKENIZER_FILE)
  target, _ = load_model(TARGET_DIR, dtype=dtype)
  draft, _ = load_model(DRAFT_DIR, dtype=dtype)
  return Pair(target, draft, tokenizer)


def model_card() -> dict:
  """The training record of the bundled pair (commands, steps, tokens, metrics, sha256)."""
  if not os.path.exists(CARD_FILE):
    raise FileNotFoundError(f"the bundled pair is incomplete: {CARD_FILE} is missing ({_REBUILD})")
  return read_json_object(CARD_FILE)


__all__ = [
  "BUNDLED_FILES",
  "CARD_FILE",
  "DRAFT_DIR",
  "PAIR_DIR",
  "Pair",
  "TARGET_DIR",
  "TOKENIZER_FILE",
  "file_sha256",
  "file_sums",
  "load_pair",
  "model_card",
]
