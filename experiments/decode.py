"""Decode text with speculative and autoregressive decoding, side by side.

  python -m experiments.decode                      # the bundled pair, a test-split prompt
  python -m experiments.decode --config.target=/path/to/hf_dir \
      --config.draft=/path/to/hf_dir2 --config.prompt="..." [--output_json=PATH]

Prints the prompt, both continuations and, for the same key: ms/token, speedup,
acceptance rate, tokens per iteration. Times are medians of `num_runs` runs
after a warm-up. The job itself: `specjax.jobs.decode`.
"""

from __future__ import annotations

from absl import flags, logging

from experiments import common
from specjax.distributed import launch
from specjax.jobs import decode


def main(argv):
  common.check_no_args(argv)
  logging.set_verbosity(logging.WARNING)  # keep backend probing out of the output
  launch.maybe_initialize()  # --distributed: join the multi-host job first
  decode.decode_and_report(flags.FLAGS.config, flags.FLAGS.output_json)


def define_flags() -> None:
  """Defines this launcher's flags (called only when run as a script; see experiments.common)."""
  common.define_config_flag("Decode configuration (configs/decode.py).", "decode.py")
  common.define_output_flags()
  launch.define_flags()


if __name__ == "__main__":
  define_flags()
  common.run(main)
