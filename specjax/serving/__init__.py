"""Serving under load: continuous batching with speculation (`Engine`), requests
with their own settings, an adaptive speculation policy, metrics.

  Engine                      the engine (`specjax.serving.engine`): its scheduler,
                              runner and output (`.scheduler`, `.runner`, `.output`)
  EngineConfig, fit_config    its settings, fitted to the models' context (`.config`)
  Request, Event, Completion  what goes in and comes out (`.request`)
  SpeculationCounts           a request's drafted / accepted tokens, by position
  request_key                 the key a seeded request draws with
  SpeculationPolicy           draft length per step (`.policy`; warm-up timing
                              in `.calibration`)
  summarize, percentiles      latency and throughput figures (`.metrics`)
  BackgroundEngine            the engine behind a thread, for servers (`.background`)

On a mesh: `.mesh` (placement), `.lockstep` (one engine across processes).
The batch of slots and its programs: `.batch`, `.slots`, `.rows`; warm-up:
`.warmup`; finished requests: `.store`. Load generation, its report and the
soak measure a server from outside: `specjax.bench.serving`.

The HTTP endpoint (`specjax.serving.http`, FastAPI) needs `pip install 'specjax[serve]'`.
"""

from specjax.serving.background import BackgroundEngine
from specjax.serving.config import EngineConfig, fit_config
from specjax.serving.engine import Engine, request_key
from specjax.serving.metrics import percentiles, summarize
from specjax.serving.policy import SpeculationPolicy
from specjax.serving.request import Completion, Event, Request, SpeculationCounts

__all__ = [
  "BackgroundEngine",
  "Completion",
  "Engine",
  "EngineConfig",
  "Event",
  "Request",
  "SpeculationCounts",
  "SpeculationPolicy",
  "fit_config",
  "percentiles",
  "request_key",
  "summarize",
]
