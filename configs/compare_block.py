"""The block drafters (DFlash, and DSpark's sequential one) side by side with the draft
model, the EAGLE chain,
EAGLE-2 trees, static trees (the block drafter's and the EAGLE head's) and
self-speculation (early exit, layer skip), at T = 0 (greedy verification) and
T = 1 (token verification), batch 1, in one run:

  python -m experiments.compare_drafters --config=configs/compare_block.py \
      --output_json=runs/block.json --output_md=runs/block.md
  python -m experiments.compare_drafters --config=configs/compare_block.py:1b \
      --output_json=runs/block_1b.json --output_md=runs/block_1b.md

The default is the bundled pair as trained; `1b` grows it to the memory-bound
TinyLlama shape (float32 target, bfloat16 draft and heads, one prompt), where one
drafting call instead of gamma pays most (docs/heads.md, "Block drafter"). Each row
reports tokens and draft calls per iteration, the draft cost c (one drafted token in
target steps) and the speedup. `smoke` keeps the block drafter's greedy row.
"""

from __future__ import annotations

import ml_collections

from configs import compare_drafters

PRESETS = ("smoke", "1b")


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
  """The block drafter's comparison; `preset` "1b" grows the pair, "smoke" cuts it
  to one greedy row."""
  if preset and preset not in PRESETS:
    raise ValueError(f"preset must be one of {PRESETS} (or none), got {preset!r}.")
  c = compare_drafters.get_config()
  c.verifiers = ("greedy", "token")  # greedy at T = 0, token at T = 1
  c.ngram = 0
  c.layer_skip = (2,)  # the target's first 2 of 6 layers (grown: the same layers)
  c.heads = ("eagle", "early_exit", "dflash", "dspark")
  c.gamma = 4
  # The block drafters at their whole block (B - 1 = 7) and at the gamma measured at
  # start-up (0: what decode and serve draft by default); early exit at gamma 1.
  c.head_gammas = ml_collections.ConfigDict(
    dict(eagle=(), early_exit=(1,), dflash=(7, 0), dspark=(7, 0))
  )
  c.fr_spec = 0
  c.gamma_sweep = ()
  c.adaptive = ()
  c.trees.eagle2 = ((8, 4, 2, 2),)  # EAGLE-2: 8 nodes, depth 4 (the chain's 4 + 1 rows, wider)
  # Static trees as deep as the block (B - 1 = 7): the block drafter's depth-d
  # children come from its block position d + 1, all from its one call; the EAGLE
  # head's static trees of the same sizes (one head call per depth) beside them.
  c.trees.sizes = (16, 64)
  c.trees.max_depth = 7
  c.trees.rank_acceptance = ml_collections.ConfigDict(
    {
      "EAGLE head": (0.9, 0.05, 0.02),
      "block drafter": (0.7, 0.15, 0.08, 0.04),
      "sequential block drafter": (0.75, 0.12, 0.06, 0.03),
    }
  )
  c.cross_tokenizer = False
  if preset == "1b":
    c.scale, c.dtype, c.draft_dtype = "1b", "float32", "bfloat16"
    c.num_prompts = 1
    c.max_new_tokens = 32  # about 20 minutes for the table on 2 cores
    c.num_runs = 3
    # A grown layer count: the 2 kept layers sit at 0 and 4 of 22 (models.expand.layer_map).
    c.layer_skip = (5,)
    c.trees.sizes = (8, 16)  # a tree's N + 1 rows are verified in one call: keep N small
  if preset == "smoke":
    compare_drafters.smoke(c)
    c.heads = ("dflash",)
    c.layer_skip = ()
    c.head_gammas = ml_collections.ConfigDict(dict(dflash=()))
    c.trees.eagle2 = ()
    c.trees.sizes = ()
  return c
