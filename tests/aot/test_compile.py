"""Compiling for accelerators this host lacks, for real (`specjax.aot`): a tiny
model's plain decoding compiled for one H100 and for a TPU v5e-4 (tensor
parallel), read as experiments/accelerator_check.py reads them; the guides'
pod-slice and GPU-host commands; the launcher itself. Runs in the environment
that holds the `[aot]` extra (tests/test_aot_suite.py). The readers themselves:
tests/test_aot.py."""

import json
import os
import subprocess
import sys

import jax
import pytest

import specjax
from helpers import TINY, TINY_DRAFT
from specjax.aot import analysis, programs, targets

CONTEXT = 32


@pytest.fixture(scope="module", params=[("h100", None), ("v5e:2x2", (1, 4))], ids=["h100", "v5e"])
def compiled(request):
  """`(target, report)` of the tiny pair's plain program compiled for the target."""
  name, mesh_shape = request.param
  target = targets.get(name)
  mesh = target.mesh(mesh_shape)
  cfg = specjax.ModelConfig(**TINY, dtype="bfloat16", param_dtype="bfloat16")
  draft = cfg.replace(**TINY_DRAFT)
  models = programs.build_models(cfg, draft, mesh, kinds=())
  result = analysis.compile_for(
    lambda: programs.lower("plain", models, mesh, batch=4, context=CONTEXT), target
  )
  assert result["error"] is None
  report = analysis.read(result, target, cache_layer_bytes=4 * 2 * CONTEXT * 16 * 2)
  # Each layer's attention and MLP tail as one Triton kernel each on a GPU
  # (`specjax.kernels.append_attention`, `specjax.kernels.gated_down`).
  text = result["compiled"].as_text()
  report["append_kernels"] = text.count('"specjax_append_attention"')
  report["gated_kernels"] = text.count('"specjax_gated_down"')
  # The devices are abstract: nothing was allocated, everything came from the compiler.
  sharding = jax.tree.leaves(result["compiled"].input_shardings)[0]
  assert sharding.mesh.devices.flat[0].platform in ("gpu", "tpu")
  analysis.free(result)
  return target, report


def test_the_compiled_program_is_read_for_kernels_memory_and_copies(compiled):
  target, report = compiled
  assert report["compiled"] and report["kernels_per_trip"] > 10
  memory = report["memory"]
  assert memory["argument_bytes"] > 0 and memory["temp_bytes"] > 0
  assert memory["device_bytes"] == target.chip.memory_bytes and memory["fits"]
  assert report["cache_copies"] == 0  # the loop writes its cache in place
  # One GPU: every layer's decode attention and MLP tail are the one-kernel paths
  # (the tiny prompt's attention too), the cache written in place (no copy
  # above); the TPU mesh keeps XLA's operations.
  if target.platform == "gpu":
    assert report["append_kernels"] >= TINY["n_layers"]
    assert report["gated_kernels"] >= TINY["n_layers"]
  else:
    assert report["append_kernels"] == report["gated_kernels"] == 0


def test_the_gpu_loop_body_is_found_in_command_buffers_in_the_thunk_sequence(compiled):
  target, report = compiled
  if target.platform != "gpu":
    assert "thunks" not in report and report["collectives"]  # tensor parallel: all-reduces
    return
  thunks = report["thunks"]
  loop = thunks["generation_loop"]
  assert thunks["command_buffers"] >= 1 and thunks["kernels_in_command_buffers"] > 0
  assert loop["kernels"] > 0
  assert loop["on_device"] == (loop["host_launches_per_trip"] == 0)


def test_the_serving_step_runs_its_draft_loop_on_an_h100_not_the_host():
  """The engine's step program gets specjax's command-buffer options (`slots.step`
  is a `compiler_options.jit`): its draft loop and conditionals are recorded, so
  the host launches the step once (a plain `jax.jit` left 27 launches a trip)."""
  target = targets.get("h100")
  mesh = target.mesh()
  cfg = specjax.ModelConfig(**TINY, dtype="bfloat16", param_dtype="bfloat16")
  models = programs.build_models(cfg, cfg.replace(**TINY_DRAFT), mesh, kinds=())
  result = analysis.compile_for(
    lambda: programs.lower("engine_step", models, mesh, batch=2, context=CONTEXT), target
  )
  assert result["error"] is None
  report = analysis.read(result, target)
  analysis.free(result)
  thunks = report["thunks"]
  assert thunks["host_loops"] == 0 and thunks["device_loops"] >= 1
  assert thunks["generation_loop"]["host_launches_per_trip"] == 0


def test_compiling_needs_the_cpu_platform_and_names_its_install():
  assert jax.default_backend() == "cpu"
  targets.check_host()
  with pytest.raises(ValueError, match="v5e:2x4"):
    targets.get("tpu-v5e")


# The guides' commands for hardware this host lacks (docs/scale_out.md, docs/serving.md:
# their blocks are skipped there), checked by compiling the program each runs for
# that hardware, at the tiny size: (guide, target, mesh, program).
GUIDE_COMMANDS = [
  ("docs/serving.md, docs/scale_out.md: serve on a v5e-16 slice", "v5e:4x4", (2, 8), "engine_step"),
  ("docs/scale_out.md: train the target on a v5e-32 pod slice", "v5e:4x8", (32, 1), "train_target"),
  (
    "docs/serving.md, docs/scale_out.md: serve on 2 hosts x 8 GPUs",
    "h100x16",
    (2, 8),
    "engine_step",
  ),
  ("docs/scale_out.md: train the target on GPU hosts (SLURM)", "h100x16", (16, 1), "train_target"),
]


@pytest.mark.sample(1)
@pytest.mark.parametrize("guide, name, mesh_shape, program", GUIDE_COMMANDS, ids=lambda x: str(x))
def test_the_guides_commands_for_pods_and_gpu_hosts_compile(guide, name, mesh_shape, program):
  target = targets.get(name)
  mesh = target.mesh(mesh_shape)
  cfg = specjax.ModelConfig(**TINY, dtype="bfloat16", param_dtype="bfloat16")
  models = programs.build_models(cfg, cfg.replace(**TINY_DRAFT), mesh, kinds=())
  batch = mesh_shape[0] * 2
  result = analysis.compile_for(lambda: programs.lower(program, models, mesh, batch, 64), target)
  assert result["error"] is None, guide
  report = analysis.read(result, target)
  analysis.free(result)
  assert report["memory"]["fits"] and report["collectives"], guide


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.sample(1)
@pytest.mark.parametrize(
  "flags, programs",
  [
    (("--config.programs=plain,eagle", "--config.sections=programs,measured"), ["plain", "eagle"]),
    ((), None),  # every default: every program on one H100 (minutes)
  ],
  ids=["two_programs", "defaults"],
)
def test_the_launcher_compiles_the_bundled_pair_for_an_h100(tmp_path, flags, programs):
  out = tmp_path / "accelerator.json"
  command = [sys.executable, "-m", "experiments.accelerator_check", *flags, f"--output_json={out}"]
  process = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1200)
  assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-3000:]
  result = json.loads(out.read_text())
  assert result["device_kind"] == "NVIDIA H100 80GB HBM3" and result["shape"] == "bundled"
  assert result["host"]["backend"] == "cpu"
  rows = result["programs"]
  assert [r["program"] for r in rows] == (programs or list(programs.PROGRAMS))
  for row in rows:
    assert row["compiled"], (row["program"], row["error"])
    assert row["kernels_per_trip"] > 0 and row["memory"]["fits"] and "thunks" in row
    assert row["estimate"]["step_ms"] > 0
  if programs is None:
    assert result["layers"][0]["ar_kernels_per_layer"] > 0
  assert result["measured"] == []  # no gpu_check of an H100 is kept
  assert "| plain | yes |" in process.stdout
