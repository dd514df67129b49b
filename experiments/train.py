"""Train a model (or distill a draft) on the standard-library corpus.

  python -m experiments.train --config=configs/train_target.py --workdir=runs/target \
      --config.data.dir=runs/data

A config with `config.head.kind` trains a draft head on a frozen target instead
(configs/train_eagle.py, train_medusa.py, train_early_exit.py; see
`specjax.training.heads`):

  python -m experiments.train --config=configs/train_eagle.py --workdir=runs/eagle

The corpus is encoded on first use into --config.data.dir (or <workdir>/data),
but a config with a second phase on data made for it (the heads, distill_draft_gen,
the cross draft) encodes only into its `config.data.corpus_dir`: another missing
data dir (e.g. runs/data_gen) is one error naming --config.data.dir and the
`experiments.generate_data` command that makes it, before anything is written.

Resumes from the latest checkpoint in --workdir automatically. Progress lines
(step, loss, tokens/s, ETA) go to stdout and <workdir>/metrics.jsonl (process 0
only). `--config.mesh_shape=(data,model)` picks the mesh; `--distributed` joins
a multi-host job first (see docs/scale_out.md).
"""

from __future__ import annotations

from absl import app, flags, logging

from experiments import common
from specjax.distributed import launch
from specjax.training import train


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  launch.maybe_initialize()  # --distributed: join the multi-host job first
  logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
  train(flags.FLAGS.config, flags.FLAGS.workdir, echo=lambda line: print(line, flush=True))


def define_flags() -> None:
  """Defines this launcher's flags (called only when run as a script; see experiments.common)."""
  common.define_config_flag("A train config (configs/train_*.py).")
  flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics).", required=True)
  launch.define_flags()


if __name__ == "__main__":
  define_flags()
  common.run(main)
