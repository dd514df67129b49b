"""Configuration of `experiments/reproduce.py`: the papers' tables and figures on
the bundled models.

  python -m experiments.reproduce --output_dir=runs/reproduce       # full: 25 min here
  python -m experiments.reproduce --output_dir=/tmp/quick --quick   # < 3 min, what tests run
  python -m experiments.reproduce --config=configs/reproduce.py:daliri --output_dir=runs/daliri

The first full run also trains runs/draft_ce (12 min here).

`--quick` applies `config.quick`'s fields over the others.
"""

from __future__ import annotations

import ml_collections

from configs import train_draft
from specjax.reproduce.run import DISTILLED, DRAFTERS

PRESETS = ("daliri",)


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
  """The full run's configuration; `quick` holds the quick run's overrides.
  Preset "daliri": the quick run's settings (one timed run, a 4-step
  corpus-trained draft, one γ) at the size of a measurement, for the Daliri et al.
  section: 8 prompts × 64 tokens, T = 0.7 and 1, every drafter, the distilled
  draft and the EAGLE head also with the coupled verifier (5 minutes here)."""
  if preset is not None and preset not in PRESETS:
    raise ValueError(f"preset must be one of {PRESETS} (or none), got {preset!r}.")
  c = ml_collections.ConfigDict()
  c.gamma = 4  # draft length of Table 3, Table 4, Sun and DistillSpec
  c.gammas = (1, 2, 3, 4, 6, 8)  # the distilled draft's sweep (Leviathan's figures, Chen's K)
  c.temperatures = (0.0, 1.0)
  c.num_prompts = 8  # held-out test-split prompts, each decoded alone (batch 1)
  c.max_new_tokens = 64
  c.num_runs = 3  # timed runs per variant (median), after a warm-up
  c.seed = 0
  c.drafters = DRAFTERS  # every drafter specjax has (Table 3's rows)
  # Measured again with the coupled verifier at T > 0 (Daliri et al.; every drafter
  # of `drafters` is checked for the same text as plain decoding)
  c.coupled_drafters = (DISTILLED, "EAGLE head")
  c.count_files = 0  # training-split files the unigram and bigram drafts count (0: all)
  c.count_smoothing = 1.0  # add-k pseudo-counts of the count drafts
  c.layer_skip = 3  # target layers the layer-skip draft keeps (of 6)
  c.samples = 200_000  # sampled iterations of each worked example
  c.figures = True  # PNGs (needs matplotlib: pip install 'specjax[plots]')
  # The corpus-trained draft (DistillSpec's baseline): a run directory, trained
  # there first with `train` (configs/train_draft.py) when it holds no checkpoint.
  train = train_draft.get_config()
  train.data.dir = "runs/data"  # token files (built on first use); "" -> <output_dir>/data
  c.corpus_draft = ml_collections.ConfigDict(
    dict(
      run="runs/draft_ce",  # "" -> <output_dir>/corpus_draft
      files_per_split=(),  # (train, validation, test) files of a small corpus; () = all
      train=train,
    )
  )
  c.quick = ml_collections.ConfigDict(
    dict(
      gammas=(4,),
      temperatures=(1.0,),  # one compiled program per variant and temperature: CI time
      num_prompts=1,
      max_new_tokens=24,
      num_runs=1,
      drafters=("unigram", "bigram", "corpus-trained draft", "distilled draft"),
      coupled_drafters=("distilled draft",),
      count_files=40,
      samples=20_000,
      corpus_draft=dict(
        run="",
        files_per_split=(12, 2, 2),
        train=dict(num_steps=4, batch_size=4, seq_len=64, data=dict(dir="")),
      ),
    )
  )
  if preset == "daliri":
    from specjax.reproduce.run import apply_quick

    c.quick.update(
      dict(
        num_prompts=8,
        max_new_tokens=64,
        temperatures=(0.7, 1.0),
        drafters=DRAFTERS,
        coupled_drafters=(DISTILLED, "EAGLE head"),
      )
    )
    c = apply_quick(c)
  return c
