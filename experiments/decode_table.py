"""Several decode runs side by side, one table (e.g. the scaled pair's figures).

  python -m experiments.decode_table [--config=configs/decode_table.py[:1b]] \
      [--output_json=PATH] [--output_md=PATH] [--output_plot=PATH]

Each row is `experiments.decode` with a few fields changed (configs/decode_table.py):
`specjax.jobs.decode_table.run`. Prints a line per row on stderr as it runs,
then the markdown table on stdout; the JSON (every row's full result) goes to
--output_json.
"""

from __future__ import annotations

import sys
import time

from absl import flags, logging

from experiments import common
from specjax import bench
from specjax.jobs import decode_table
from specjax.results import write_json, write_text
from specjax.validation import check_output_path


def main(argv):
  common.check_no_args(argv)
  logging.set_verbosity(logging.WARNING)
  output_json = check_output_path("--output_json", flags.FLAGS.output_json)
  output_md = check_output_path("--output_md", flags.FLAGS.output_md)
  output_plot = check_output_path("--output_plot", flags.FLAGS.output_plot)
  start = time.perf_counter()
  rows = decode_table.run(flags.FLAGS.config, progress=True)
  table = decode_table.markdown(rows)
  print(table)
  write_json(output_json, {"rows": rows, **bench.environment_info()})
  write_text(output_md, table)
  if output_plot:
    decode_table.plot_speedup_by_size(rows, output_plot)
  saved = (
    ", ".join(p for p in (output_json, output_md, output_plot) if p)
    or "pass --output_json for the JSON"
  )
  print(f"{len(rows)} rows in {time.perf_counter() - start:.0f} s ({saved})", file=sys.stderr)


def define_flags() -> None:
  """Defines this launcher's flags (called only when run as a script; see experiments.common)."""
  common.define_config_flag("Table configuration (configs/decode_table.py).", "decode_table.py")
  common.define_output_flags(markdown=True)
  flags.DEFINE_string("output_plot", None, "Also draw speedup against target size (PNG) here.")


if __name__ == "__main__":
  define_flags()
  common.run(main)
