"""Bytes each device holds for parameters and KV caches, from the shardings alone.

  python -m experiments.memory_table [--batch=8] [--output_json=PATH]

For the bundled target, a 1.1B Llama shape (TinyLlama) and a 70B Llama shape,
on meshes 1, 2x4 and 1x8 (data x model), computed from abstract shapes without
allocating (`specjax.jobs.memory_table.table`). Prints the rows as JSON, then as
a markdown table; --output_json also writes the JSON.
"""

from __future__ import annotations

import json

from absl import flags

from experiments import common
from specjax.jobs import memory_table
from specjax.results import write_json
from specjax.validation import check_output_path, check_positive_int


def main(argv):
  common.check_no_args(argv)
  output_json = check_output_path("--output_json", flags.FLAGS.output_json)
  rows = memory_table.table(check_positive_int("--batch", flags.FLAGS.batch))
  print(json.dumps(rows, indent=2))
  print(memory_table.markdown(rows))
  write_json(output_json, rows)


def define_flags() -> None:
  """Defines this launcher's flags (called only when run as a script; see experiments.common)."""
  flags.DEFINE_integer("batch", 8, "Rows of the KV cache.")
  common.define_output_flags()


if __name__ == "__main__":
  define_flags()
  common.run(main)
