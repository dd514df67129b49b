"""The serving engine's decode steps on device meshes: collectives per step and bytes moved.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \
      python -m experiments.mesh_collectives --meshes=8x1,2x4,1x8 --output_md=/tmp/collectives.md

Each step program of an engine on the bundled pair (plain and drafting, all
slots) is compiled for each mesh, never run, and its HLO read
(`specjax.jobs.mesh_collectives`): on simulated CPU devices as above, or on
the accelerators of the host. Prints the markdown table; --output_json has
every collective with its shape and group.
"""

from __future__ import annotations

from absl import flags, logging

from experiments import common
from specjax import bench
from specjax.jobs import mesh_collectives
from specjax.results import write_json, write_text
from specjax.validation import check_output_path


def main(argv):
  common.check_no_args(argv)
  logging.set_verbosity(logging.WARNING)
  f = flags.FLAGS
  output_json = check_output_path("--output_json", f.output_json)
  output_md = check_output_path("--output_md", f.output_md)
  meshes = mesh_collectives.parse_meshes(f.meshes)
  rows = mesh_collectives.measure(
    meshes,
    model=f.model,
    slots=f.slots,
    gamma=f.gamma,
    scale=f.scale,
    layers=f.layers,
    vocab_placements=tuple(v.strip() for v in f.vocab.split(",")),
  )
  table = mesh_collectives.markdown(rows)
  print(table)
  models = f"{f.scale} pair's shapes, target cut to {f.layers} layers" if f.scale else f.model
  print(f"({mesh_collectives.devices_note()}; {models}, {f.slots} slots, bfloat16)")
  write_json(output_json, {"rows": rows, **bench.environment_info()})
  write_text(output_md, table)


def define_flags() -> None:
  """Defines this launcher's flags (called only when run as a script; see experiments.common)."""
  flags.DEFINE_string("meshes", "8x1,2x4,1x8", "Meshes DATAxMODEL, comma-separated.")
  flags.DEFINE_string("model", "bundled", "bundled (the pair) or tiny (random tiny models).")
  flags.DEFINE_string(
    "scale", "", "A scaled pair's shapes (160m, 1b, 7b) with random weights, in place of --model."
  )
  flags.DEFINE_integer(
    "layers", 2, "With --scale: the target's layers kept (each exchanges alike)."
  )
  flags.DEFINE_string(
    "vocab", "replicate,shard", "EngineConfig.vocab_placement(s) to compare, comma-separated."
  )
  flags.DEFINE_integer("slots", 8, "The engine's slots (a multiple of every mesh's data axis).")
  flags.DEFINE_integer("gamma", 4, "The drafting step's draft length.")
  flags.DEFINE_string("output_json", None, "Where to write the rows (JSON).")
  flags.DEFINE_string("output_md", None, "Where to write the markdown table.")


if __name__ == "__main__":
  define_flags()
  common.run(main)
