"""The accelerator's step, checked where no accelerator is: the compiler options
(command buffers on GPU only), the launch counts read from compiled HLO and the
profiler summary (docs/performance.md, "On the accelerator"; the floor's
readers and nominal bandwidths: tests/test_roofline.py)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import compiler_options
from specjax.bench import compile as compile_bench
from specjax.bench import hlo
from specjax.bench import trace as trace_bench


def test_command_buffer_options_record_loops_on_gpu_only():
  on = compiler_options.command_buffer_options(True)
  types = on["xla_gpu_enable_command_buffer"].split(",")
  assert {"WHILE", "CONDITIONAL", "FUSION", "CUBLAS", "CUSTOM_CALL"} <= set(types)
  assert on["xla_enable_command_buffers_during_profiling"] is True
  assert compiler_options.command_buffer_options(False) == {"xla_gpu_enable_command_buffer": ""}
  assert compiler_options.compiler_options("cpu") == {}
  assert compiler_options.compiler_options("tpu") == {}
  assert compiler_options.compiler_options("gpu") == on
  with compiler_options.command_buffers(False):
    assert compiler_options.compiler_options("cuda") == {"xla_gpu_enable_command_buffer": ""}
    with compiler_options.command_buffers(True):
      assert compiler_options.compiler_options("gpu") == on
    assert not compiler_options.command_buffers_enabled()
  assert compiler_options.command_buffers_enabled()


def test_command_buffer_switch_from_the_environment(monkeypatch):
  monkeypatch.setenv(compiler_options.ENV, "0")
  assert compiler_options.compiler_options("gpu") == {"xla_gpu_enable_command_buffer": ""}
  with compiler_options.command_buffers(True):  # the context wins
    assert compiler_options.command_buffers_enabled()
  monkeypatch.setenv(compiler_options.ENV, "yes")
  with pytest.raises(ValueError, match="SPECJAX_COMMAND_BUFFERS"):
    compiler_options.command_buffers_enabled()


@pytest.mark.parametrize("enabled", [True, False])
def test_xla_accepts_the_command_buffer_options(enabled):
  """XLA parses every command type by name (a misspelt one is an error even on
  CPU, where the options change nothing)."""
  x = jnp.arange(4.0)
  lowered = jax.jit(lambda x: jnp.sin(x) + 1).lower(x)
  compiled = lowered.compile(compiler_options.command_buffer_options(enabled))
  np.testing.assert_allclose(compiled(x), jnp.sin(x) + 1)
  with pytest.raises(Exception, match="not a valid enum value"):
    lowered.compile({"xla_gpu_enable_command_buffer": "FUSION,WHILST"})


def test_programs_take_the_options_of_their_platform(monkeypatch):
  from specjax.generation.autoregressive import _autoregressive_program
  from specjax.generation.speculative import _speculative_program

  assert isinstance(_autoregressive_program, compiler_options.Program)
  assert isinstance(_speculative_program, compiler_options.Program)

  program = compiler_options.jit(lambda x, n: x * n, static_argnames=("n",))
  x = jnp.arange(3.0)
  np.testing.assert_array_equal(program(x, n=2), x * 2)  # CPU: plain jax.jit
  assert list(program._jitted) == [()]
  # As on a GPU (the options compile on CPU too): a second program, with them.
  monkeypatch.setattr(compiler_options.jax, "default_backend", lambda: "gpu")
  np.testing.assert_array_equal(program(x, n=3), x * 3)
  monkeypatch.undo()
  # Lowered for a GPU target (unplaced arguments: the context's platform), off.
  with compiler_options.target_platform("gpu"), compiler_options.command_buffers(False):
    program.lower(jax.ShapeDtypeStruct(x.shape, x.dtype), n=3).compile()
  # Arguments placed on the CPU compile for it, whatever the context says.
  with compiler_options.target_platform("gpu"):
    assert program.lower(x, n=3).compile().as_text() is not None
  on = tuple(sorted(compiler_options.command_buffer_options(True).items()))
  off = tuple(sorted(compiler_options.command_buffer_options(False).items()))
  assert set(program._jitted) == {(), on, off}
  assert compiler_options.current_platform() == "cpu"


# XLA:GPU's shape of a program whose decode loop is recorded in a command buffer:
# the entry calls `command_buffer`, which holds the loop; the body holds a nested
# loop of known trip count (scanned layers) and a conditional.
GPU_LIKE_HLO = """\
HloModule jit_program

%fused_add (p0: f32[8]) -> f32[8] {
  %p0 = f32[8]{0} parameter(0)
  ROOT %add = f32[8]{0} add(f32[8]{0} %p0, f32[8]{0} %p0)
}

%layer_body (t: (s32[], f32[8])) -> (s32[], f32[8]) {
  %t = TUP parameter(0)
  %x = f32[8]{0} get-tuple-element(TUP %t), index=1
  %f1 = f32[8]{0} fusion(f32[8]{0} %x), kind=kLoop, calls=%fused_add
  %f2 = f32[8]{0} fusion(f32[8]{0} %f1), kind=kLoop, calls=%fused_add
  %i = s32[] get-tuple-element(TUP %t), index=0
  ROOT %r = TUP tuple(s32[] %i, f32[8]{0} %f2)
}

%layer_cond (t: (s32[], f32[8])) -> pred[] {
  %t = TUP parameter(0)
  ROOT %c = pred[] fusion(TUP %t), kind=kLoop, calls=%fused_add
}

%branch_a (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  ROOT %a = f32[8]{0} fusion(f32[8]{0} %x), kind=kLoop, calls=%fused_add
}

%branch_b (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %b1 = f32[8]{0} fusion(f32[8]{0} %x), kind=kLoop, calls=%fused_add
  ROOT %b2 = f32[8]{0} fusion(f32[8]{0} %b1), kind=kLoop, calls=%fused_add
}

%decode_body (s: (s32[], f32[8])) -> (s32[], f32[8]) {
  %s = TUP parameter(0)
  %w = TUP while(TUP %s), condition=%layer_cond, body=%layer_body, backend_config=TRIPS
  %y = f32[8]{0} get-tuple-element(TUP %w), index=1
  %p = pred[] constant(true)
  %k = f32[8]{0} conditional(pred[] %p, %y, %y), true_computation=%branch_a, false_computation=%b
  %j = s32[] get-tuple-element(TUP %w), index=0
  ROOT %o = TUP tuple(s32[] %j, f32[8]{0} %k)
}

%decode_cond (s: (s32[], f32[8])) -> pred[] {
  %s = TUP parameter(0)
  ROOT %c = pred[] fusion(TUP %s), kind=kLoop, calls=%fused_add
}

%command_buffer (s: (s32[], f32[8])) -> (s32[], f32[8]) {
  %s = TUP parameter(0)
  ROOT %loop = TUP while(TUP %s), condition=%decode_cond, body=%decode_body
}

ENTRY %main (a: (s32[], f32[8])) -> (s32[], f32[8]) {
  %a = TUP parameter(0)
  %pre = TUP fusion(TUP %a), kind=kLoop, calls=%fused_add
  ROOT %cb = TUP call(TUP %pre), to_apply=%command_buffer
}
""".replace("TUP ", "(s32[], f32[8]{0}) ").replace("=%b\n", "=%branch_b\n")
GPU_LIKE_HLO = GPU_LIKE_HLO.replace("TRIPS", '{"known_trip_count":{"n":"3"}}')


def test_launches_count_nested_loops_and_command_buffers():
  # One trip of the decode body: the layer loop's 3 trips of 2 kernels, its
  # condition 4 times, the conditional and its costlier branch (2).
  one_trip = {"kernels": 3 * 2 + 4 + 1 + 2, "unknown_trips": 0}
  assert hlo.launches(GPU_LIKE_HLO, "decode_body") == one_trip
  # The entry: its fusion, then the recorded loop once (its trip count unknown).
  whole = hlo.launches(GPU_LIKE_HLO)
  assert whole == {"kernels": 1 + 13 + 2 * 1, "unknown_trips": 1}
  assert hlo.launches(GPU_LIKE_HLO, graphs_as_one=True)["kernels"] == 2
  buffers = hlo.command_buffers(GPU_LIKE_HLO, "decode_body")
  assert buffers["command_buffers"] == 1 and buffers["loop_in_command_buffer"] is True
  assert buffers["body_launches"] == 0 and buffers["command_buffer_ops"] == {"while": 1}
  # Without the command buffer (the entry holds the loop), every kernel is a launch.
  plain = GPU_LIKE_HLO.replace("to_apply=%command_buffer", "to_apply=%loop_holder").replace(
    "%command_buffer (", "%loop_holder ("
  )
  buffers = hlo.command_buffers(plain, "decode_body")
  assert buffers["command_buffers"] == 0 and buffers["loop_in_command_buffer"] is False
  assert buffers["body_launches"] == 13


def test_step_launches_agree_with_the_layer_count_on_cpu(target, draft):
  """On CPU (no command buffers) the launches are the kernels, and an unrolled
  step's per-layer count is `decode_kernels`' (the same programs' loop body)."""
  cfg = target.cfg.replace(scan_layers=False)
  counts = compile_bench.step_launches(cfg, draft.cfg, gamma=2, prompt_len=4, max_new_tokens=4)
  layer = compile_bench.decode_kernels(cfg, prompt_len=4, max_new_tokens=4)
  ar, spec = counts["ar"], counts["spec"]
  assert ar["kernels_per_layer"] == layer["kernels_per_layer"] > 0
  assert ar["kernels_per_step"] == layer["kernels_per_step"]
  for c in (ar, spec):
    assert c["launches_per_step"] == c["kernels_per_step"]
    assert c["command_buffers"]["command_buffers"] == 0
    assert c["command_buffers"]["loop_in_command_buffer"] is False
  # The iteration holds the draft's gamma calls besides the verification's layers.
  assert 0 < spec["kernels_per_layer"] < spec["kernels_per_step"]
  assert spec["kernels_per_step"] > ar["kernels_per_step"]


def test_trace_summary_on_cpu_says_there_is_no_device_timeline(tmp_path):
  f = jax.jit(lambda x: jax.lax.fori_loop(0, 4, lambda i, x: jnp.tanh(x @ x) + 1, x))
  x = jnp.ones((32, 32))
  summary = trace_bench.trace_call(lambda: f(x), str(tmp_path / "trace"))
  assert os.path.exists(summary["trace"]) and summary["trace"].endswith(".xplane.pb")
  assert summary["timeline"] == "host" and "no device timeline" in summary["note"]
  assert summary["kernel_events"] > 0 and 0 < summary["busy_ms"] <= summary["span_ms"]
  assert summary["wall_ms"] > 0 and summary["busy_fraction"] > 0
  assert 0 < len(summary["top_kernels"]) <= 10
  # The loop's own thunk, which spans the thunks it runs, is not a kernel.
  assert not any(k["name"].startswith("while") for k in summary["top_kernels"])


def test_trace_summary_reads_a_device_timeline():
  """Two streams overlap (busy time is their union), a derived line repeats a
  kernel (not counted), and a graph launch shows on the host."""
  text = """
  planes { id: 1 name: "/device:GPU:0"
    lines { id: 1 name: "Stream #13(Compute)" timestamp_ns: 1000
      events { metadata_id: 1 offset_ps: 0 duration_ps: 4000000 }
      events { metadata_id: 2 offset_ps: 6000000 duration_ps: 1000000 }
      events { metadata_id: 2 offset_ps: 8000000 duration_ps: 1000000 } }
    lines { id: 2 name: "Stream #14(Compute)" timestamp_ns: 1000
      events { metadata_id: 3 offset_ps: 2000000 duration_ps: 3000000 } }
    lines { id: 3 name: "XLA Ops" timestamp_ns: 1000
      events { metadata_id: 1 offset_ps: 0 duration_ps: 4000000 } }
    event_metadata { key: 1 value { id: 1 name: "gemm_fusion" } }
    event_metadata { key: 2 value { id: 2 name: "loop_fusion" } }
    event_metadata { key: 3 value { id: 3 name: "input_reduce_fusion" } } }
  planes { id: 2 name: "/host:CUPTI"
    lines { id: 1 name: "CUPTI driver API" timestamp_ns: 900
      events { metadata_id: 1 offset_ps: 0 duration_ps: 5000 } }
    event_metadata { key: 1 value { id: 1 name: "cuGraphLaunch" } } }
  """
  summary = trace_bench.summarize(jax.profiler.ProfileData.from_text_proto(text), wall_s=10e-6)
  assert summary["timeline"] == "device" and summary["kernel_events"] == 4
  assert summary["busy_ms"] == pytest.approx(7e-3)  # 0-5 us, 6-7, 8-9
  assert summary["span_ms"] == pytest.approx(9e-3)
  assert summary["busy_fraction"] == pytest.approx(0.7)
  assert summary["graph_launches"] == 1
  top = summary["top_kernels"]
  assert [k["name"] for k in top] == ["gemm_fusion", "input_reduce_fusion", "loop_fusion"]
  assert top[0]["calls"] == 1 and top[0]["share"] == pytest.approx(4 / 9)
  assert top[2]["calls"] == 2 and top[2]["total_ms"] == pytest.approx(2e-3)


def test_options_xla_refuses_fall_back_to_none(monkeypatch):
  """A jaxlib whose XLA does not know an option (or a value) still runs the
  programs, without specjax's options, after one warning."""
  monkeypatch.setattr(compiler_options.jax, "default_backend", lambda: "gpu")
  monkeypatch.setitem(compiler_options._state, "refused", None)
  bad = {"xla_gpu_enable_command_buffer": "FUSION,NOT_A_COMMAND"}
  monkeypatch.setattr(compiler_options, "command_buffer_options", lambda enabled: bad)
  program = compiler_options.jit(lambda x: x + 1)
  x = jnp.arange(3.0)
  np.testing.assert_array_equal(program(x), x + 1)
  assert "not a valid enum value" in compiler_options.refused()
  assert compiler_options.compiler_options("gpu") == {}
  assert set(program._jitted) == {tuple(bad.items()), ()}
  # Any other error is the caller's.
  with pytest.raises(TypeError):
    program("not an array")
