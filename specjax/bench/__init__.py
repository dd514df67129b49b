"""Measurement: timing, the machine's floor, kernel counts, costs and generation benchmarks.

  timing      `time_calls` (warm-up, then interleaved timed runs; `Timing`),
              `compile_ahead`, `free_compiled_programs`, `memory_map_count`,
              `environment_info`, `random_prompts`
  costs       `call_seconds`, `drafting_seconds`, `prefill_timing`,
              `long_prompt_prefill`, `draft_cost`, and `predict_speedup`: the one
              place measured times become c and Leviathan's predicted speedup
  floor       the machine's floor (`machine_floor`, `memory_bandwidth_gbs`,
              `matmul_gflops`) and a model's (`model_floor`, `weight_bytes`,
              `matmul_floor_seconds`), `floor_fields`
  hlo         kernels per loop body of a compiled program (`loop_kernels`), what
              the loop bodies execute (`hlo_ops`), cache-sized copies among it
              (`cache_copies`), loops' known trip counts (`trip_counts`)
  generation  `benchmark_generation`: autoregressive against speculative decoding
  iteration   `profile_iteration`: where one speculative iteration's time goes

Imports point down: timing <- floor, costs <- generation; hlo, costs <- iteration.
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
  memory_bandwidth_gbs,
  model_floor,
  weight_bytes,
)
from specjax.bench.generation import benchmark_generation
from specjax.bench.hlo import (
  cache_copies,
  hlo_ops,
  kernel_counts,
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
  "compile_ahead",
  "draft_cost",
  "drafting_seconds",
  "environment_info",
  "floor_fields",
  "free_compiled_programs",
  "hlo_ops",
  "kernel_counts",
  "long_prompt_prefill",
  "loop_kernels",
  "machine_floor",
  "matmul_floor_seconds",
  "matmul_gflops",
  "memory_bandwidth_gbs",
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
