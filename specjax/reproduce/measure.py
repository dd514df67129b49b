"""Measured speculative decoding on a target: alpha, tokens per iteration,
acceptance by draft position, the cost ratio c, predicted and measured speedup.

`measure` decodes every (drafter, gamma, verifier) variant at batch 1, each run
paired with an autoregressive one, freeing each variant's programs before the
next; one JSON-ready row per variant. The prediction is Leviathan's
S = E(alpha, gamma) / (gamma c + v) from measured alpha, c and v
(`bench.predict_speedup`), so it shares every input but the loop's overheads.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

import specjax
from specjax import bench
from specjax.drafting import CountDrafter
from specjax.models.kv_cache import cache_capacity
from specjax.models.transformer import Transformer


class Variant(NamedTuple):
  """One measured configuration: a named drafter at a draft length and verifier,
  at every temperature or only at `temperatures`."""

  drafter: str
  gamma: int
  verifier: str = "auto"
  temperatures: tuple[float, ...] | None = None

  def runs_at(self, temperature: float) -> bool:
    if self.verifier == "greedy" and temperature > 0:
      return False
    return self.temperatures is None or temperature in self.temperatures


def _sum(outs, field: str) -> np.ndarray:
  return sum(np.asarray(getattr(o.stats, field), np.float64).sum(axis=-1) for o in outs)


def _tokens(outs) -> float:
  """Tokens the calls generated (the prefill's first token included)."""
  return float(sum(np.asarray(o.num_generated).sum() for o in outs))


def _position_rates(outs, gamma: int) -> tuple[list[float], list[float]]:
  """(P(drafted token i accepted), P(token i accepted | token i - 1 accepted)) for
  i = 1..gamma, over every (row, iteration) of `outs`."""
  at = sum(np.asarray(o.stats.accepted_at_position, np.float64) for o in outs)
  iterations = max(float(_sum(outs, "row_iterations")), 1.0)
  reached = np.concatenate([[iterations], at[:-1]])
  through = (at / iterations).tolist()
  conditional = np.divide(at, reached, out=np.zeros_like(at), where=reached > 0).tolist()
  return through[:gamma], conditional[:gamma]


class _Costs(NamedTuple):
  """Measured seconds, timed once for all temperatures: one target step, scoring
  gamma + 1 tokens by gamma, and drafting per iteration by (drafter, gamma)."""

  step_s: float
  verify_s: dict[int, float]
  drafting_s: dict[tuple[str, int], float]

  def prediction(self, v: Variant, alpha: float) -> dict[str, float]:
    """c, verify_cost and the predicted speedup of `v` at acceptance rate `alpha`."""
    return bench.predict_speedup(
      gamma=v.gamma,
      target_step_s=self.step_s,
      verify_s=self.verify_s[v.gamma],
      drafting_s=self.drafting_s[v.drafter, v.gamma],
      alpha=alpha,
    )


def _costs(target, drafters, variants, prompt, max_new_tokens, temperatures, num_runs) -> _Costs:
  """The costs of `variants`, timed on `prompt` (batch 1): a draft `Transformer`'s
  one call per token, a count drafter's nothing (the paper's convention), any
  other drafter's proposal and commit (`bench.drafting_seconds`)."""
  gammas = {v.gamma for v in variants}
  capacity = cache_capacity(prompt[0].shape[1], max_new_tokens, max(gammas))
  call = functools.partial(
    bench.call_seconds,
    prompts=prompt[0],
    prompt_lengths=prompt[1],
    capacity=capacity,
    num_runs=num_runs,
  )
  step_s = call(target, tokens_per_call=1)
  verify = {g: call(target, tokens_per_call=g + 1) for g in gammas}
  per_call, drafting = {}, {}
  sampling = specjax.SamplingParams(temperature=float(max(temperatures)))
  for name, gamma in {(v.drafter, v.gamma) for v in variants}:
    drafter = drafters[name]
    if isinstance(drafter, CountDrafter):
      drafting[name, gamma] = 0.0
    elif isinstance(drafter, Transformer):
      if name not in per_call:
        per_call[name] = call(drafter, tokens_per_call=1)
      drafting[name, gamma] = per_call[name] * gamma
    else:
      drafting[name, gamma] = bench.drafting_seconds(
        target,
        drafter,
        *prompt,
        gamma=gamma,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        num_runs=num_runs,
      )
    bench.free_compiled_programs()
  return _Costs(step_s, verify, drafting)


def measure(
  target,
  drafters: dict[str, Any],
  variants: Sequence[Variant],
  prompts,
  lengths,
  *,
  temperatures: Sequence[float],
  max_new_tokens: int,
  num_runs: int,
  seed: int = 0,
  progress: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
  """Decodes each prompt alone with every variant at every temperature.

  Args:
    target: the `Transformer` decoded.
    drafters: name -> drafter (anything `speculative_generate` takes).
    variants: what to run (a "greedy" verifier only at temperature 0).
    prompts, lengths: `[N, P]` int32 prompts and `[N]` lengths (batch 1 each).
    temperatures: e.g. (0.0, 1.0).
    num_runs: timed runs per variant (median), each paired with an AR run.
    progress: called with a line per step and per variant.


  Returns:
    One dict per (temperature, variant): alpha, tokens per iteration, rates by
    position, c, verify cost, predicted and measured speedup, ms per token.
  """

  one = [(prompts[i : i + 1], lengths[i : i + 1]) for i in range(len(lengths))]
  progress("measuring draft and verification costs")
  costs = _costs(target, drafters, variants, one[0], max_new_tokens, temperatures, num_runs)
  rows = []
  for temperature in temperatures:
    sampling = specjax.SamplingParams(temperature=float(temperature))
    key = jax.random.key(seed)
    runs = [v for v in variants if v.runs_at(temperature)]
    progress(f"T={temperature:g}: compiling and timing {len(runs)} variants, one at a time")
    ar_program = bench.compile_ahead(
      functools.partial(
        specjax.autoregressive_generate, max_new_tokens=max_new_tokens, sampling=sampling
      ),
      target,
      *one[0],
      key=key,
    )

    def ar(ar_program=ar_program, key=key):
      return [ar_program(target, *prompt, key=key) for prompt in one]

    for v in runs:
      start = time.perf_counter()
      drafter = drafters[v.drafter]
      spec = functools.partial(
        _decode, target, drafter, v, one, sampling, key, max_new_tokens=max_new_tokens
      )
      timings, outputs = bench.time_calls({"ar": ar, "spec": spec}, num_runs)
      row = _row(v, float(temperature), timings, outputs, costs)
      rows.append(row)
      del spec, timings, outputs
      bench.free_compiled_programs()
      progress(
        f"  {v.drafter}, γ={v.gamma}, {v.verifier}: {time.perf_counter() - start:.1f} s, "
        f"α {row['alpha']:.3f}, speedup {row['speedup']:.2f}"
      )
    del ar, ar_program
    bench.free_compiled_programs()
  return rows


def _decode(target, drafter, v: Variant, prompts, sampling, key, *, max_new_tokens) -> list:
  """`speculative_generate` of variant `v` on each `(tokens [1, P], lengths [1])` of `prompts`."""
  return [
    specjax.speculative_generate(
      target,
      drafter,
      *prompt,
      gamma=v.gamma,
      max_new_tokens=max_new_tokens,
      sampling=sampling,
      key=key,
      verifier=v.verifier,
    )
    for prompt in prompts
  ]


def _row(v: Variant, temperature: float, timings, outputs, costs: _Costs) -> dict[str, Any]:
  """The variant's JSON row from its paired timings and outputs."""
  outs = outputs["spec"]
  generated = float(_sum(outs, "generated"))
  alpha = float(_sum(outs, "accepted")) / max(float(_sum(outs, "evaluated")), 1.0)
  through, conditional = _position_rates(outs, v.gamma)
  ms = timings["spec"].median_s * 1e3 / _tokens(outs)
  ar_ms = timings["ar"].median_s * 1e3 / _tokens(outputs["ar"])
  return {
    "temperature": temperature,
    "drafter": v.drafter,
    "gamma": v.gamma,
    "verifier": v.verifier,
    "alpha": alpha,
    "tokens_per_iteration": generated / max(float(_sum(outs, "row_iterations")), 1.0),
    "accepted_through": through,
    "accepted_given_previous": conditional,
    **costs.prediction(v, alpha),  # c, verify_cost, predicted_speedup
    "ms_per_token": ms,
    "ar_ms_per_token": ar_ms,
    "speedup": ar_ms / ms,
  }
