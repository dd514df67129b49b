"""The bundled trained draft/target pair, loaded offline in one call.

  target, draft, tokenizer = specjax.pretrained.load_pair()

Both models were trained on the Python standard library's source (see the
model card in the README and `stdlib_pair/card.json`); the draft is distilled
toward the target. The files are ordinary Hugging Face Llama checkpoints
(`stdlib_pair/target`, `stdlib_pair/draft`) sharing `stdlib_pair/tokenizer.json`,
so `specjax.hf.load_model` and transformers read them too.
"""

from __future__ import annotations

import json
import os
from typing import NamedTuple

import jax.numpy as jnp

from specjax.data.tokenizer import Tokenizer
from specjax.hf.loader import load_model
from specjax.models.transformer import Transformer

PAIR_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stdlib_pair")
TARGET_DIR = os.path.join(PAIR_DIR, "target")
DRAFT_DIR = os.path.join(PAIR_DIR, "draft")
TOKENIZER_FILE = os.path.join(PAIR_DIR, "tokenizer.json")
CARD_FILE = os.path.join(PAIR_DIR, "card.json")


class Pair(NamedTuple):
  target: Transformer
  draft: Transformer
  tokenizer: Tokenizer


def load_pair(dtype=jnp.float32) -> Pair:
  """`(target, draft, tokenizer)` of the bundled pair; weights cast to `dtype`.

  The files hold bfloat16 weights; float32 (the default) computes in float32,
  which keeps greedy speculative and autoregressive outputs bit-identical.
  """
  for path in (TARGET_DIR, DRAFT_DIR, TOKENIZER_FILE):
    if not os.path.exists(path):
      raise FileNotFoundError(f"the bundled pair is incomplete: {path} is missing "
                              "(reinstall specjax, or rebuild it with experiments/bundle_pair.py)")
  target, _ = load_model(TARGET_DIR, dtype=dtype)
  draft, _ = load_model(DRAFT_DIR, dtype=dtype)
  return Pair(target, draft, Tokenizer.from_file(TOKENIZER_FILE))


def model_card() -> dict:
  """The training record of the bundled pair (commands, steps, tokens, metrics)."""
  with open(CARD_FILE) as f:
    return json.load(f)


__all__ = ["CARD_FILE", "DRAFT_DIR", "PAIR_DIR", "Pair", "TARGET_DIR", "TOKENIZER_FILE",
           "load_pair", "model_card"]
