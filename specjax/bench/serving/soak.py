"""A soak under hostility: normal requests at a fixed rate, for a fixed time,
mixed with hostile ones, against a running server (`specjax.serving.http`).

  calm = soak(url, prompts, duration_s=60, rate=2, hostile=0.0)
  rough = soak(url, prompts, duration_s=60, rate=2, hostile=2.0, pid=server_pid)

The normal requests arrive at the same times in both runs (Poisson, `rate`
per second, from `seed`); the hostile ones are a second stream on top
(`hostile` per second), so the two runs' normal figures compare directly.

The hostile requests are issue 63's reproductions and their kin, taking turns
(`HOSTILE`): a regex bomb, a regex that passes the cheap checks but compiles
slowly, a long stop string, a body nested 50,000 deep, a text/plain body, a
prompt of a megabyte, a JSON schema never seen before (a real compile each),
and a client that leaves mid-stream. Reported: the normal requests' TTFT
(p50 / p99) and output throughput, /health latency sampled every
`health_every_s` throughout, the count of 5xx answers, the slots and compile
cache at the end (/metrics.json) and the server's resident memory over time
(/proc/PID/status, when `pid` is given and local).
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

HOSTILE = (
  "regex_bomb",
  "slow_regex",
  "long_stop",
  "deep_nesting",
  "text_plain",
  "huge_prompt",
  "new_schema",
  "disconnect",
)
_JSON = {"Content-Type": "application/json"}


def _hostile_request(kind: str, index: int, prompt: str) -> tuple[bytes, dict, bool]:
  """`(body, headers, leave_early)` of one hostile request of `kind`."""
  body: dict[str, Any] = {"prompt": prompt, "max_tokens": 8}
  headers, leave = dict(_JSON), False
  if kind == "regex_bomb":
    body["guided_regex"] = "a{300000}"
  elif kind == "slow_regex":
    body["guided_regex"] = "(.{0,40}){0,25}x"
  elif kind == "long_stop":
    body.update(stop=["q" * 256], stream=True, max_tokens=32)
  elif kind == "deep_nesting":
    return b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", headers, False
  elif kind == "text_plain":
    headers["Content-Type"] = "text/plain"
  elif kind == "huge_prompt":
    body["prompt"] = "x" * (900 << 10)
  elif kind == "new_schema":  # distinct field names: never in the cache
    fields = {f"f{index}_{i}": {"type": "integer"} for i in range(3)}
    schema = {"type": "object", "properties": fields, "required": list(fields)}
    body["response_format"] = {
      "type": "json_schema",
      "json_schema": {"name": "s", "schema": schema},
    }
  elif kind == "disconnect":
    body.update(stream=True, max_tokens=64)
    leave = True
  return json.dumps(body).encode(), headers, leave


def _rss_mb(pid: int) -> float | None:
  try:
    with open(f"/proc/{pid}/status") as f:
      for line in f:
        if line.startswith("VmRSS:"):
          return int(line.split()[1]) / 1024
  except OSError:
    return None
  return None


def soak(
  url: str,
  prompts: Sequence[str],
  *,
  duration_s: float,
  rate: float,
  hostile: float = 0.0,
  max_new_tokens: int = 32,
  seed: int = 0,
  pid: int | None = None,
  api_key: str | None = None,
  health_every_s: float = 0.5,
  rss_every_s: float = 1.0,
) -> dict[str, Any]:
  """Runs one soak (see the module doc) and returns its figures.

  Args:
    url: the server (http://host:port).
    prompts: the normal requests' prompts, taken in turn.
    duration_s, rate: arrivals (Poisson, `rate` per second) during `duration_s`;
      the soak then waits for the answers.
    hostile: hostile requests per second, on top of the normal ones (0: a calm run).
    max_new_tokens: each normal request's budget (streamed, greedy).
    pid: the server's process id on this machine, for its resident memory.
    api_key: sent as a Bearer token.
  """
  if not duration_s > 0 or not rate > 0 or not hostile >= 0 or not prompts:
    raise ValueError(
      "soak needs duration_s > 0, rate > 0, hostile >= 0 and prompts, got "
      f"{duration_s!r}, {rate!r}, {hostile!r}, {len(prompts)} prompts."
    )
  return asyncio.run(
    _soak(url.rstrip("/"), list(prompts), duration_s, rate, hostile, max_new_tokens, seed, pid,
          api_key, health_every_s, rss_every_s)
  )  # fmt: skip


async def _soak(
  url, prompts, duration_s, rate, hostile, max_new_tokens, seed, pid, api_key, health_s, rss_s
):
  import httpx

  auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
  statuses: collections.Counter = collections.Counter()
  hostile_statuses: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
  ttfts, tokens, health, rss = [], [0], [], []
  last = [0.0]  # when the last normal request finished
  start = time.perf_counter()
  done = asyncio.Event()
  limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)

  async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

    async def normal(i: int) -> None:
      body = {"prompt": prompts[i % len(prompts)], "max_tokens": max_new_tokens, "temperature": 0}
      body.update(stream=True, stream_options={"include_usage": True})
      sent = time.perf_counter()
      first = None
      async with client.stream("POST", "/v1/completions", json=body, headers=auth) as response:
        statuses[response.status_code] += 1
        async for line in response.aiter_lines():
          if not line.startswith("data: {"):
            continue
          data = json.loads(line[6:])
          if first is None and data.get("choices") and data["choices"][0].get("text"):
            first = time.perf_counter()
          if data.get("usage"):
            tokens[0] += data["usage"]["completion_tokens"]
      if first is not None:
        ttfts.append(first - sent)
      last[0] = max(last[0], time.perf_counter() - start)

    async def rough(i: int) -> None:
      kind = HOSTILE[i % len(HOSTILE)]
      raw, headers, leave = _hostile_request(kind, i, prompts[i % len(prompts)])
      async with client.stream(
        "POST", "/v1/completions", content=raw, headers={**headers, **auth}
      ) as response:
        statuses[response.status_code] += 1
        hostile_statuses[kind][response.status_code] += 1
        async for _ in response.aiter_lines():
          if leave:
            break  # closing the stream drops the connection mid-answer

    async def poll_health() -> None:
      while not done.is_set():
        sent = time.perf_counter()
        try:
          ok = (await client.get("/health", timeout=30)).status_code == 200
        except httpx.HTTPError:
          ok = False
        health.append((sent - start, (time.perf_counter() - sent) * 1e3, ok))
        await asyncio.sleep(health_s)

    async def poll_rss() -> None:
      while pid is not None and not done.is_set():
        rss.append((time.perf_counter() - start, _rss_mb(pid)))
        await asyncio.sleep(rss_s)

    async def guarded(coroutine) -> None:
      try:
        await coroutine
      except httpx.HTTPError as e:  # a dropped connection: counted, not raised
        statuses[type(e).__name__] += 1

    pollers = [asyncio.create_task(poll_health()), asyncio.create_task(poll_rss())]
    # Two Poisson streams, merged: the normal one the same in every run.
    arrivals = []
    for stream, per_s, job in ((0, rate, normal), (1, hostile, rough)):
      times, t, k = random.Random(seed * 2 + stream), 0.0, 0
      while per_s > 0:
        t += times.expovariate(per_s)
        if t >= duration_s:
          break
        arrivals.append((t, job, k))  # the k-th of its stream: its prompt, its kind
        k += 1
    arrivals.sort(key=lambda a: a[0])
    tasks = []
    for t, job, k in arrivals:
      await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
      tasks.append(asyncio.create_task(guarded(job(k))))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    done.set()
    await asyncio.gather(*pollers)
    end = (await client.get("/metrics.json", headers=auth)).json()

  five = sum(n for code, n in statuses.items() if isinstance(code, int) and code >= 500)
  latencies = [ms for _, ms, _ in health]
  memory = [m for _, m in rss if m is not None]
  return {
    "duration_s": duration_s,
    "rate": rate,
    "hostile": hostile,
    "arrivals": len(arrivals),
    "normal_requests": len(ttfts),
    "ttft_p50_ms": _pct(ttfts, 50) * 1e3,
    "ttft_p99_ms": _pct(ttfts, 99) * 1e3,
    # Over the normal requests' own span: the soak's end waits for the slowest
    # hostile request (a compile up to its time limit), which is no normal work.
    "throughput_tok_s": tokens[0] / last[0] if last[0] else 0.0,
    "elapsed_s": elapsed,
    "health_max_ms": max(latencies, default=float("nan")),
    "health_p99_ms": _pct(latencies, 99),
    "health_failures": sum(not ok for *_, ok in health),
    "server_5xx": five,
    "statuses": {str(k): v for k, v in sorted(statuses.items(), key=str)},
    "hostile_statuses": {k: dict(v) for k, v in hostile_statuses.items()},
    "live_at_end": end["requests"]["live"],
    "queued_at_end": end["requests"]["queued"],
    "compile_cache": end.get("constraint_compiles", {}),
    "rss_mb": rss,
    "rss_first_mb": memory[0] if memory else None,
    "rss_last_mb": memory[-1] if memory else None,
    "rss_max_mb": max(memory, default=None),
  }


def _pct(values, q: float) -> float:
  return float(np.percentile(values, q)) if len(values) else float("nan")


def soak_table(calm: dict, rough: dict) -> str:
  """The two runs side by side, in markdown."""
  rows = [
    ("normal requests", "normal_requests", "{:.0f}"),
    ("TTFT p50 (ms)", "ttft_p50_ms", "{:.0f}"),
    ("TTFT p99 (ms)", "ttft_p99_ms", "{:.0f}"),
    ("throughput (tok/s)", "throughput_tok_s", "{:.1f}"),
    ("/health max (ms)", "health_max_ms", "{:.1f}"),
    ("/health p99 (ms)", "health_p99_ms", "{:.1f}"),
    ("5xx answers", "server_5xx", "{:.0f}"),
    ("live / queued at end", None, None),
    ("compile cache at end", None, None),
    ("server RSS first / last / max (MB)", None, None),
  ]
  lines = ["| | calm | hostile mix |", "|---|---|---|"]
  for title, key, spec in rows:
    cells = []
    for run in (calm, rough):
      if key is not None:
        cells.append(spec.format(run[key]))
      elif title.startswith("live"):
        cells.append(f"{run['live_at_end']} / {run['queued_at_end']}")
      elif title.startswith("compile"):
        cache = run["compile_cache"]
        cells.append(
          f"{cache.get('cached', 0)} automata, {cache.get('cache_bytes', 0) / 1e6:.2f} MB"
        )
      else:
        rss = [run[k] for k in ("rss_first_mb", "rss_last_mb", "rss_max_mb")]
        cells.append(" / ".join("-" if m is None else f"{m:.0f}" for m in rss))
    lines.append(f"| {title} | {cells[0]} | {cells[1]} |")
  ratio = rough["ttft_p99_ms"] / calm["ttft_p99_ms"] if calm["ttft_p99_ms"] else float("nan")
  lines.append(f"| p99 TTFT, hostile / calm | | {ratio:.2f} |")
  return "\n".join(lines)
