"""Compiling for accelerators this host lacks (`specjax.aot`), the parts that need no
compiler: thunk sequences read, target names, the fit search, the estimate, and
where a program's platform comes from. The compiles themselves (an H100 and a
TPU v5e-4, in the environment that holds the `[aot]` extra): tests/aot/test_compile.py."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import compiler_options
from specjax.aot import estimate, fit, targets
from specjax.bench import thunks

# What XLA:GPU dumps for a loop recorded in a command buffer (trimmed from a real
# dump: `--xla_dump_to`, an H100 target, 2026-12-07): the host launches one graph.
DEVICE_LOOP = """\
000: kCommandBuffer [source | sink] 
    001: kCopy  [source       | next=003 (2)] kCopy
    002: kCopy  [source       | next=003 (1)] kCopy
    003: kWhile [prev=002 (1) | sink        ]       
condition:
        004: kCustomKernel [source       | next=005 (1)] input_reduce_fusion grid: [1, 1, 1] threads: [256, 1, 1]  shared_memory: 0 bytes
        005: kCustomKernel [prev=004 (1) | sink        ] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
      body:
        006: kCustomKernel [source       | sink        ] loop_add_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
        007: kCustomKernel [source       | next=008 (1)] gemm_fusion_dot_general_1 grid: [32, 1, 1] threads: [64, 1, 1]  shared_memory: 1024 bytes
        008: kCopy         [prev=007 (1) | sink        ] kCopy
"""  # noqa: W291, E501

# A loop the host drives: its body split by a dynamic-slice fusion (offsets read on
# the host) around a command buffer, and a nested host loop (scanned layers).
HOST_LOOP = """\
000: kCommandBuffer [source       | next=003 (1)] 
    001: kCopy         [source       | next=002 (1)] kCopy
    002: kCustomKernel [prev=001 (1) | sink        ] loop_select_fusion_3 grid: [256, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
003: kWhile         [prev=000 (1) | sink        ]   
condition:
    004: kCustomKernel [source | sink] wrapped_not grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
  body:
    005: kCustomKernel  [source       | next=006 (1)] loop_select_fusion_1 grid: [16, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
    006: kWhile         [prev=005 (1) | next=000 (1)]       
condition:
        007: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
      body:
        008: kDynamicSliceFusion [source | next=000 (1)] params=1, results=1
            009: kCopy [source | sink] kCopy
        000: kCommandBuffer      [prev=008 (1) | sink] 
            010: kCustomKernel [source       | next=011 (1)] gemm_fusion_dot_40 grid: [32, 1, 1] threads: [64, 1, 1]  shared_memory: 768 bytes
            011: kCustomKernel [prev=010 (1) | sink        ] fusion_89 grid: [32, 1, 1] threads: [32, 1, 1]  shared_memory: 0 bytes
    000: kCommandBuffer [prev=006 (1) | sink        ] 
        012: kCustomKernel [source       | sink        ] loop_add_fusion_5 grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
"""  # noqa: W291, E501


def test_a_loop_recorded_in_a_command_buffer_costs_the_host_nothing_per_trip():
  s = thunks.summary(DEVICE_LOOP)
  assert (s["kernels"], s["memcpys"], s["command_buffers"]) == (4, 3, 1)
  assert s["kernels_in_command_buffers"] == 4 and s["one_block_kernels"] == 3
  assert (s["host_loops"], s["device_loops"], s["dynamic_slice_fusions"]) == (0, 1, 0)
  assert s["generation_loop"] == {"on_device": True, "kernels": 2, "host_launches_per_trip": 0}


def test_a_host_loop_is_read_with_its_nested_loop_and_split_body():
  top = thunks.parse(HOST_LOOP)
  assert [t.kind for t in top] == ["kCommandBuffer", "kWhile"]
  loop = top[1]
  assert [t.kind for t in loop.condition] == ["kCustomKernel"]
  assert [t.kind for t in loop.body] == ["kCustomKernel", "kWhile", "kCommandBuffer"]
  inner = loop.body[1]
  assert [t.kind for t in inner.body] == ["kDynamicSliceFusion", "kCommandBuffer"]
  assert [t.kind for t in inner.body[0].children] == ["kCopy"]
  s = thunks.summary(HOST_LOOP)
  assert (s["host_loops"], s["device_loops"], s["dynamic_slice_fusions"]) == (2, 0, 1)
  assert s["kernels"] == 7 and s["command_buffers"] == 3
  # Outer loop per trip: its condition (1), the select (1), the nested loop's
  # condition (1) + fusion's offsets (1) + its copy (1) + graph (1) + predicate
  # copy (1), the last graph (1), then the outer predicate's copy (1).
  assert s["generation_loop"] == {"on_device": False, "kernels": 5, "host_launches_per_trip": 9}


def test_read_dump_prefers_the_sequence_after_thunk_passes(tmp_path):
  assert thunks.read_dump(str(tmp_path)) is None
  (tmp_path / "module_0001.jit_f.thunk_sequence.txt").write_text("before")
  assert thunks.read_dump(str(tmp_path)) == "before"
  (tmp_path / "module_0001.jit_f.thunk_sequence_after_thunk_passes.txt").write_text("after")
  assert thunks.read_dump(str(tmp_path)) == "after"
  assert thunks.dump_options(str(tmp_path)) == {"xla_dump_to": str(tmp_path)}


@pytest.mark.parametrize(
  "name, chip, topology, slices, chips",
  [
    ("h100", "h100", "1x1x1", 1, 1),
    ("h100x8", "h100", "1x1x8", 1, 8),
    ("h200x16", "h200", "1x2x8", 1, 16),
    ("a100", "a100", "1x1x1", 1, 1),
    ("v5e:2x4", "v5e", "2x4", 1, 8),
    ("v5p:2x2x1", "v5p", "2x2x1", 1, 4),
    ("v6e:16x16@2", "v6e", "16x16", 2, 512),
  ],
)
def test_target_names(name, chip, topology, slices, chips):
  target = targets.get(name)
  assert target.chip is targets.CHIPS[chip]
  assert (target.topology, target.slices, target.num_chips) == (topology, slices, chips)
  assert target.platform == ("gpu" if chip.startswith(("h", "a")) else "tpu")


@pytest.mark.parametrize(
  "name", ["h300", "h100x12", "h100x0", "v5e", "v5e:2x", "v7:2x2", "v5e:2x4@0", ""]
)
def test_unknown_targets_name_the_forms_allowed(name):
  with pytest.raises(ValueError, match="target"):
    targets.get(name)


def test_gpu_target_configs_say_where_they_come_from_and_name_a_driver():
  for name in targets.GPUS:
    chip = targets.CHIPS[name]
    text = targets.gpu_target_config(chip)
    assert text.startswith("#") and "Source:" in text
    # Without it XLA takes the driver for 0.0.0 and drops loop command buffers.
    assert 'driver_version: "12.8.0"' in text
    assert f'"{chip.kind}"' in text


def test_largest_batch_finds_the_boundary_by_compiling_few_times(monkeypatch):
  capacity = targets.CHIPS["h100"].memory_bytes
  seen = []

  def fake_bytes(lower, target, batch):
    seen.append(batch)
    # Affine in the batch, plus a step past 300 rows the two probes cannot see.
    return int(10e9 + batch * 0.2e9 + (5e9 if batch > 300 else 0))

  expected = max(b for b in range(1, 4097) if fake_bytes(None, None, b) <= capacity)
  seen.clear()
  monkeypatch.setattr(fit, "_bytes", fake_bytes)
  found = fit.largest_batch(lambda b: None, targets.get("h100"), step=1, limit=4096)
  # The probes predict 350; it does not fit, and the bisection settles below.
  assert found["batch"] == expected == 325
  assert found["compiles"] == len(seen) <= 12
  assert found["bytes"] <= capacity


def test_largest_batch_keeps_to_the_data_axis_and_reports_nothing_fits(monkeypatch):
  monkeypatch.setattr(fit, "_bytes", lambda lower, target, b: int(1e9 * b))
  found = fit.largest_batch(lambda b: None, targets.get("v5e:2x2"), step=4, limit=64)
  assert found["batch"] == 16 and found["batch"] % 4 == 0  # 16 GB chips
  monkeypatch.setattr(fit, "_bytes", lambda lower, target, b: None)  # no compile at all
  assert fit.largest_batch(lambda b: None, targets.get("h100"))["batch"] == 0


def test_the_estimate_adds_its_three_terms():
  h100 = targets.get("h100")
  report = {
    "kernels_per_trip": 100,
    "thunks": {"generation_loop": {"on_device": False}},
    "collectives": {"all-reduce": {"count": 2, "bytes": 10, "link_bytes": 450e6}},
  }
  out = estimate.step_ms(report, h100, read_bytes=int(3.35e9))
  assert out["launch_ms"] == pytest.approx(100 * h100.chip.launch_us / 1e3)
  assert out["memory_ms"] == pytest.approx(1.0)
  assert out["link_ms"] == pytest.approx(1.0)
  assert out["step_ms"] == pytest.approx(out["launch_ms"] + 2.0)
  report["thunks"]["generation_loop"]["on_device"] = True
  on_device = estimate.step_ms(report, h100, read_bytes=0)
  assert on_device["launch_ms"] == pytest.approx(100 * h100.chip.graph_launch_us / 1e3)
  assert "estimate" in on_device["estimate"]


def test_a_program_takes_the_platform_its_arguments_are_placed_on():
  x = jnp.arange(3.0)
  assert compiler_options.placed_platform((x,)) == "cpu"
  assert compiler_options.placed_platform(({"a": 1},)) is None
  assert compiler_options.current_platform() == jax.default_backend()
  with compiler_options.target_platform("cuda"):
    assert compiler_options.current_platform() == "gpu"
    assert compiler_options.compiler_options() == compiler_options.command_buffer_options(True)
    with compiler_options.target_platform("tpu"):
      assert compiler_options.compiler_options() == {}
  assert compiler_options.current_platform() == jax.default_backend()
  seen = []
  program = compiler_options.jit(lambda x: seen.append(compiler_options.current_platform()) or x)
  with compiler_options.target_platform("tpu"):
    program.lower(x)  # placed on the CPU: the arguments win over the context
  np.testing.assert_array_equal(program(x), x)
  assert seen[0] == "cpu"


def test_the_full_depth_batch_is_predicted_from_one_and_two_layers_then_checked(monkeypatch):
  capacity = targets.CHIPS["v5e"].memory_bytes
  layers = 80

  def memory(batch, depth):  # weights per layer, cache per row and layer, fixed parts
    return int(1e9 + 0.1e9 * depth + 0.02e9 * batch + 0.004e9 * batch * depth)

  full = [b for b in range(4, 1025, 4) if memory(b, layers) <= capacity]
  calls = []

  def fake_bytes(lower, target, batch):
    calls.append(batch)
    return lower(batch)

  monkeypatch.setattr(fit, "_bytes", fake_bytes)
  v5e = targets.get("v5e:2x2")
  guess = fit.predicted_batch(lambda b, depth: memory(b, depth), v5e, layers, step=4)
  assert guess == full[-1] and len(calls) == 4
  calls.clear()
  found = fit.largest_batch(lambda b: memory(b, layers), v5e, step=4, guess=guess)
  assert found["batch"] == full[-1] and found["compiles"] == len(calls) == 2
  # A guess too large is searched down; one that does not fit at all gives 0.
  found = fit.largest_batch(lambda b: memory(b, layers), v5e, step=4, guess=4 * full[-1])
  assert found["batch"] == full[-1]
  found = fit.largest_batch(lambda b: capacity + 1, v5e, step=4, guess=8)
  assert found["batch"] == 0


def test_probes_at_many_rows_and_below_them(monkeypatch):
  v5e = targets.get("v5e:2x2")
  # Rows cost more at first (a compiler reuses buffers as the batch grows).
  memory = lambda b: int(1e9 + 1e9 * min(b, 4) + 0.1e9 * max(b - 4, 0))
  monkeypatch.setattr(fit, "_bytes", lambda lower, target, b: memory(b))
  expected = max(b for b in range(1, 4097) if memory(b) <= v5e.chip.memory_bytes)
  found = fit.largest_batch(None, v5e, probe=8)
  assert found["batch"] == expected == 114 and found["compiles"] <= 4
  monkeypatch.setattr(fit, "_bytes", lambda lower, target, b: int(4e9 * b))
  assert fit.largest_batch(None, v5e, probe=8)["batch"] == 4  # under the first probe


def test_shapes_from_presets_families_and_a_config_json(tmp_path):
  from specjax.aot import shapes

  target, draft, _ = shapes.shape_configs("llama3-70b")
  assert (target.d_model, target.n_layers, target.n_kv_heads, target.vocab_size) == (
    8192,
    80,
    8,
    128256,
  )
  assert draft.vocab_size == target.vocab_size and draft.n_layers == 16
  target, _, _ = shapes.shape_configs("qwen2.5-7b")
  assert target.qkv_bias and target.n_kv_heads == 4
  assert shapes.shape_configs("1b")[0].n_layers == 22
  # A checkpoint directory: its config.json only (no weights here at all).
  family = dict(shapes.FAMILIES["qwen2.5-7b"][0], num_hidden_layers=3)
  (tmp_path / "config.json").write_text(json.dumps(family))
  target, draft, note = shapes.shape_configs(str(tmp_path))
  assert target.n_layers == 3 and draft.d_model == 768 and "config.json" in note
  with pytest.raises(ValueError, match="llama3-8b"):
    shapes.shape_configs("llama-8b")
  with pytest.raises(FileNotFoundError):
    shapes.shape_configs(str(tmp_path / "missing"))
