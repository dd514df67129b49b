"""Configuration of `experiments/compare_drafters.py`: every drafter x verifier,
on the bundled pair, at temperature 0 and 1, in one run.

  python -m experiments.compare_drafters --output_json=drafters.json --output_md=drafters.md

The `smoke` preset (`--config=configs/compare_drafters.py:smoke`) keeps two
variants (the draft model and prompt lookup, greedy, one prompt of 16 tokens):
a check that the launcher runs, in well under a minute on 2 CPU cores.
"""

from __future__ import annotations

import ml_collections

PRESETS = ("smoke",)


def check_preset(preset: str | None) -> None:
  """Raises a ValueError unless `preset` is None, empty or one of `PRESETS`."""
  if preset and preset not in PRESETS:
    raise ValueError(f"preset must be one of {PRESETS} (or none), got {preset!r}.")


def smoke(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """`c` cut to a launcher check: one prompt of 16 tokens at temperature 0,
  greedy verification, three timed runs; the variants are left to the caller."""
  c.num_prompts = 1
  c.max_new_tokens = 16
  c.num_runs = 3
  c.temperatures = (0.0,)
  c.verifiers = ("greedy",)
  c.gamma_sweep = ()
  c.adaptive = ()
  c.fr_spec = 0
  c.trees.eagle2 = ()
  return c


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
  """The comparison's configuration; `preset` "smoke" cuts it to two variants."""
  check_preset(preset)
  c = ml_collections.ConfigDict()
  # The bundled pair as trained (""), or grown to a preset's shapes computing the
  # same function ("160m", "1b": specjax/pretrained/scales.py), in `dtype`.
  c.scale = ""
  c.dtype = "float32"
  c.draft_dtype = ""  # the draft model's and heads' dtype; "" = dtype
  c.gamma = 4  # fixed draft length of the drafter x verifier grid
  c.max_new_tokens = 64
  c.num_prompts = 4  # held-out test-split prompts, decoded one by one (batch 1)
  # Or every prompt of a file (specjax.data.prompts.read_prompt_file: .txt, or .jsonl
  # with text / prompt / Spec-Bench's turns and category), num_prompts unused; each
  # row adds per_category (α, tokens per iteration, ms/token, speedup) and the
  # markdown a table by category.
  c.prompt_file = ""
  c.num_runs = 3  # timed runs per variant (median), after a warm-up
  c.temperatures = (0.0, 1.0)
  # Verifiers of the drafter grid (greedy applies at temperature 0 only); the
  # first that applies also runs the gamma sweep and the adaptive lengths.
  c.verifiers = ("greedy", "token", "block")
  c.ngram = 3  # longest n-gram the prompt-lookup drafter matches (0: no prompt lookup)
  c.layer_skip = (1, 2, 3, 4, 5)  # target layers kept by the self-speculation drafter
  c.heads = ("eagle", "medusa", "early_exit", "dflash")  # the bundled draft heads on the target
  # Further draft lengths per head (first verifier only), e.g. early exit at small gamma.
  # The block drafter (DFlash) also at its whole block, B - 1 = 7.
  c.head_gammas = ml_collections.ConfigDict(
    dict(eagle=(), medusa=(), early_exit=(1, 2), dflash=(7,))
  )
  # Heads of your own beside the bundled ones, "label=DIR" (DIR a training run or an
  # export), each a chain row at gamma with the first verifier, e.g.
  # --config.head_dirs="('mine=runs/dspark',)".
  c.head_dirs = ()
  c.fr_spec = 1024  # also each head drafting among the K most frequent ids (0: not)
  c.gamma_sweep = (1, 2, 3, 4, 6, 8)  # fixed gammas the adaptive lengths are compared with
  c.gamma_max = 8  # adaptive draft lengths choose within this
  c.adaptive = ("schedule", "confidence")  # adaptive draft lengths of the draft model
  c.confidence_threshold = 0.5
  # "while": the loops test for finished rows after every iteration; "chunked":
  # after every loop_chunk iterations (on GPU, one device-to-host wait per chunk).
  # String-level exact match runs its loop on the host either way.
  c.loop = "while"
  c.loop_chunk = 8
  c.seed = 0
  # Rows of the bundled draft with its own 1024-id tokenizer: token-level
  # intersection (CrossTokenizerDrafter) and string-level exact match
  # (string_level_generate), next to the same-tokenizer "draft model" rows.
  c.cross_tokenizer = True
  # Token trees: each drafter drafts the best static tree of each size for its
  # per-rank acceptance (rank 0 about the drafter's measured alpha at T = 0;
  # specjax.trees.best), verified by tree_verify (gamma = the tree's nodes).
  c.trees = ml_collections.ConfigDict()
  c.trees.sizes = (8, 16)
  # Deepest tree level; 0 = gamma, so a tree is compared with the chain of its
  # depth and differs only in width (Medusa: at most its number of heads).
  c.trees.max_depth = 0
  # EAGLE-2 dynamic trees (specjax.trees.DynamicTree): (size, depth, branch, expand).
  c.trees.eagle2 = ()
  c.trees.mode = "without_replacement"  # how siblings are drawn at T > 0
  c.trees.rank_acceptance = ml_collections.ConfigDict(
    {
      "draft model": (0.75, 0.1, 0.04),
      "EAGLE head": (0.9, 0.05, 0.02),
      "Medusa heads": (0.6, 0.15, 0.06),
    }
  )
  if preset == "smoke":  # the draft model and prompt lookup
    smoke(c)
    c.layer_skip = ()
    c.heads = ()
    c.cross_tokenizer = False
    c.trees.sizes = ()
  return c
