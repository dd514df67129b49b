"""Train a model (or distill a draft) on the standard-library corpus.

  python -m experiments.train --config=configs/train_target.py --workdir=runs/target \
      --config.data.dir=runs/data

Resumes from the latest checkpoint in --workdir automatically. Progress lines
(step, loss, tokens/s, ETA) go to stdout and <workdir>/metrics.jsonl (process 0
only). `--config.mesh_shape=(data,model)` picks the mesh; `--distributed` joins
a multi-host job first (see the README's scale-out section).
"""

from __future__ import annotations

from absl import app, flags, logging
from ml_collections import config_flags

from specjax.distributed import launch
from specjax.training import train


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  launch.maybe_initialize()  # --distributed: join the multi-host job first
  logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
  train(flags.FLAGS.config, flags.FLAGS.workdir, echo=lambda line: print(line, flush=True))


def define_flags() -> None:
  config_flags.DEFINE_config_file("config", None, "A train config (configs/train_*.py).",
                                  lock_config=True)
  flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics).")
  flags.mark_flags_as_required(["config", "workdir"])
  launch.define_flags()


if __name__ == "__main__":
  define_flags()
  app.run(main)
