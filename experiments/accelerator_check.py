"""Every program a user runs, compiled for an accelerator this host does not have.

  .aot-env/bin/python -m experiments.accelerator_check [--config.target=v5e:2x4] \
      [--config.shape=llama3-8b] [--config.sections=programs,layers,fit] \
      [--output_json=PATH] [--output_md=PATH]

Needs the `[aot]` extra (the CUDA plugin, ptxas and libtpu for the pinned jax),
best in an environment of its own (docs/accelerators.md: `.aot-env`);
JAX_PLATFORMS=cpu is set here when unset. Nothing runs on a device: each
program is compiled for the target and read (`specjax.jobs.accelerator_check`).
Prints a line per program as it compiles, then the markdown tables.
"""

from __future__ import annotations

import os

# Before jax is imported: the CUDA plugin refuses to start without a driver otherwise.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import flags

from experiments import common
from specjax import bench
from specjax.jobs import accelerator_check
from specjax.results import write_json, write_text
from specjax.validation import check_output_path


def main(argv):
  common.check_no_args(argv)
  f = flags.FLAGS
  output_json = check_output_path("--output_json", f.output_json)
  output_md = check_output_path("--output_md", f.output_md)
  result = accelerator_check.check(f.config)
  table = accelerator_check.markdown(result)
  print(table)
  # The host that compiled (its CPU, jax): the device fields are the target's.
  write_json(output_json, {**result, "host": bench.environment_info()})
  write_text(output_md, table)


def define_flags() -> None:
  """Defines this launcher's flags (called only when run as a script; see experiments.common)."""
  common.define_config_flag("Accelerator check configuration file.", "accelerator_check.py")
  common.define_output_flags(markdown=True)


if __name__ == "__main__":
  define_flags()
  common.run(main)
