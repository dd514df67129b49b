"""Benchmark: autoregressive vs speculative decoding, measured and predicted.

  python -m experiments.benchmark --config=configs/benchmark.py[:tiny|:medium|:self] \
      [--config.max_new_tokens=16 ...] [--output_json=PATH]

Builds the target and draft from the config, random prompts from the seed, and
hands them to `specjax.bench.benchmark_generation` (`specjax.jobs.benchmark.run`).
Prints a line per measurement on stderr as it runs, then a markdown table of
the headline figures on stdout; the full result (about 50 fields: costs, floors, compile
times, every run) goes to --output_json.
"""

from __future__ import annotations

import sys
import time

from absl import flags

from experiments import common
from specjax.jobs import benchmark
from specjax.results import write_json
from specjax.validation import check_output_path


def main(argv):
  common.check_no_args(argv)
  output_json = check_output_path("--output_json", flags.FLAGS.output_json)
  start = time.perf_counter()
  result = benchmark.run(flags.FLAGS.config, progress=True)
  print(benchmark.markdown(result))
  write_json(output_json, result)
  saved = output_json or "pass --output_json=PATH for the full result"
  print(f"done in {time.perf_counter() - start:.0f} s ({saved})", file=sys.stderr)


def define_flags() -> None:
  """Defines this launcher's flags (called only when run as a script; see experiments.common)."""
  common.define_config_flag("Benchmark configuration file (configs/benchmark.py[:preset]).")
  common.define_output_flags()


if __name__ == "__main__":
  define_flags()
  common.run(main)
