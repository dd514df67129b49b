"""Configuration of `experiments/compare_drafters.py` for drafts with another
tokenizer: the bundled cross draft (1024-id BPE) through token-level
intersection and string-level exact match, next to the same-tokenizer draft.

  python -m experiments.compare_drafters --config=configs/compare_cross_tokenizer.py \
      --output_json=cross.json --output_md=cross.md

The `smoke` preset (`--config=configs/compare_cross_tokenizer.py:smoke`) keeps
the three drafts with greedy verification on one prompt of 16 tokens.
"""

from __future__ import annotations

import ml_collections

from configs import compare_drafters


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
  """The drafter grid narrowed to the three drafts (T = 0 and 1, every verifier);
  `preset` "smoke" cuts it to greedy verification at T = 0 (three variants)."""
  compare_drafters.check_preset(preset)
  c = compare_drafters.get_config()
  c.ngram = 0
  c.layer_skip = ()
  c.heads = ()
  c.fr_spec = 0
  c.gamma_sweep = ()
  c.adaptive = ()
  c.trees.sizes = ()
  c.cross_tokenizer = True
  if preset == "smoke":
    compare_drafters.smoke(c)
  return c
