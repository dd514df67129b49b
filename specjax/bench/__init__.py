"""Measurement: timing, the machine's floor, kernel counts (HLO), costs and
generation benchmarks; how and why: docs/performance.md.

Imports point down: timing <- floor, costs <- generation; hlo, costs <- iteration.
A server under load (load generation, its report, the soak): `specjax.bench.serving`.
"""

from specjax.bench.costs import (
  call_seconds,
  draft_cost,
  drafting_seconds,
  long_prompt_prefill,
  predict_speedup,
  prefill_timing,
)
from specjax.bench.floor import (
  floor_fields,
  machine_floor,
  matmul_floor_seconds,
  matmul_gflops,
  model_floor,
  nominal_bandwidth_gbs,
  read_bandwidth,
  read_bandwidth_gbs,
  weight_bytes,
)
from specjax.bench.generation import benchmark_generation
from specjax.bench.hlo import (
  cache_copies,
  command_buffers,
  hlo_ops,
  kernel_counts,
  launches,
  loop_kernels,
  trip_counts,
  while_bodies,
)
from specjax.bench.iteration import profile_iteration
from specjax.bench.timing import (
  Timing,
  compile_ahead,
  environment_info,
  free_compiled_programs,
  memory_map_count,
  random_prompts,
  time_calls,
)

__all__ = [
  "Timing",
  "benchmark_generation",
  "cache_copies",
  "call_seconds",
  "command_buffers",
  "compile_ahead",
  "draft_cost",
  "drafting_seconds",
  "environment_info",
  "floor_fields",
  "free_compiled_programs",
  "hlo_ops",
  "kernel_counts",
  "launches",
  "long_prompt_prefill",
  "loop_kernels",
  "machine_floor",
  "matmul_floor_seconds",
  "matmul_gflops",
  "nominal_bandwidth_gbs",
  "read_bandwidth",
  "read_bandwidth_gbs",
  "memory_map_count",
  "model_floor",
  "predict_speedup",
  "prefill_timing",
  "profile_iteration",
  "random_prompts",
  "time_calls",
  "trip_counts",
  "weight_bytes",
  "while_bodies",
]
