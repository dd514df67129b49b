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
import dataclasses
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


@dataclasses.dataclass
class _Tally:
  """What a soak records while it runs; times are perf_counter seconds, or
  seconds from `start` where named so."""

  start: float
  # Answers by HTTP status, or by exception name for a dropped connection.
  statuses: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  hostile_statuses: dict[str, collections.Counter] = dataclasses.field(
    default_factory=lambda: collections.defaultdict(collections.Counter)
  )
  ttfts: list[float] = dataclasses.field(default_factory=list)
  tokens: int = 0  # the normal requests' completion tokens
  last_s: float = 0.0  # when the last normal request finished
  health: list[tuple[float, float, bool]] = dataclasses.field(default_factory=list)  # (s, ms, ok)
  rss: list[tuple[float, float | None]] = dataclasses.field(default_factory=list)  # (s, MB)


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
  schedule = _arrivals(duration_s, rate, hostile, seed)
  auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
  run = _soak(
    url.rstrip("/"), auth, list(prompts), schedule, max_new_tokens, pid, health_every_s, rss_every_s
  )
  tally, elapsed, end = asyncio.run(run)
  figures = {"duration_s": duration_s, "rate": rate, "hostile": hostile}
  return {**figures, "arrivals": len(schedule), **_figures(tally, elapsed, end)}


def _arrivals(duration_s: float, rate: float, hostile: float, seed: int):
  """Two Poisson streams over `duration_s`, merged in time order: `[(t, stream,
  k)]`, the k-th arrival (its prompt, its kind) of stream 0 (normal, `rate` per
  second) or 1 (hostile, `hostile` per second). Stream 0 draws from its own
  generator, so it is the same in every run of a `seed`."""
  arrivals = []
  for stream, per_s in ((0, rate), (1, hostile)):
    times, t, k = random.Random(seed * 2 + stream), 0.0, 0
    while per_s > 0:
      t += times.expovariate(per_s)
      if t >= duration_s:
        break
      arrivals.append((t, stream, k))
      k += 1
  return sorted(arrivals, key=lambda a: a[0])


async def _soak(url, auth, prompts, schedule, max_new_tokens, pid, health_s, rss_s):
  """Sends `schedule` while polling /health and the server's memory; returns
  `(tally, elapsed seconds, the server's /metrics.json at the end)`."""
  import httpx

  tally = _Tally(start=time.perf_counter())
  done = asyncio.Event()
  limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
  async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
    pollers = [
      asyncio.create_task(_poll_health(client, tally, done, health_s)),
      asyncio.create_task(_poll_rss(pid, tally, done, rss_s)),
    ]
    tasks = []
    for t, stream, k in schedule:
      await asyncio.sleep(max(0.0, tally.start + t - time.perf_counter()))
      prompt = prompts[k % len(prompts)]
      if stream == 0:
        job = _normal(client, auth, tally, prompt, max_new_tokens)
      else:
        job = _hostile(client, auth, tally, k, prompt)
      tasks.append(asyncio.create_task(_counted(job, tally)))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - tally.start
    done.set()
    await asyncio.gather(*pollers)
    end = (await client.get("/metrics.json", headers=auth)).json()
  return tally, elapsed, end


async def _normal(client, auth, tally: _Tally, prompt: str, max_new_tokens: int) -> None:
  """One normal request, streamed and greedy: its TTFT (the first chunk with
  text) and completion tokens."""
  body = {"prompt": prompt, "max_tokens": max_new_tokens, "temperature": 0}
  body.update(stream=True, stream_options={"include_usage": True})
  sent = time.perf_counter()
  first = None
  async with client.stream("POST", "/v1/completions", json=body, headers=auth) as response:
    tally.statuses[response.status_code] += 1
    async for line in response.aiter_lines():
      if not line.startswith("data: {"):
        continue
      data = json.loads(line[6:])
      if first is None and data.get("choices") and data["choices"][0].get("text"):
        first = time.perf_counter()
      if data.get("usage"):
        tally.tokens += data["usage"]["completion_tokens"]
  if first is not None:
    tally.ttfts.append(first - sent)
  tally.last_s = max(tally.last_s, time.perf_counter() - tally.start)


async def _hostile(client, auth, tally: _Tally, index: int, prompt: str) -> None:
  """The `index`-th hostile request (the kinds of `HOSTILE` in turn): its status."""
  kind = HOSTILE[index % len(HOSTILE)]
  raw, headers, leave = _hostile_request(kind, index, prompt)
  async with client.stream(
    "POST", "/v1/completions", content=raw, headers={**headers, **auth}
  ) as response:
    tally.statuses[response.status_code] += 1
    tally.hostile_statuses[kind][response.status_code] += 1
    async for _ in response.aiter_lines():
      if leave:
        break  # closing the stream drops the connection mid-answer


async def _counted(job, tally: _Tally) -> None:
  """Awaits `job`; a dropped connection is counted by its name, not raised."""
  import httpx

  try:
    await job
  except httpx.HTTPError as e:
    tally.statuses[type(e).__name__] += 1


async def _poll_health(client, tally: _Tally, done: asyncio.Event, every_s: float) -> None:
  """GET /health every `every_s` until `done`: when sent, how long, whether 200."""
  import httpx

  while not done.is_set():
    sent = time.perf_counter()
    try:
      ok = (await client.get("/health", timeout=30)).status_code == 200
    except httpx.HTTPError:
      ok = False
    tally.health.append((sent - tally.start, (time.perf_counter() - sent) * 1e3, ok))
    await asyncio.sleep(every_s)


async def _poll_rss(pid: int | None, tally: _Tally, done: asyncio.Event, every_s: float) -> None:
  """The server's resident memory every `every_s` until `done` (none without `pid`)."""
  while pid is not None and not done.is_set():
    tally.rss.append((time.perf_counter() - tally.start, _rss_mb(pid)))
    await asyncio.sleep(every_s)


def _figures(tally: _Tally, elapsed: float, end: dict) -> dict[str, Any]:
  """A soak's figures from what it recorded and the server's /metrics.json at its end."""
  statuses = tally.statuses
  five = sum(n for code, n in statuses.items() if isinstance(code, int) and code >= 500)
  latencies = [ms for _, ms, _ in tally.health]
  memory = [m for _, m in tally.rss if m is not None]
  return {
    "normal_requests": len(tally.ttfts),
    "ttft_p50_ms": _pct(tally.ttfts, 50) * 1e3,
    "ttft_p99_ms": _pct(tally.ttfts, 99) * 1e3,
    # Over the normal requests' own span: the soak's end waits for the slowest
    # hostile request (a compile up to its time limit), which is no normal work.
    "throughput_tok_s": tally.tokens / tally.last_s if tally.last_s else 0.0,
    "elapsed_s": elapsed,
    "health_max_ms": max(latencies, default=float("nan")),
    "health_p99_ms": _pct(latencies, 99),
    "health_failures": sum(not ok for *_, ok in tally.health),
    "server_5xx": five,
    "statuses": {str(k): v for k, v in sorted(statuses.items(), key=str)},
    "hostile_statuses": {k: dict(v) for k, v in tally.hostile_statuses.items()},
    "live_at_end": end["requests"]["live"],
    "queued_at_end": end["requests"]["queued"],
    "compile_cache": end.get("constraint_compiles", {}),
    "rss_mb": tally.rss,
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
