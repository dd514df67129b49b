"""Benchmark: the CPU matmul kernel against XLA's dot, and the machine's read bandwidth.

  python -m experiments.kernel_benchmark [--config.variants=avx2,avx512_bf16] \
      [--config.rows=1,5] [--output_json=PATH]

Prints the result as JSON (`specjax.bench.kernel.kernel_table`: the CPU and its
vector extensions, the read bandwidth with 2 threads and all cores, then per
dtype and row count the chain's ms and GB/s through XLA and each variant, and
the goals), then a markdown table.
"""

from __future__ import annotations

import json

from absl import flags

from experiments import common
from specjax.bench import kernel
from specjax.results import markdown_table, write_json
from specjax.validation import check_output_path


def _names(value: str, field: str) -> tuple[str, ...]:
  names = tuple(part.strip() for part in str(value).split(",") if part.strip())
  if not names:
    raise ValueError(f"config.{field} must name at least one entry, got {value!r}.")
  return names


def _rows(value: str) -> tuple[int, ...]:
  try:
    return tuple(int(part) for part in _names(value, "rows"))
  except ValueError:
    raise ValueError(f"config.rows must be comma-separated integers >= 1, got {value!r}.") from None


def main(argv):
  common.check_no_args(argv)
  output_json = check_output_path("--output_json", flags.FLAGS.output_json)
  config = flags.FLAGS.config
  result = kernel.kernel_table(
    rows=_rows(config.rows),
    dtypes=_names(config.dtypes, "dtypes"),
    variants=_names(config.variants, "variants"),
    num_layers=config.num_layers,
    num_runs=config.num_runs,
    read_megabytes=config.read_megabytes,
  )
  print(json.dumps(result, indent=2))
  columns = [
    ("dtype", "{dtype}"),
    ("rows", "{rows}"),
    ("XLA ms", "{xla_ms}"),
    ("XLA GB/s", "{xla_gbs}"),
  ]
  for name in result["goals"]:
    columns += [(f"{name} ms", f"{{{name}_ms}}"), (f"{name} GB/s", f"{{{name}_gbs}}")]
  print(markdown_table(result["cases"], columns))
  write_json(output_json, result)


def define_flags() -> None:
  """Defines this launcher's flags (called only when run as a script; see experiments.common)."""
  common.define_config_flag("Kernel benchmark configuration file.", "kernel_benchmark.py")
  common.define_output_flags()


if __name__ == "__main__":
  define_flags()
  common.run(main)
