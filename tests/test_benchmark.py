"""Smoke test of the benchmark launcher on a minuscule self-drafting config.

Checks the result's keys and the quantities that do not depend on timing: with
the target drafting for itself at temperature 0 every drafted token is accepted.
"""

import json

import pytest

from configs import benchmark as benchmark_config
from specjax.jobs import benchmark

# Runs in tests/test_front_door.py's process when the whole suite runs.
pytestmark = pytest.mark.front_door

KEYS = [
  "preset",
  "config",
  "target_params",
  "draft_params",
  "max_seq_len",
  "backend",
  "device_kind",
  "jax_version",
  "date",
  "ar_ms_per_token",
  "spec_ms_per_token",
  "speedup",
  "acceptance_rate",
  "tokens_per_iteration",
  "c",
  "verify_cost_ratio",
  "predicted_speedup",
  "measured_over_predicted",
  "ar_compile_seconds",
  "spec_compile_seconds",
  "prefill_ms",
  "read_bandwidth_gbs",
  "matmul_gflops",
  "target_matmul_floor_ms",
  "ar_over_floor",
  "spec_overhead_fraction",
  "target_long_prefill_ms",
]


def test_self_draft_benchmark_smoke():
  config = benchmark_config.get_config("self")
  config.target.update(
    dict(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64)
  )
  config.gamma = 2
  config.prompt_len = 8
  config.max_new_tokens = 1 + 2 * (config.gamma + 1)
  config.num_runs = 3
  config.step_timing_steps = 2
  result = json.loads(json.dumps(benchmark.run(config)))  # must be JSON-ready
  for key in KEYS:
    assert key in result, key
  assert result["config"]["gamma"] == config.gamma
  assert result["target_params"] == result["draft_params"]
  assert result["tokens_per_iteration"] == config.gamma + 1
  assert result["acceptance_rate"] == 1.0
  assert result["c"] == 1.0
  assert result["greedy_outputs_match"] is True
  assert result["speedup"] == result["ar_ms_per_token"] / result["spec_ms_per_token"]
  # The floor's arithmetic: ratios of the reported times, whatever they are.
  ratio = result["ar_step_ms"] / result["target_bandwidth_floor_ms"]
  assert result["ar_over_floor"] == pytest.approx(ratio, rel=1e-9)
  ratio = result["ar_step_ms"] / result["target_matmul_floor_ms"]
  assert result["ar_over_matmul_floor"] == pytest.approx(ratio, rel=1e-9)
  models_ms = (
    result["target_verify_ms"] + result["draft_calls_per_iteration"] * (result["draft_call_ms"])
  )
  assert (
    abs(result["spec_overhead_fraction"] - (1 - models_ms / result["spec_ms_per_iteration"])) < 1e-9
  )
  assert result["draft_calls_per_iteration"] == config.gamma  # a perfect draft drafts all gamma
  assert result["long_prompt_tokens"] == 512 and result["target_long_prefill_ms"] > 0
  # The printed table: a header, its rule and the result's one row.
  table = benchmark.markdown(result).splitlines()
  assert len(table) == 3 and table[0].startswith("| preset | target | draft |")
  assert table[2].startswith("| self | 13.4K | 13.4K | 1 | 2 | 0 |")
  assert f"| {result['speedup']:.2f} | {result['predicted_speedup']:.2f} | 1.000 |" in table[2]
