"""Regenerate the papers' tables and figures on the bundled models.

  python -m experiments.reproduce --output_dir=DIR [--quick] [--config=configs/reproduce.py]

Writes DIR/report.md (each table: the paper's number next to ours, a one-line
verdict per row), DIR/report.json (the same data, plus every measured row) and
PNG figures (matplotlib: `pip install 'specjax[plots]'`). Sections: Leviathan
et al.'s closed forms and figures, Table 3 (α by draft, unigram and bigram
drafts included) and Table 4 (predicted against measured speedup); Chen et
al.'s acceptance by position and speedup against K; Sun et al.'s block
verification (the binary toy, and the gain on the bundled pair); DistillSpec
(distilled against corpus-trained draft); the explainers' worked examples,
sampled through the real verifier. `--quick` (config.quick's fields) finishes
in under 3 minutes on a 2-core CPU; the full run takes about 25 minutes here
(plus 12 for training the corpus-trained draft the first time).
`--render_from=DIR/report.json` renders the tables and figures again from a
saved run without measuring.
"""

from __future__ import annotations

from absl import app, flags, logging

from experiments import common
from specjax.reproduce.run import apply_quick, read_saved_report, reproduce, write_report


def main(argv):
  common.check_no_args(argv)
  f = flags.FLAGS
  if not f.output_dir:
    raise app.UsageError("--output_dir is required (where report.md, report.json and PNGs go).")
  logging.set_verbosity(logging.WARNING)  # keep backend probing out of the progress lines
  if f.render_from:  # tables and figures again from a saved run, no measuring
    write_report(read_saved_report(f.render_from), f.output_dir)
    return
  config = apply_quick(f.config) if f.quick else f.config
  reproduce(config, f.output_dir, progress=lambda line: print(line, flush=True))


def define_flags() -> None:
  """Defines this launcher's flags (called only when run as a script; see experiments.common)."""
  common.define_config_flag("Reproduction configuration (configs/reproduce.py).", "reproduce.py")
  flags.DEFINE_string("output_dir", None, "Where report.md, report.json and the figures go.")
  flags.DEFINE_bool("quick", False, "Apply config.quick: under 3 minutes on a 2-core CPU.")
  flags.DEFINE_string(
    "render_from", None, "A report.json to render again (tables, figures) without measuring."
  )


if __name__ == "__main__":
  define_flags()
  common.run(main)
