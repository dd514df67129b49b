"""Load generation: Poisson arrivals of held-out prompts, in process or over HTTP.

  requests = held_out_requests(64, tokenizer, max_new_tokens=32, max_prompt_len=128)
  arrivals = poisson_arrivals(rate_per_s=4.0, n=64, seed=0)
  completions = run_in_process(engine, requests, arrivals)     # or run_http(url, ...)
  summarize(completions)                                       # specjax.serving.metrics

  rows = sweep({"plain": plain_engine, "adaptive": engine}, requests, rates=(2, 4, 8))

Latencies count from a request's scheduled arrival, so time spent waiting for
the driver (a step in progress, a full queue) counts as it would for a client.
A sweep's tables and figure are `specjax.bench.serving.load_report`'s;
`specjax.testing.tiny_setup` gives random tiny models and a byte-level
tokenizer for smoke runs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from specjax.sampling import GREEDY, SamplingParams
from specjax.serving.metrics import summarize
from specjax.serving.request import Completion, Request
from specjax.validation import check_positive_int, is_real

# Engine policies by load-test mode ("plain" serves without a draft).
MODES = {"plain": "never", "always": "always", "adaptive": "adaptive"}
POLICY_MODES = {policy: mode for mode, policy in MODES.items()}


def check_rate(name: str, rate) -> float:
  """`rate` (requests per second) as a float; raises unless finite and > 0."""
  if not is_real(rate) or not 0 < rate < math.inf:
    raise ValueError(f"{name} must be a finite number of requests per second > 0, got {rate!r}.")
  return float(rate)


def poisson_arrivals(rate_per_s: float, n: int, seed: int = 0) -> np.ndarray:
  """Arrival offsets in seconds `[n]` of a Poisson process: the first at 0, then
  independent exponential gaps of mean `1 / rate_per_s` (the same `seed` gives
  the same offsets)."""
  rate = check_rate("rate_per_s", rate_per_s)
  n = check_positive_int("n", n)
  gaps = np.random.default_rng(seed).exponential(1.0 / rate, n - 1)
  return np.concatenate([[0.0], np.cumsum(gaps)])


def held_out_texts(n: int) -> list[str]:
  """The first `n` held-out test-split prompts
  (`specjax.data.prompts.held_out_prompts`), or all of them when the split
  holds fewer (71 on CPython 3.11)."""
  from specjax.data.prompts import held_out_prompts

  n = check_positive_int("n", n)
  try:
    return held_out_prompts(n)
  except ValueError:
    pass
  # Fewer than n: bisect for the split's count (each try reads the split's
  # files, about 30 ms).
  found, too_many = held_out_prompts(1), n
  while too_many - len(found) > 1:
    middle = (len(found) + too_many) // 2
    try:
      found = held_out_prompts(middle)
    except ValueError:
      too_many = middle
  return found


def held_out_requests(
  n: int,
  tokenizer,
  max_new_tokens: int,
  max_prompt_len: int,
  sampling: SamplingParams = GREEDY,
  stop_id: int | None = None,
  seeded: bool = False,
) -> list[Request]:
  """`n` requests whose prompts are the held-out test-split prompts
  (`held_out_texts`), reused in order when `n` exceeds them. A prompt longer
  than `max_prompt_len` tokens keeps its last `max_prompt_len` (the
  continuation starts at its end). `seeded`: request i has seed i (its text is
  then the same in every mode)."""
  check_positive_int("max_new_tokens", max_new_tokens)
  check_positive_int("max_prompt_len", max_prompt_len)
  prompts = [tokenizer.encode(t)[-max_prompt_len:] for t in held_out_texts(n)]
  return [
    Request(
      prompts[i % len(prompts)],
      max_new_tokens,
      sampling=sampling,
      stop_id=stop_id,
      seed=i if seeded else None,
    )
    for i in range(n)
  ]


def _check_run(requests: Sequence[Request], arrivals) -> np.ndarray:
  arrivals = np.asarray(arrivals, np.float64)
  if arrivals.shape != (len(requests),):
    raise ValueError(
      f"arrivals must hold one offset per request, shape ({len(requests)},), got {arrivals.shape}."
    )
  if not np.all(np.isfinite(arrivals)) or np.any(np.diff(arrivals) < 0) or np.any(arrivals < 0):
    raise ValueError("arrivals must be finite, >= 0 and non-decreasing.")
  return arrivals


def run_in_process(
  engine, requests: Sequence[Request], arrivals, progress: Callable[[str], None] | None = None
) -> list[Completion]:
  """Serves `requests` on `engine` (single-threaded, real clock): each is
  submitted once its arrival offset has passed, the engine steps while it has
  work, and the driver sleeps until the next arrival when it has none.

  Args:
    engine: a warmed-up `specjax.serving.Engine` with no work of its own.
    requests: what to send, in arrival order.
    arrivals: `[len(requests)]` non-decreasing offsets in seconds from the start.
    progress: called with a line now and then (every quarter of the requests).

  Returns:
    The `Completion` of each request, in order; `arrival_time` is its scheduled
    arrival (perf_counter seconds), so TTFT and e2e include any wait for the
    driver.
  """
  arrivals = _check_run(requests, arrivals)
  n = len(requests)
  ids: list[int] = []
  done: dict[int, Completion] = {}
  report_every = max(n // 4, 1)
  start = time.perf_counter()
  while len(ids) < n or engine.has_work():
    now = time.perf_counter() - start
    while len(ids) < n and arrivals[len(ids)] <= now:
      ids.append(engine.submit(requests[len(ids)]))
    if engine.has_work():
      for event in engine.step():
        if event.finished:
          done[event.request_id] = engine.pop_completion(event.request_id)
          if progress is not None and len(done) % report_every == 0:
            progress(f"  {len(done)}/{n} done after {time.perf_counter() - start:.1f} s")
    elif len(ids) < n:
      time.sleep(max(arrivals[len(ids)] - now, 0.0))
  return [
    dataclasses.replace(done[rid], arrival_time=start + float(arrivals[i]))
    for i, rid in enumerate(ids)
  ]


async def _http_one(client, url: str, index: int, request: Request, arrival: float) -> Completion:
  """One streamed request, due at `arrival` (perf_counter seconds); times are
  taken where the client sees each chunk (the first token: the first chunk
  with text)."""
  body = {
    "prompt": list(map(int, request.prompt)),
    "max_tokens": request.max_new_tokens,
    "temperature": request.sampling.temperature,
    "top_k": request.sampling.top_k,
    "top_p": request.sampling.top_p,
    "stream": True,
    "stream_options": {"include_usage": True},
  }
  if request.stop_id is not None:
    body["stop_token_id"] = request.stop_id
  if request.seed is not None:
    body["seed"] = request.seed
  first = None
  finish_reason, error, tokens = "error", None, 0
  try:
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
      if response.status_code != 200:
        error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:500]}"
      else:
        async for line in response.aiter_lines():
          if not line.startswith("data: ") or line == "data: [DONE]":
            continue
          chunk = json.loads(line[len("data: ") :])
          if "error" in chunk:
            error = chunk["error"]["message"]
            break
          if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
          for choice in chunk["choices"]:
            if first is None:
              first = time.perf_counter()
            if choice["finish_reason"] is not None:
              finish_reason = choice["finish_reason"]
  except Exception as e:  # a refused connection, a timeout: this request failed
    error = f"{type(e).__name__}: {e}"
  if error is not None:
    finish_reason = "error"
  return Completion(
    request_id=index,
    prompt_length=len(request.prompt),
    # The client sees text, not ids: one placeholder per generated token (from usage).
    tokens=[-1] * tokens,
    finish_reason=finish_reason,
    arrival_time=arrival,
    first_token_time=first,
    finish_time=time.perf_counter(),
    error=error,
  )


def auth_headers() -> dict[str, str]:
  """The Bearer token for a server behind a key: $SPECJAX_API_KEY, as the server reads it."""
  key = os.environ.get("SPECJAX_API_KEY")
  return {"Authorization": f"Bearer {key}"} if key else {}


async def _run_http(url, requests, arrivals, timeout_s) -> list[Completion]:
  import httpx

  start = time.perf_counter()
  limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
  async with httpx.AsyncClient(timeout=timeout_s, limits=limits, headers=auth_headers()) as client:

    async def send(i: int) -> Completion:
      arrival = start + float(arrivals[i])
      await asyncio.sleep(max(arrival - time.perf_counter(), 0.0))
      return await _http_one(client, url, i, requests[i], arrival)

    return list(await asyncio.gather(*(send(i) for i in range(len(requests)))))


def run_http(
  url: str, requests: Sequence[Request], arrivals, timeout_s: float = 600.0
) -> list[Completion]:
  """Sends `requests` to the server at `url` (`specjax.serving.http`, or any
  OpenAI-style /v1/completions that streams and reports usage) at `arrivals`
  offsets, streaming; TTFT, TPOT and e2e are measured here, at the client.

  Returns:
    Completion records in order: `tokens` holds one placeholder (-1) per
    generated token (the stream carries text), and the acceptance counters
    are 0 (the server's are in its /metrics).
  """
  arrivals = _check_run(requests, arrivals)
  return asyncio.run(_run_http(url.rstrip("/"), requests, arrivals, timeout_s))


def http_server_info(url: str, timeout_s: float = 10.0) -> dict:
  """The server's GET /health (its model and engine settings: policy, gamma, ...)."""
  import httpx

  response = httpx.get(url.rstrip("/") + "/health", timeout=timeout_s)
  response.raise_for_status()
  return response.json()


def http_metrics(url: str, timeout_s: float = 10.0) -> dict:
  """The server's GET /metrics.json (its counters since it started: acceptance, ...)."""
  import httpx

  response = httpx.get(url.rstrip("/") + "/metrics.json", timeout=timeout_s, headers=auth_headers())
  response.raise_for_status()
  return response.json()


def request_record(index: int, c: Completion) -> dict[str, Any]:
  """The row of a load-test report for request `index` (its place in the list sent)."""
  return {
    "index": index,
    "request_id": c.request_id,
    "prompt_tokens": c.prompt_length,
    "output_tokens": len(c.tokens),
    "finish_reason": c.finish_reason,
    "error": c.error,
    "ttft_s": c.ttft,
    "tpot_s": c.tpot,
    "e2e_s": c.e2e,
    "acceptance_rate": c.acceptance_rate,
  }


def sweep(
  targets: Mapping[str, Any],
  requests: Sequence[Request],
  rates: Sequence[float],
  *,
  seed: int = 0,
  repeats: int = 1,
  slo_ttft_s: float | None = None,
  slo_tpot_s: float | None = None,
  progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
  """Serves `requests` at each rate in each mode, `repeats` rounds a rate; one
  row per (rate, round, mode).

  Within a round every mode serves the same Poisson arrival times (seed
  `seed + round`); the modes take turns, in an order rotated each round, so a
  machine whose speed drifts (a shared CPU) weighs on every mode alike and the
  modes compare round by round (`load_report.compare_modes`).

  Args:
    targets: mode name -> a warmed-up `Engine` (served in process) or a server
      URL (over HTTP).
    requests: the same requests for every run.
    rates: offered loads, requests per second.
    repeats: rounds per rate (>= 1).
    slo_ttft_s, slo_tpot_s: the goodput objectives (`summarize`).
    progress: called with a line per run and within runs.

  Returns:
    `[{"mode", "rate", "round", "summary": summarize(...), "requests":
    [request_record]}]`, in process also "policy" (the engine's
    `metrics()["policy"]` after the run: its draft length in use and the
    step times it measured).
  """
  rates = [check_rate("rates", r) for r in rates]
  repeats = check_positive_int("repeats", repeats)
  if not rates:
    raise ValueError("rates must hold at least one rate.")
  if not targets:
    raise ValueError("targets must hold at least one mode.")
  modes = list(targets)
  rows = []
  for rate in rates:
    for round_ in range(repeats):
      arrivals = poisson_arrivals(rate, len(requests), seed + round_)
      turn = round_ % len(modes)
      for mode in modes[turn:] + modes[:turn]:
        name = f"{mode} at {rate:g} req/s" + (
          f", round {round_ + 1}/{repeats}" if repeats > 1 else ""
        )
        row = _serve_run(name, targets[mode], requests, arrivals, progress, slo_ttft_s, slo_tpot_s)
        rows.append({"mode": mode, "rate": rate, "round": round_, **row})
  return rows


def _serve_run(name, target, requests, arrivals, progress, slo_ttft_s, slo_tpot_s) -> dict:
  """One run of a sweep (`name` in its progress lines): `{"summary", "requests"}`,
  in process also "policy"."""
  if progress is not None:
    progress(f"{name}: {len(requests)} requests over {arrivals[-1]:.1f} s")
  if isinstance(target, str):
    completions = run_http(target, requests, arrivals)
  else:
    completions = run_in_process(target, requests, arrivals, progress)
  summary = summarize(completions, slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s)
  if progress is not None:
    progress(
      f"{name}: {_fmt(summary['throughput_tok_s'], '.1f')} tok/s, "
      f"p99 TTFT {_fmt(summary['ttft_s']['p99'], '.3f')} s, "
      f"acceptance {_fmt(summary['acceptance_rate'], '.3f')}, "
      f"{summary['completed']}/{summary['requests']} completed"
    )
  row = {"summary": summary}
  if not isinstance(target, str):  # what the engine's policy measured so far
    row["policy"] = target.metrics()["policy"]
  row["requests"] = [request_record(i, c) for i, c in enumerate(completions)]
  return row


def _fmt(value, spec: str) -> str:
  return "n/a" if value is None else format(value, spec)
