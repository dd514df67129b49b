"""The engine's warm-up: every program compiled, each step program timed.

`warm_up` compiles the prefill programs (per prompt bucket), the row programs
(move, release, the constraint table's shift) and the step programs (per draft
length and batch width), so that no request compiles anything after it. It
times the step programs for the speculation policy
(`specjax.serving.calibration`: runs of `policy.window` steps per draft
length, taking turns, from a batch whose every slot is live with a whole
budget) and, with `EngineConfig.verify_lengths`, the cost of each verify
length (`Runner.verify`). Live requests' rows are kept aside and put back.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax.generation.verify_length import lengths_up_to, relative_costs
from specjax.sampling import GREEDY, RowSampling
from specjax.serving import slots
from specjax.serving.batch import SlotState
from specjax.serving.calibration import WidthTimes, calibrate_width, time_in_runs
from specjax.serving.config import EngineConfig
from specjax.serving.policy import SpeculationPolicy
from specjax.serving.runner import SAME, Runner

# The engine's logger: warm-up is what `Engine.warmup` reports.
logger = logging.getLogger("specjax.serving.engine")


def warm_up(
  runner: Runner,
  policy: SpeculationPolicy,
  config: EngineConfig,
  timed_runs: int,
  progress: Callable[[str], None] | None,
  keep: bool,
) -> dict[str, float]:
  """`Engine.warmup` on the engine's runner and policy (`keep`: live requests'
  rows are kept aside and put back). Returns seconds per step program, by
  "gamma=G,width=W"."""
  # The programs donate their input: live requests' rows are kept aside (a
  # batch of free slots is simply rebuilt), so warm-up holds at most three
  # batches of caches at once.
  kept = runner.state if keep else None
  if kept is not None:
    runner.state = jax.tree.map(jnp.copy, kept)
  warm = _Warmup(runner, policy, config, progress or logger.info)
  with runner.on_mesh():
    times = warm.run(timed_runs)
    runner.state = jax.block_until_ready(kept) if kept is not None else runner.blank()
  return times


@dataclasses.dataclass
class _Warmup:
  runner: Runner
  policy: SpeculationPolicy
  config: EngineConfig
  progress: Callable[[str], None]

  def run(self, timed_runs: int) -> dict[str, float]:
    started = time.perf_counter()
    lengths, widths = self.config.draft_lengths, self.config.step_widths
    self.progress(
      f"warm-up: compiling prefills for prompt widths {self.config.prompt_buckets}, then "
      f"steps of draft lengths {lengths} at batch widths {widths}"
    )
    live = self.compile_admissions()
    self.progress(f"warm-up: prefills compiled ({time.perf_counter() - started:.1f} s)")
    times = {}
    for i, width in enumerate(widths):
      width_start = time.perf_counter()
      self.restart(live, width, resync=self.runner.drafter is not None and 0 in lengths)
      if self.config.verify_lengths is not None:
        self.measure_verify_costs(live, width, max(timed_runs, 1))
      result = calibrate_width(
        self.policy,
        width,
        lengths,
        timed_runs,
        run_step=self.blocking_step,
        restart=functools.partial(self.restart, live, width),
      )
      times.update({f"gamma={g},width={width}": s for g, s in result.step.items()})
      line = f"warm-up: batch width {width} ({i + 1}/{len(widths)}): "
      line += _timing_line(result, timed_runs, time.perf_counter() - width_start)
      self.progress(f"{line}; {time.perf_counter() - started:.1f} s so far")
    return times

  def compile_admissions(self) -> SlotState:
    """Compiles the prefill (per prompt bucket), move and release programs;
    returns the batch with every slot admitted (a whole budget each), from
    which each timed run of steps starts."""
    runner = self.runner
    plain_too = runner.drafter is not None and 0 in self.config.draft_lengths
    for width in self.config.prompt_buckets:  # prefill programs per bucket
      self.admit(0, width, 1)
      if plain_too:
        self.admit(0, width, 1, target_only=True)  # admission while plain steps run
    runner.move(0, 0)
    runner.release(np.zeros((self.config.slots,), bool))
    if runner.placement is not None:  # packing the table shifts live rows' states
      runner.shift_constraints(np.zeros((self.config.slots,), np.int32))
    for slot in range(self.config.slots):
      self.admit(slot, self.config.prompt_buckets[0], self.config.max_new_tokens)
    return jax.block_until_ready(runner.state)

  def admit(self, slot: int, width: int, budget: int, target_only: bool = False) -> None:
    """Admits a dummy greedy request (prompt width `width`) into `slot`."""
    runner = self.runner
    inputs = (
      np.int32(slot),
      np.zeros((1, width), np.int32),
      np.ones((1,), np.int32),
      np.full((1,), budget, np.int32),
      np.full((1,), -1, np.int32),
      RowSampling.of([GREEDY]),
    )
    rest = (np.zeros((1, 2), np.uint32), np.asarray(False), np.asarray([runner.gamma], np.int32))
    runner.state = slots.admit(
      runner.target,
      None if target_only else runner.drafter,
      runner.state,
      *runner.put(inputs),
      runner.key,
      *runner.put(rest),
      runner.table(),
      runner.free_start(1),
      config=runner.slot_config,
    )

  def restart(self, live: SlotState, width: int, resync: bool = False) -> None:
    """The batch becomes a copy of `live` (donated programs consume their
    input); `resync` rebuilds the drafter's state for the first `width` rows."""
    runner = self.runner
    runner.state = jax.tree.map(jnp.copy, live)
    if resync:
      runner.state = slots.resync(
        runner.target, runner.drafter, runner.state, width=width, config=runner.slot_config
      )

  def blocking_step(self, gamma: int, width: int, verify=SAME) -> None:
    """One step of the warm-up's batch, waited for."""
    runner = self.runner
    jax.block_until_ready(runner.step(gamma, width, runner.key, verify=verify))

  def measure_verify_costs(self, live: SlotState, width: int, timed_runs: int) -> None:
    """Times each drafting step at `width` verifying each of its verify lengths k
    (a program verifying k every step; the calibration's runs, `time_in_runs`);
    the step programs then choose among those lengths by these costs."""
    for gamma in self.config.draft_lengths:
      ks = lengths_up_to(self.config.verify_lengths, gamma) if gamma else ()
      if len(ks) < 2:
        continue
      # Verifying gamma is the program without verify lengths.
      forced = {k: None if k == gamma else ((k,), (1.0,)) for k in ks}
      _, seconds = time_in_runs(
        ks,
        timed_runs,
        self.policy.window,
        lambda k, gamma=gamma, forced=forced: self.blocking_step(gamma, width, forced[k]),
        functools.partial(self.restart, live, width),
      )
      costs = relative_costs([seconds[k] for k in ks])
      self.runner.verify[gamma, width] = (ks, costs)
      line = ", ".join(f"k={k} {c:.2f}" for k, c in zip(ks, costs))
      self.progress(f"warm-up: width {width}, gamma={gamma}: verify costs {line}")


def _timing_line(result: WidthTimes, timed_runs: int, seconds: float) -> str:
  """What warm-up reports for one width: compile seconds, then (timed) the
  timing's seconds and each draft length's step time."""
  compiling = sum(result.compiled.values())
  line = f"compiled in {compiling:.1f} s"
  if timed_runs > 0:
    steps = ", ".join(f"gamma={g} {s * 1e3:.1f}" for g, s in result.step.items())
    line += f", timed in {seconds - compiling:.1f} s (ms a step: {steps})"
  return line
