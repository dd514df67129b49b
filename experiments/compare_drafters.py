"""Compare drafters, verifiers and adaptive draft lengths on the bundled pair.

  python -m experiments.compare_drafters [--config=configs/compare_drafters.py] \
      [--output_json=PATH] [--output_md=PATH]

Every drafter x every verifier that applies at each temperature, then gamma
sweeps, adaptive draft lengths and token trees, each variant timed against the
autoregressive baseline: `specjax.jobs.compare_drafters.run`. Prints a line per
variant on stderr as it runs, then the markdown table (the README's) on stdout;
the JSON (rows and environment) goes to --output_json.
"""

from __future__ import annotations

import sys
import time

from absl import flags

from experiments import common
from specjax import bench
from specjax.jobs import compare_drafters
from specjax.results import write_json, write_text
from specjax.validation import check_output_path


def main(argv):
  common.check_no_args(argv)
  output_json = check_output_path("--output_json", flags.FLAGS.output_json)
  output_md = check_output_path("--output_md", flags.FLAGS.output_md)
  start = time.perf_counter()
  rows = compare_drafters.run(flags.FLAGS.config, progress=True)
  result = {"rows": rows, **bench.environment_info()}
  table = compare_drafters.markdown(rows)
  print(table)
  write_json(output_json, result)
  write_text(output_md, table)
  saved = ", ".join(p for p in (output_json, output_md) if p) or "pass --output_json for the JSON"
  print(f"{len(rows)} variants in {time.perf_counter() - start:.0f} s ({saved})", file=sys.stderr)


def define_flags() -> None:
  """Defines this launcher's flags (called only when run as a script; see experiments.common)."""
  common.define_config_flag(
    "Comparison configuration (configs/compare_drafters.py).", "compare_drafters.py"
  )
  common.define_output_flags(markdown=True)


if __name__ == "__main__":
  define_flags()
  common.run(main)
