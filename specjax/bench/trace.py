"""A `jax.profiler` trace of a call, read back: the device's busy time against the
wall time, and the kernels that cost most.

On a GPU (or TPU) the trace has a device timeline (`/device:GPU:0`: one line per
stream, each kernel an event), so `busy_ms` is the time some kernel ran. A CPU
has none: XLA:CPU's thunks appear as host events (tagged `hlo_op`) on its
thread pool, and the summary says so (`timeline: "host"`) — busy there means
some thunk ran, which is not a device's idle time. Why it matters:
docs/performance.md ("On the accelerator").
"""

from __future__ import annotations

import collections
import glob
import os
import re
import time
from collections.abc import Callable
from typing import Any

import jax

# Lines the profiler derives from the kernels themselves (a kernel would count twice).
_DERIVED_LINES = (
  "XLA Modules",
  "XLA Ops",
  "XLA TraceMe",
  "Steps",
  "TensorFlow Ops",
  "TensorFlow Name Scope",
  "Framework Name Scope",
  "Framework Ops",
  "Source code",
  "Launch Stats",
  "SparseCore",
)

_CONTROL = re.compile(r"^(while|conditional|call)(\.\d+)?$")


def trace_call(fn: Callable[[], Any], trace_dir: str, repeats: int = 1) -> dict[str, Any]:
  """Runs `fn` once untraced (compile, warm-up), then `repeats` times under
  `jax.profiler.trace(trace_dir)`; the trace stays there (TensorBoard / XProf /
  Perfetto read it). Returns `summarize(...)` of it with `wall_ms`: the
  traced calls' wall time, start to the last result."""
  jax.block_until_ready(fn())
  os.makedirs(trace_dir, exist_ok=True)
  with jax.profiler.trace(trace_dir):
    start = time.perf_counter()
    for _ in range(repeats):
      out = fn()
    jax.block_until_ready(out)
    wall_s = time.perf_counter() - start
  return summarize(latest_trace(trace_dir), wall_s=wall_s)


def latest_trace(trace_dir: str) -> str:
  """The newest `*.xplane.pb` under `trace_dir`."""
  found = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
  if not found:
    raise FileNotFoundError(f"no *.xplane.pb under {trace_dir}")
  return max(found, key=os.path.getmtime)


def _busy_ns(intervals: list[tuple[float, float]]) -> float:
  """Length of the union of `(start, end)` intervals (streams or threads overlap)."""
  busy, end = 0.0, float("-inf")
  for s, e in sorted(intervals):
    if e <= end:
      continue
    busy += e - max(s, end)
    end = e
  return busy


def _events(data) -> tuple[str, list]:
  """`(timeline, events)`: the device planes' kernels, else XLA's host thunks."""
  device = [p for p in data.planes if p.name.startswith("/device:")]
  events = [
    e
    for plane in device
    for line in plane.lines
    if not line.name.startswith(_DERIVED_LINES)
    for e in line.events
  ]
  if events:
    return "device", events
  # A loop's or a call's own thunk spans the thunks it runs: left out.
  host = [
    e
    for plane in data.planes
    if plane.name.startswith("/host:")
    for line in plane.lines
    for e in line.events
    if any(k == "hlo_op" for k, _ in e.stats) and not _CONTROL.match(e.name)
  ]
  return "host", host


def summarize(trace, wall_s: float | None = None, top: int = 10) -> dict[str, Any]:
  """The kernels of one trace: a file (`*.xplane.pb`) or a `jax.profiler.ProfileData`.

  Returns:
    `timeline` ("device", or "host": a CPU, no device timeline, XLA's thunks
    instead), `trace` (the file, if one), `kernel_events`, `busy_ms` (union of the
    kernels' intervals), `span_ms` (first start to last end), with `wall_s`
    also `wall_ms` and `busy_fraction` (busy / wall), `graph_launches` (CUDA
    graph launches seen on any plane: command buffers at work), and
    `top_kernels`: the `top` costliest kernel names with `calls`, `total_ms`
    and `share` of the summed kernel time.
  """
  path = trace if isinstance(trace, str) else None
  data = jax.profiler.ProfileData.from_file(trace) if path else trace
  timeline, events = _events(data)
  intervals = [(e.start_ns, e.start_ns + e.duration_ns) for e in events]
  busy_ns = _busy_ns(intervals)
  by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
  for e in events:
    by_name[e.name][0] += 1
    by_name[e.name][1] += e.duration_ns
  total_ns = sum(v[1] for v in by_name.values()) or 1.0
  ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
  graph_launches = sum(
    1
    for plane in data.planes
    for line in plane.lines
    for e in line.events
    if "graphlaunch" in e.name.lower()
  )
  out: dict[str, Any] = {
    "timeline": timeline,
    "trace": path,
    "kernel_events": len(events),
    "busy_ms": busy_ns / 1e6,
    "span_ms": (max(e for _, e in intervals) - min(s for s, _ in intervals)) / 1e6
    if intervals
    else 0.0,
    "graph_launches": graph_launches,
    "top_kernels": [
      {"name": name, "calls": calls, "total_ms": ns / 1e6, "share": ns / total_ns}
      for name, (calls, ns) in ranked
    ],
  }
  if wall_s is not None:
    out["wall_ms"] = wall_s * 1e3
    out["busy_fraction"] = busy_ns / 1e9 / wall_s if wall_s > 0 else None
  if timeline == "host":
    out["note"] = (
      "no device timeline on this backend: XLA's host thunks stand in for kernels, "
      "and busy time is thunk time on any pool thread"
    )
  return out
