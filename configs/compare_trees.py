"""Configuration of `experiments/compare_drafters.py` for token trees only: each
tree drafter against its own chains, at temperature 0 and 1 (the README's tree
table).

  python -m experiments.compare_drafters --config=configs/compare_trees.py

The `smoke` preset (`--config=configs/compare_trees.py:smoke`) keeps the draft
model's chain and its tree of 8 nodes (greedy, one prompt of 16 tokens).
"""

from __future__ import annotations

import ml_collections

from configs import compare_drafters


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
  """The drafter grid narrowed to the chains that trees are compared with;
  `preset` "smoke" cuts it to two variants."""
  compare_drafters.check_preset(preset)
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
  return c
