"""Autoregressive against speculative decoding, with the costs that predict the
speedup (`bench.costs`) and the floor (`bench.floor`): what
`specjax.jobs.benchmark` runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from specjax import theory
from specjax.bench.costs import draft_cost, long_prompt_prefill, prefill_timing
from specjax.bench.floor import floor_fields
from specjax.bench.timing import Timing, time_calls
from specjax.generation import autoregressive_generate, speculative_generate
from specjax.models.kv_cache import cache_capacity
from specjax.models.transformer import Transformer
from specjax.sampling import SamplingParams
from specjax.validation import check_positive_int


def benchmark_generation(
  target: Transformer,
  draft: Transformer,
  prompts: jax.Array,
  prompt_lengths: jax.Array,
  *,
  gamma: int,
  max_new_tokens: int,
  sampling: SamplingParams,
  key: jax.Array,
  num_runs: int,
  step_timing_steps: int = 16,
  loop: str = "while",
  loop_chunk: int = 8,
  progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
  """Measures autoregressive vs speculative decoding and the costs that predict it.

  No EOS: every row generates exactly `max_new_tokens` tokens.

  Args:
    target, draft: the models; the same object twice benchmarks a perfect draft
      (c is then 1 and not measured).
    prompts: `[B, P]` int32; prompt_lengths `[B]`.
    key: PRNG key, the same for every run.
    num_runs: timed runs of each measurement (after one warm-up call).
    step_timing_steps: N model calls per loop in the per-call cost timings.
    loop, loop_chunk: as in `speculative_generate`.
    progress: called with a line as each measurement starts; None: quiet.


  Returns:
    A JSON-ready dict; see `_result`'s keys. `*_ms` are milliseconds.
  """
  check_positive_int("gamma", gamma)
  check_positive_int("max_new_tokens", max_new_tokens)
  check_positive_int("num_runs", num_runs)
  check_positive_int("step_timing_steps", step_timing_steps)
  start = time.perf_counter()

  def step(text: str) -> None:
    if progress is not None:
      progress(f"{text} ({time.perf_counter() - start:.0f} s)")

  step(f"autoregressive and speculative decoding: compile, then {num_runs} timed runs each")
  shared = dict(max_new_tokens=max_new_tokens, sampling=sampling, num_runs=num_runs)
  loops = dict(loop=loop, loop_chunk=loop_chunk)
  timings, outputs = _time_decoding(
    target, draft, prompts, prompt_lengths, gamma, key, loops, **shared
  )
  stats = outputs["spec"].stats.summary()
  step("draft and verification costs (c, verify cost ratio)")
  cost = draft_cost(
    target,
    draft,
    prompts,
    prompt_lengths,
    gamma=gamma,
    stats=stats,
    num_steps=step_timing_steps,
    **shared,
  )
  step("time to first token, the machine's floor, a long prompt's prefill")
  floor = _floor(target, draft, prompts, prompt_lengths, gamma, key, timings, stats, cost, **shared)
  return _result(timings, outputs, stats, cost, floor, gamma, max_new_tokens, sampling.greedy)


def _time_decoding(
  target, draft, prompts, prompt_lengths, gamma, key, loops, *, max_new_tokens, sampling, num_runs
) -> tuple[dict[str, Timing], dict[str, Any]]:
  """`time_calls` of autoregressive ("ar") and speculative ("spec") decoding with
  the loops' settings `loops`, checked to generate `max_new_tokens` tokens on
  every row (no EOS is set)."""
  generate = {
    "ar": lambda: autoregressive_generate(
      target,
      prompts,
      prompt_lengths,
      max_new_tokens=max_new_tokens,
      sampling=sampling,
      key=key,
      **loops,
    ),
    "spec": lambda: speculative_generate(
      target,
      draft,
      prompts,
      prompt_lengths,
      gamma=gamma,
      max_new_tokens=max_new_tokens,
      sampling=sampling,
      key=key,
      **loops,
    ),
  }
  timings, outputs = time_calls(generate, num_runs)
  for name, out in outputs.items():
    if not np.all(np.asarray(out.num_generated) == max_new_tokens):
      raise RuntimeError(
        f"{name} generated {np.asarray(out.num_generated).tolist()} "
        f"tokens per row, expected {max_new_tokens} (no EOS is set)."
      )
  return timings, outputs


def _floor(
  target, draft, prompts, prompt_lengths, gamma, key, timings, stats, cost, **shared
) -> dict[str, Any]:
  """Time to first token (`prefill_ms`), `floor_fields` and `long_prompt_prefill`."""
  max_new_tokens, num_runs = shared["max_new_tokens"], shared["num_runs"]
  capacity = cache_capacity(prompts.shape[1], max_new_tokens, gamma)  # as speculative_generate
  prefill_s = prefill_timing(
    target,
    prompts,
    prompt_lengths,
    capacity=capacity,
    sampling=shared["sampling"],
    key=key,
    num_runs=num_runs,
  ).median_s
  floor = floor_fields(
    target,
    batch=prompts.shape[0],
    ar_step_s=(timings["ar"].median_s - prefill_s) / max(max_new_tokens - 1, 1),
    spec_iteration_s=(timings["spec"].median_s - prefill_s) / max(stats["iterations"], 1),
    verify_call_s=cost["verify_s"],
    draft_call_s=cost["draft_call_s"],
    draft_calls_per_iteration=cost["draft_calls_per_iteration"],
    num_runs=num_runs,
  )
  long_prefill = long_prompt_prefill(
    target,
    draft if isinstance(draft, Transformer) and draft is not target else None,
    prompts.shape[0],
    num_runs=num_runs,
  )
  return {"prefill_ms": prefill_s * 1e3, **floor, **long_prefill}


def _result(timings, outputs, stats, cost, floor, gamma, max_new_tokens, greedy) -> dict[str, Any]:
  """`benchmark_generation`'s JSON-ready dict from its measurements."""
  ar_ms = timings["ar"].median_s * 1e3 / max_new_tokens
  spec_ms = timings["spec"].median_s * 1e3 / max_new_tokens
  alpha, predicted = stats["acceptance_rate"], cost["predicted_speedup"]
  greedy_match = None
  if greedy:  # exactness check for free: both must be the target's greedy output
    greedy_match = bool(
      np.array_equal(np.asarray(outputs["ar"].tokens), np.asarray(outputs["spec"].tokens))
    )
  return {
    "ar_ms_per_token": ar_ms,
    "spec_ms_per_token": spec_ms,
    "speedup": ar_ms / spec_ms,
    "acceptance_rate": alpha,
    "tokens_per_iteration": stats["tokens_per_iteration"],
    "expected_tokens_per_iteration": theory.expected_tokens_per_iteration(alpha, gamma),
    "target_step_ms": cost["target_step_s"] * 1e3,
    "draft_step_ms": cost["draft_call_s"] * 1e3,
    "target_verify_ms": cost["verify_s"] * 1e3,
    "c": cost["c"],
    "verify_cost_ratio": cost["verify_cost"],
    "predicted_speedup": predicted,
    "measured_over_predicted": ar_ms / spec_ms / predicted,
    # First generate call (trace + compile + run) minus the median steady call.
    "ar_compile_seconds": timings["ar"].compile_s,
    "spec_compile_seconds": timings["spec"].compile_s,
    "prefill_ms": floor["prefill_ms"],
    "greedy_outputs_match": greedy_match,
    **floor,
    "spec_stats": stats,
    "ar_runs_ms": [s * 1e3 for s in timings["ar"].runs_s],
    "spec_runs_ms": [s * 1e3 for s in timings["spec"].runs_s],
  }
