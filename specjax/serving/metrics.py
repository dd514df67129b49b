"""Summaries of completions: latency percentiles, throughput, goodput, acceptance.

One place for the numbers the server's /metrics endpoint (`engine_metrics`)
and the load test (`summarize`) report, so both say the same thing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from specjax.serving.request import Completion

PERCENTILES = (50, 90, 99)


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
  """`{"mean", "p50", "p90", "p99"}` of `values` (None for an empty list)."""
  values = np.asarray([v for v in values if v is not None], np.float64)
  out: dict[str, float | None] = {"mean": float(values.mean()) if values.size else None}
  for q in PERCENTILES:
    out[f"p{q}"] = float(np.percentile(values, q)) if values.size else None
  return out


def summarize(
  completions: Sequence[Completion],
  duration_s: float | None = None,
  slo_ttft_s: float | None = None,
  slo_tpot_s: float | None = None,
) -> dict:
  """Aggregate figures of finished requests.

  Args:
    completions: finished requests (any finish reason; only those that ended
      normally, "stop" or "length", count towards latency and throughput).
    duration_s: the wall time they were served in (default: first arrival to
      last finish).
    slo_ttft_s, slo_tpot_s: the latency objectives of goodput: requests that
      meet both (None: no objective) count towards it.

  Returns:
    `{requests, completed, failed, cancelled, output_tokens, duration_s,
    throughput_tok_s, request_rate, goodput_req_s, goodput_tok_s,
    acceptance_rate, ttft_s, tpot_s, e2e_s}`, latencies as `percentiles`.
  """
  done = [c for c in completions if c.finish_reason in ("stop", "length")]
  if duration_s is None:
    duration_s = (
      max(c.finish_time for c in completions) - min(c.arrival_time for c in completions)
      if completions
      else 0.0
    )
  tokens = sum(len(c.tokens) for c in done)

  def meets(c: Completion) -> bool:
    ttft_ok = slo_ttft_s is None or (c.ttft is not None and c.ttft <= slo_ttft_s)
    tpot_ok = slo_tpot_s is None or c.tpot is None or c.tpot <= slo_tpot_s
    return ttft_ok and tpot_ok

  good = [c for c in done if meets(c)]
  evaluated = sum(c.evaluated for c in done)
  per_second = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: None)
  return {
    "requests": len(completions),
    "completed": len(done),
    "failed": sum(c.finish_reason == "error" for c in completions),
    "cancelled": sum(c.finish_reason == "cancelled" for c in completions),
    "output_tokens": tokens,
    "duration_s": duration_s,
    "throughput_tok_s": per_second(tokens),
    "request_rate": per_second(len(done)),
    "goodput_req_s": per_second(len(good)),
    "goodput_tok_s": per_second(sum(len(c.tokens) for c in good)),
    "acceptance_rate": sum(c.accepted for c in done) / evaluated if evaluated else None,
    "ttft_s": percentiles([c.ttft for c in done]),
    "tpot_s": percentiles([c.tpot for c in done]),
    "e2e_s": percentiles([c.e2e for c in done]),
  }


def engine_metrics(
  counters: Mapping[str, int],
  recent: Sequence[Completion],
  *,
  live: int,
  queued: int,
  draft_lengths: Sequence[int],
  policy,
  positions: int = 0,
) -> dict:
  """What `Engine.metrics()` reports: its counters since start and the latency
  percentiles of its `recent` completions.

  Args:
    counters: the engine's counts (submitted, finish reasons, tokens, steps
      per draft length, drafted, accepted and evaluated drafted tokens, and
      by position: `drafted_at_{i}`, `accepted_at_{i}`).
    recent: the last completions.
    live, queued: requests holding a slot; waiting for one.
    draft_lengths: the engine's compiled draft lengths.
    policy: its `SpeculationPolicy`.
    positions: the draft positions counted (the engine's largest draft length).

  `speculation` holds the counters that the requests' own figures
  (`SpeculationCounts`, their usage) add up to: drafted, accepted and forced
  tokens, and by position.
  """
  c = counters
  return {
    "requests": {
      "submitted": c["submitted"],
      "completed": c["stop"] + c["length"],
      "cancelled": c["cancelled"],
      "failed": c["error"],
      "live": live,
      "queued": queued,
    },
    "tokens": c["tokens"],
    "steps": {g: c[f"steps_gamma_{g}"] for g in draft_lengths},
    "acceptance_rate": c["accepted"] / c["evaluated"] if c["evaluated"] else None,
    "speculation": {
      "drafted": c["drafted"],
      "accepted": c["accepted"],
      "drafted_at_position": [c[f"drafted_at_{i + 1}"] for i in range(positions)],
      "accepted_at_position": [c[f"accepted_at_{i + 1}"] for i in range(positions)],
      "forced": c["forced"],  # also in drafted and accepted
    },
    "policy": {
      "kind": policy.kind,
      "alpha": policy.alpha,
      "gamma": policy.current,  # adaptive: the draft length in use (else None)
      "step_ms": policy.live_step_ms(),
    },
    "ttft_s": percentiles([x.ttft for x in recent]),
    "tpot_s": percentiles([x.tpot for x in recent]),
    "e2e_s": percentiles([x.e2e for x in recent]),
  }
