"""What the server reports about itself: /metrics in the Prometheus text format
(the engine's figures, read at each scrape, and the choices' TTFT / TPOT
histograms as the server saw them), /metrics.json as `Engine.metrics()` gives it."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import numpy as np
import prometheus_client
from fastapi.responses import JSONResponse, Response
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from specjax.serving.background import BackgroundEngine
from specjax.serving.compiler import CompilePool
from specjax.serving.http.errors import APIError
from specjax.serving.http.text import ChoiceText


async def scrape(
  background: BackgroundEngine, prometheus: Prometheus, compiler: CompilePool | None, format: str
) -> Response:
  """The Prometheus text format; `format="json"`: `Engine.metrics()` and the
  constraint compiles (`CompilePool.stats`)."""
  try:
    future = background.call_future(lambda e: e.metrics())
  except RuntimeError:
    raise APIError(503, "the server is shutting down.") from None
  metrics = jsonable(await asyncio.wrap_future(future))
  if format == "json":
    compiles = compiler.stats() if compiler is not None else {"cached": 0}
    return JSONResponse({**metrics, "constraint_compiles": compiles})
  return Response(prometheus.render(metrics), media_type=prometheus_client.CONTENT_TYPE_LATEST)


def jsonable(value: Any) -> Any:
  """`value` with numpy scalars and arrays as Python numbers and lists, and
  non-finite floats as None (JSON has no NaN)."""
  if isinstance(value, dict):
    return {str(k): jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [jsonable(v) for v in value]
  if isinstance(value, np.ndarray):
    return jsonable(value.tolist())
  if isinstance(value, np.generic):
    value = value.item()
  if isinstance(value, float) and not math.isfinite(value):
    return None
  return value


class Prometheus:
  """/metrics in the Prometheus text format: the engine's figures (`Engine.metrics()`,
  read at each scrape) and the choices' TTFT / TPOT histograms, as the server saw them."""

  def __init__(self):
    self.registry, self.snapshot = prometheus_client.CollectorRegistry(), {}
    self.registry.register(self)
    self.ttft, self.tpot = (
      prometheus_client.Histogram(f"specjax_{name}_seconds", doc, registry=self.registry)
      for name, doc in (
        ("time_to_first_token", "Request arrival to a choice's first token."),
        ("time_per_output_token", "A choice's time per token after the first."),
      )
    )

  def observe(self, start: float, choice: ChoiceText) -> None:
    if choice.first_token_time is not None:
      self.ttft.observe(choice.first_token_time - start)
      if choice.tokens > 1:
        self.tpot.observe((time.perf_counter() - choice.first_token_time) / (choice.tokens - 1))

  def render(self, snapshot: dict) -> bytes:
    self.snapshot = snapshot
    return prometheus_client.generate_latest(self.registry)

  def collect(self):
    m = self.snapshot
    if not m:
      return
    requests = CounterMetricFamily("specjax_requests", "Requests by outcome.", labels=["outcome"])
    for outcome in ("submitted", "completed", "cancelled", "failed"):
      requests.add_metric([outcome], m["requests"][outcome])
    steps = CounterMetricFamily(
      "specjax_steps", "Engine steps by draft length (0: plain).", labels=["draft_length"]
    )
    for gamma, count in m["steps"].items():
      steps.add_metric([gamma], count)
    yield from (requests, steps)
    yield CounterMetricFamily("specjax_generated_tokens", "Tokens generated.", m["tokens"])
    spec = m["speculation"]  # what the requests' usage.speculation figures add up to
    for kind, doc in (
      ("drafted", "Drafted tokens offered to the verifier"),
      ("accepted", "Drafted tokens accepted"),
    ):
      yield CounterMetricFamily(f"specjax_{kind}_tokens", f"{doc}.", spec[kind])
      by_position = CounterMetricFamily(
        f"specjax_{kind}_tokens_by_position",
        f"{doc}, by draft position (1: the first drafted token).",
        labels=["position"],
      )
      for i, count in enumerate(spec[f"{kind}_at_position"]):
        by_position.add_metric([str(i + 1)], count)
      yield by_position
    yield CounterMetricFamily(
      "specjax_forced_tokens", "Tokens drafted because a constraint forced them.", spec["forced"]
    )
    for name, doc, value in (
      ("requests_running", "Requests holding a slot.", m["requests"]["live"]),
      ("queue_depth", "Requests waiting for a slot.", m["requests"]["queued"]),
      ("acceptance_rate", "Accepted / evaluated drafted tokens.", m["acceptance_rate"]),
      ("draft_length", "The adaptive policy's draft length in use.", m["policy"]["gamma"]),
    ):
      yield GaugeMetricFamily(f"specjax_{name}", doc, math.nan if value is None else value)
