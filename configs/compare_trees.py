"""Configuration of `experiments/compare_drafters.py` for token trees only: each
tree drafter against its own chains, at temperature 0 and 1 (the README's tree
table).

  python -m experiments.compare_drafters --config=configs/compare_trees.py

The `smoke` preset (`--config=configs/compare_trees.py:smoke`) keeps the draft
model's chain and its tree of 8 nodes (greedy, one prompt of 16 tokens). The
`1b` preset asks the question at the scaled pair's memory-bound size (float32
target, bfloat16 draft and head, greedy, one prompt): do trees beat chains when
extra positions are nearly free? (docs/performance.md; about 15 minutes on 2 cores.)
"""

from __future__ import annotations

import ml_collections

from configs import compare_drafters


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
  """The drafter grid narrowed to the chains that trees are compared with;
  `preset` "smoke" cuts it to two variants."""
  if preset and preset not in ("smoke", "1b"):
    raise ValueError(f"preset must be one of ('smoke', '1b') (or none), got {preset!r}.")
  c = compare_drafters.get_config()
  c.verifiers = ("greedy", "token")  # greedy at T = 0, token at T = 1
  c.ngram = 0
  c.layer_skip = ()
  c.heads = ("eagle", "medusa")
  c.head_gammas = ml_collections.ConfigDict(dict(eagle=(3, 6), medusa=(2, 3)))
  c.fr_spec = 0
  c.gamma_sweep = (3, 6)
  c.adaptive = ()
  c.trees.sizes = (8, 16, 32)
  c.trees.eagle2 = ((16, 6, 4, 3), (16, 8, 3, 2))
  c.cross_tokenizer = False
  if preset == "smoke":  # the draft model's chain and tree
    compare_drafters.smoke(c)
    c.heads = ()
    c.head_gammas = ml_collections.ConfigDict(dict(eagle=(), medusa=()))
    c.trees.sizes = (8,)
  if preset == "1b":
    c.scale, c.dtype, c.draft_dtype = "1b", "float32", "bfloat16"
    c.num_prompts = 1
    c.temperatures = (0.0,)
    c.verifiers = ("greedy",)
    c.heads = ("eagle",)
    c.head_gammas = ml_collections.ConfigDict(dict(eagle=(), medusa=()))
    c.gamma_sweep = ()
    c.trees.sizes = (8, 16)
    c.trees.eagle2 = ((16, 6, 4, 3),)
  return c
