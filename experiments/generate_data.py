"""Write a training set of the target's own continuations (for draft distillation).

  python -m experiments.generate_data --target=runs/target --data_dir=runs/data \
      --out=runs/data_gen [--num_batches=80 --batch_size=128]

Each sample is a window of `prompt_tokens` train-split tokens followed by
`new_tokens` tokens the target generated from it, then `<eos>`: half of the
batches greedy (what temperature-0 decoding meets), half sampled at
temperature 1. The output directory is a data directory for
`experiments/train.py`: `train.bin` holds the samples; validation, test and
tokenizer are copied from --data_dir, so validation metrics stay comparable
(`specjax.training.continuations`).
"""

from __future__ import annotations

import functools
import json

from absl import flags

from experiments import common
from specjax.training.continuations import write_continuations


def main(argv):
  del argv
  f = flags.FLAGS
  meta = write_continuations(
    f.target,
    f.data_dir,
    f.out,
    f.num_batches,
    f.batch_size,
    f.prompt_tokens,
    f.new_tokens,
    f.seed,
    log=functools.partial(print, flush=True),
  )
  print(json.dumps(meta, indent=2))


def define_flags() -> None:
  """Defines this launcher's flags (called only when run as a script; see experiments.common)."""
  flags.DEFINE_string(
    "target", None, "Run directory or Hugging Face directory of the target.", required=True
  )
  flags.DEFINE_string(
    "data_dir", None, "Corpus data directory (train.bin, tokenizer.json).", required=True
  )
  flags.DEFINE_string("out", None, "Output data directory.", required=True)
  flags.DEFINE_integer("num_batches", 80, "Generation batches (even: greedy, odd: T=1).")
  flags.DEFINE_integer("batch_size", 128, "Prompts per batch.")
  flags.DEFINE_integer("prompt_tokens", 32, "Corpus tokens before each continuation.")
  flags.DEFINE_integer("new_tokens", 96, "Tokens the target generates per prompt.")
  flags.DEFINE_integer("seed", 0, "Seed of prompt windows and sampling.")


if __name__ == "__main__":
  define_flags()
  common.run(main)
