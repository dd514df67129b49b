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
`time_in_runs` is the timing alone, which the engine also uses for the costs of
its verify lengths (`EngineConfig.verify_lengths`).
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


def timed(run: Callable[..., object], *args) -> float:
  """Seconds `run(*args)` takes (it returns once the step is done)."""
  start = time.perf_counter()
  run(*args)
  return time.perf_counter() - start


def time_in_runs(
  variants: Sequence,
  timed_runs: int,
  window: int,
  run_step: Callable[[object], object],
  restart: Callable[[], None],
  observe: Callable[[object, float], None] | None = None,
) -> tuple[dict, dict]:
  """Compiles and times step programs in runs of `window` consecutive steps.

  Each variant's first step compiles its program; then the variants take turns,
  `timed_runs` runs each and one more of the first to close, each run from the
  batch `restart` puts back. `run_step(variant)` runs one blocking step;
  `observe(variant, seconds)` sees every timed step.

  Returns:
    `(compiled, step)`, by variant: the compiling step's seconds, and the fastest
    run's median (noise on a shared machine only adds time; without timed runs,
    the compiling step's).
  """
  compiled = {v: timed(run_step, v) for v in variants}
  medians: dict = {v: [] for v in variants}
  turns = list(variants) * timed_runs + list(variants[:1]) * (timed_runs > 0)
  for v in turns:
    restart()  # each run starts from live rows
    seconds = []
    for _ in range(window):
      seconds.append(timed(run_step, v))
      if observe is not None:
        observe(v, seconds[-1])
    medians[v].append(statistics.median(seconds))
  return compiled, {v: min(medians[v], default=compiled[v]) for v in variants}


def calibrate_width(
  policy: SpeculationPolicy,
  width: int,
  lengths: Sequence[int],
  timed_runs: int,
  run_step: Callable[[int, int], object],
  restart: Callable[[], None],
) -> WidthTimes:
  """Compiles and times the step programs of `lengths` at `width` (`time_in_runs`).

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
  compiled, step = time_in_runs(
    lengths,
    timed_runs,
    policy.window,
    lambda gamma: run_step(gamma, width),
    restart,
    observe=lambda gamma, seconds: policy.observe(gamma, width, seconds, 0, 0),
  )
  policy.end_runs(width)
  for gamma in lengths:
    policy.step_time[gamma, width] = step[gamma]
  return WidthTimes(compiled, step)
