"""Serving under load: continuous batching with speculation (`Engine`), requests
with their own settings, an adaptive speculation policy, metrics.

  Engine, EngineConfig        the engine (`specjax.serving.engine`)
  fit_config                  prompt buckets and budget fitted to the models' context
  Request, Event, Completion  what goes in and comes out (`.request`)
  SpeculationPolicy           draft length per step (`.policy`)
  summarize, percentiles      latency and throughput figures (`.metrics`)
  BackgroundEngine            the engine behind a thread, for servers (`.background`)

The HTTP endpoint (`specjax.serving.http`, FastAPI) needs `pip install 'specjax[serve]'`.
"""

from specjax.serving.background import BackgroundEngine
from specjax.serving.engine import Engine, EngineConfig, fit_config
from specjax.serving.metrics import percentiles, summarize
from specjax.serving.policy import SpeculationPolicy
from specjax.serving.request import Completion, Event, Request

__all__ = [
  "BackgroundEngine",
  "Completion",
  "Engine",
  "EngineConfig",
  "Event",
  "Request",
  "SpeculationPolicy",
  "fit_config",
  "percentiles",
  "summarize",
]
