"""Warm-up calibration of the speculation policy: each step program timed in runs.

At each batch width the draft lengths take turns in runs of `policy.window`
consecutive steps, `timed_runs` runs each (and one more of the first to
close). Every step is fed to the policy as a live one would be, so it takes
each run's median over its neighbour's as a cost ratio rho, as it does while
serving. Steps taking turns one by one would not do: right after a drafting
step a plain step runs slower than within a run of plain steps, and the ratios
would come out too low (docs/serving.md gives the measured figures).

The engine owns the programs and the batch; this module owns the timing: it
gets a function that runs one blocking step and one that restores the batch.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence

from specjax.serving.policy import SpeculationPolicy


@dataclasses.dataclass(frozen=True)
class WidthTimes:
  """One width's calibration: seconds of each draft length's compiling step
  and its step time (the fastest run's median; without timed runs, the
  compiling step's), by draft length."""

  compiled: dict[int, float]
  step: dict[int, float]


def timed(run_step: Callable[[int, int], object], gamma: int, width: int) -> float:
  """Seconds `run_step(gamma, width)` takes (it returns once the step is done)."""
  start = time.perf_counter()
  run_step(gamma, width)
  return time.perf_counter() - start


def calibrate_width(
  policy: SpeculationPolicy,
  width: int,
  lengths: Sequence[int],
  timed_runs: int,
  run_step: Callable[[int, int], object],
  restart: Callable[[], None],
) -> WidthTimes:
  """Compiles and times the step programs of `lengths` at `width`.

  Args:
    policy: takes every timed step (`observe`), each run's ratio and the
      step times (`step_time[gamma, width]`).
    width: the batch width the steps run at.
    lengths: the draft lengths (0 = a plain step); the first step of each
      compiles its program.
    timed_runs: runs per draft length (0: compile only).
    run_step: runs one step of `(gamma, width)` on the engine's batch and
      blocks until it is done.
    restart: puts the batch back as it was before the first run (every row
      live with its whole budget, as under load: on finished rows a drafter
      stops early and the step is cheaper).
  """
  compiled = {gamma: timed(run_step, gamma, width) for gamma in lengths}
  medians: dict[int, list[float]] = {gamma: [] for gamma in lengths}
  turns = list(lengths) * timed_runs + list(lengths[:1]) * (timed_runs > 0)
  for gamma in turns:
    restart()  # each run starts from live rows
    seconds = []
    for _ in range(policy.window):
      seconds.append(timed(run_step, gamma, width))
      policy.observe(gamma, width, seconds[-1], 0, 0)
    medians[gamma].append(statistics.median(seconds))
  policy.end_runs(width)
  step = {}
  for gamma in lengths:
    # The fastest run: noise on a shared machine only adds time.
    step[gamma] = min(medians[gamma], default=compiled[gamma])
    policy.step_time[gamma, width] = step[gamma]
  return WidthTimes(compiled, step)
