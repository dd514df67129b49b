"""Configuration of `experiments/accelerator_check.py`: specjax's programs compiled for
an accelerator this host does not have (docs/accelerators.md).

  python -m experiments.accelerator_check                                  # bundled pair, H100
  python -m experiments.accelerator_check --config.target=v5e:2x4 --config.shape=llama3-8b
  python -m experiments.accelerator_check --config.shape=1b --config.sections=layers

target: h100, h200, a100 (xN for N GPUs on one host: h100x8) or a TPU topology
(v5e:2x4, v6e:2x2, v5p:2x2x1, v4:2x2x1; @N for N slices). shape: "bundled" (the
bundled pair), a scaled preset (160m, 1b, 7b), a written-in family shape
(llama3-8b, llama3-70b, qwen2.5-7b, qwen2.5-72b), or a checkpoint directory /
cached hub id (its config.json only). mesh: DATAxMODEL ("": every device on
model). programs / fit_programs: names of `specjax.aot.programs.PROGRAMS`.
"""

from __future__ import annotations

import ml_collections

from specjax.aot.programs import PROGRAMS


def get_config() -> ml_collections.ConfigDict:
  """The accelerator check's configuration (defaults: the bundled pair on one H100)."""
  config = ml_collections.ConfigDict()
  config.target = "h100"
  config.shape = "bundled"
  config.dtype = "bfloat16"
  config.mesh = ""
  config.layout = ""  # "scanned" / "unrolled"; "": the target platform's default
  config.batch = 1
  config.context = 256
  config.gamma = 4
  config.temperature = 0.0  # the decode programs' sampling: 0 is greedy
  config.sections = ("programs", "layers", "measured")
  config.programs = tuple(PROGRAMS)
  config.fit_programs = ("eagle3", "draft_model", "engine_step")
  config.fit_contexts = (8192, 32768)
  config.fit_limit = 4096
  return config
