"""Load-test the serving engine: held-out prompts at Poisson arrival rates, per mode.

  python -m experiments.load_test --output_dir=DIR        # bundled pair, 3 rates x 3 modes
  python -m experiments.load_test --output_dir=DIR --config.rates="(2.0,)" \\
      --config.modes="('plain', 'adaptive')" --config.num_requests=64
  python -m experiments.load_test --output_dir=DIR --config.model=tiny   # a smoke test
  python -m experiments.load_test --output_dir=DIR --config.target=http://127.0.0.1:8000

In process, each mode gets its own engine (plain: no draft, policy "never";
always; adaptive), warmed up before it is timed, and serves the same requests
at the same arrival times at each rate. Against a URL the running server's
engine is measured, streaming, with latencies taken at the client.

  python -m experiments.load_test --output_dir=DIR --render_from=DIR/load_test.json

Each rate runs `config.repeats` rounds; in a round every mode serves the same
arrivals, the modes taking turns (rotated each round), so the modes compare
round by round on a machine whose speed drifts.

Writes DIR/load_test.json: per (mode, rate, round) the
`specjax.serving.summarize` figures (throughput, goodput under config.slo_*,
acceptance, TTFT / TPOT / e2e percentiles) and every request's TTFT, TPOT and
e2e, and per rate the adaptive policy's throughput over the better of plain
and always (`adaptive_vs_best`, when all three ran); DIR/load_test.md (the
tables, also printed); with more than one rate
also DIR/load_sweep.png (throughput and p99 TTFT against offered load; needs
matplotlib: `pip install 'specjax[plots]'`).
"""

from __future__ import annotations

import json
import os

from absl import app, flags, logging

from experiments import common
from specjax.jobs import load_test


def main(argv):
  common.check_no_args(argv)
  output_dir = flags.FLAGS.output_dir
  if not output_dir:
    raise app.UsageError("--output_dir is required (where load_test.json and the figure go).")
  logging.set_verbosity(logging.WARNING)  # keep backend probing out of the progress lines
  progress = lambda line: print(line, flush=True)
  if flags.FLAGS.render_from:  # the table and figure again, from a saved report
    os.makedirs(output_dir, exist_ok=True)
    with open(flags.FLAGS.render_from) as f:
      load_test.render(json.load(f), output_dir, progress)
    return
  load_test.run(flags.FLAGS.config, output_dir, progress=progress)


def define_flags() -> None:
  """Defines this launcher's flags (called only when run as a script; see experiments.common)."""
  common.define_config_flag("Load-test configuration (configs/load_test.py).", "load_test.py")
  flags.DEFINE_string("output_dir", None, "Where load_test.json, .md and load_sweep.png go.")
  flags.DEFINE_string(
    "render_from", "", "A saved load_test.json: write its table and figure again, measure nothing."
  )


if __name__ == "__main__":
  define_flags()
  common.run(main)
