"""How many tokens to draft per engine step, from the live batch and measured acceptance.

Speculation trades compute for fewer target passes. At a light load the target
is a small batch and drafting gamma tokens per row nearly doubles the tokens
per step; at a full batch every row's gamma + 1 scored positions make the step
dearer and speculation can lose (vLLM users report exactly that, vllm#17984).

`SpeculationPolicy.choose` picks the draft length of each step among the
engine's compiled ones (0 = one plain autoregressive step) for the batch width
the step runs at. The adaptive policy is SmartSpec's goodput estimate (Liu et
al. 2024, arXiv 2406.14066) with measured inputs:

    goodput(gamma) = live rows x E(alpha, gamma) / t(gamma, width)

E(alpha, gamma) is the tokens a row commits per step: Leviathan et al.'s
(1 - alpha^(gamma+1)) / (1 - alpha) (`specjax.theory.expected_tokens_per_iteration`)
at the measured acceptance alpha (accepted / evaluated drafted tokens,
decayed counts). (Counting the committed tokens per row-step instead, which
budgets and non-i.i.d. acceptance make differ from the formula, showed no
gain in the load test and was removed.) Compute is static per width, so the
live rows cancel within one width; the load enters through the width, as in
SmartSpec's batch-size term.

t(gamma, width) enters only as a ratio to a plain step's time at that width,
rho(gamma, width) = t(gamma) / t(0), measured from steps that ran next to
each other: times taken apart drift on a shared machine by more than the
few percent the choice at a full batch hangs on (docs/serving.md gives the
measured spread). rho is the median of the last `window` ratios: first
warm-up's (`specjax.serving.calibration`: runs of each draft length in turn,
every row live), then live ones. Every `probe_every` steps the policy runs
`probe_steps` steps of another draft length (in turn), whichever it uses;
the median time of a run of steps over that of the run before it at that
width is one live ratio, so a probe gives two.

For its first `explore_steps` drafting steps the policy drafts, to measure
alpha: a few early unlucky steps must not send it to plain decoding.
Hysteresis keeps it from flapping: a switch needs a predicted gain above
`margin`. (A wait between reconsidering drafting after plain steps, and
probes spaced further apart each time they confirmed the choice, showed no
gain in the load test and were removed.)
"""

from __future__ import annotations

import collections
import dataclasses
import statistics

from specjax.theory import expected_tokens_per_iteration

POLICIES = ("never", "always", "adaptive")


@dataclasses.dataclass
class SpeculationPolicy:
  """Chooses each step's draft length among `gammas` (sorted, 0 = plain decoding).

  Attributes:
    kind: "never" (always 0), "always" (always the largest), "adaptive".
    gammas: the draft lengths the engine compiled.
    alpha: the acceptance estimate: (accepted + prior_weight / 2) /
      (evaluated + prior_weight) over decayed counts.
    smoothing: the decay (1 - smoothing) per step of the acceptance counts.
    prior_weight: pseudo-counts of the prior alpha = 0.5.
    margin: the predicted relative gain a switch needs.
    explore_steps: drafting steps measured before the policy may decode plainly.
    probe_every, probe_steps: after this many steps of one draft length, run
      `probe_steps` steps of another, to time it against its neighbours (and
      measure its acceptance).
    window: the last steps of a run whose median times it (and the length
      of warm-up's runs); and the ratios kept per (gamma, width) (warm-up's
      first, then live ones), whose median is rho.
    step_time: (gamma, width) -> warm-up seconds (`calibration.calibrate_width`
      sets them; a program without one takes its first live time).
  """

  kind: str
  gammas: tuple[int, ...]
  alpha: float = 0.5
  smoothing: float = 0.1
  prior_weight: float = 2.0
  margin: float = 0.03
  explore_steps: int = 16
  probe_every: int = 128
  probe_steps: int = 4
  window: int = 8
  step_time: dict = dataclasses.field(default_factory=dict)
  current: int | None = None
  _run: int = 0  # steps of `current` since the last switch or probe
  _probing: int = 0  # probe steps left
  _probe: int = 0  # the draft length probed
  _probes: int = 0
  _runs: dict = dataclasses.field(default_factory=dict)  # width -> the last runs of steps
  _ratios: dict = dataclasses.field(default_factory=dict)  # (gamma, width) -> recent rho
  _accepted: float = 0.0  # decayed counts
  _evaluated: float = 0.0
  _drafted_steps: int = 0  # drafting steps measured

  def __post_init__(self):
    if self.kind not in POLICIES:
      raise ValueError(f"policy must be one of {POLICIES}, got {self.kind!r}.")

  def tokens_per_step(self, gamma: int) -> float:
    """Tokens a row commits per step drafting `gamma`: E(alpha, gamma)."""
    return expected_tokens_per_iteration(self.alpha, gamma)

  def cost(self, gamma: int, width: int) -> float:
    """rho: the time of a step drafting `gamma` at `width` over a plain step's,
    measured from adjacent runs (or at warm-up), else from the fastest times."""
    if gamma == 0:
      return 1.0
    ratios = self._ratios.get((gamma, width))
    if ratios:
      return statistics.median(ratios)
    # Without plain steps compiled (gammas without 0) the times compare as they are.
    return self.step_time[gamma, width] / self.step_time.get((0, width), 1.0)

  def live_step_ms(self) -> dict[str, float]:
    """The median time of each width's latest runs of steps, milliseconds, by
    "gamma=G,width=W"."""
    return {
      f"gamma={g},width={w}": 1e3 * statistics.median(times)
      for w, runs in sorted(self._runs.items())
      for g, times in runs
    }

  def predicted_rate(self, gamma: int, width: int) -> float:
    """Tokens per row per plain-step time predicted for drafting `gamma` at `width`."""
    return self.tokens_per_step(gamma) / self.cost(gamma, width)

  def choose(self, width: int) -> int:
    """The draft length of the next step at batch width `width`."""
    if self.kind == "never":
      return 0
    if self.kind == "always":
      return self.gammas[-1]
    if self._probing:
      self._probing -= 1
      return self._probe
    if self._drafted_steps < self.explore_steps and self.gammas[-1] > 0:  # measure first
      self.current = self.gammas[-1]
      return self.current
    current = self.gammas[-1] if self.current is None else self.current
    if self._run >= self.probe_every and len(self.gammas) > 1:  # time another one now
      others = [g for g in self.gammas if g != current]
      self._probe = others[self._probes % len(others)]
      self._probes += 1
      self._run, self._probing = 0, self.probe_steps - 1
      return self._probe
    self.current = current
    rates = {g: self.predicted_rate(g, width) for g in self.gammas}
    best = max(rates, key=rates.get)
    if rates[best] / rates[current] > 1 + self.margin:  # hysteresis: no flapping
      self.current, self._run = best, 0
    self._run += 1
    return self.current

  def observe(
    self,
    gamma: int,
    width: int,
    seconds: float,
    accepted: int,
    evaluated: int,
    rows: int = 0,
  ) -> None:
    """Records a step that ran: its wall time, the drafted tokens it accepted out
    of those it evaluated, and its live rows (0: a warm-up step, which does not
    count towards `explore_steps`)."""
    self.step_time.setdefault((gamma, width), seconds)
    self._time_run(gamma, width, seconds)
    if rows and gamma:
      self._drafted_steps += 1
    if evaluated:
      keep = 1.0 - self.smoothing
      self._accepted = keep * self._accepted + accepted
      self._evaluated = keep * self._evaluated + evaluated
      prior = self.prior_weight
      self.alpha = (self._accepted + prior / 2) / (self._evaluated + prior)

  def end_runs(self, width: int) -> None:
    """Closes the runs of steps at `width` (the engine's warm-up does, after
    its timed runs): the last one gives its ratio, and the next live step at
    that width starts a run anew."""
    runs = self._runs.pop(width, [])
    if len(runs) == 2:
      self._add_ratio(width, *runs)

  def _time_run(self, gamma: int, width: int, seconds: float) -> None:
    """Adds a step to the current run of `gamma` steps at `width`; when a run
    ends, its median time over the previous run's gives a ratio rho."""
    runs = self._runs.setdefault(width, [])
    if runs and runs[-1][0] == gamma:
      runs[-1][1].append(seconds)
      return
    runs.append((gamma, collections.deque([seconds], maxlen=self.window)))
    if len(runs) == 3:
      self._add_ratio(width, runs.pop(0), runs[0])

  def _add_ratio(self, width: int, before: tuple, after: tuple) -> None:
    """One ratio rho from two adjacent runs `(gamma, step seconds)` at `width`."""
    (g_before, t_before), (g_after, t_after) = before, after
    ratio = statistics.median(t_after) / statistics.median(t_before)  # t(after) / t(before)
    # As rho, relative to a plain step: a pair of two draft lengths chains
    # through the rho measured for the earlier one.
    if g_before == 0:
      g, rho = g_after, ratio
    elif g_after == 0:
      g, rho = g_before, 1.0 / ratio
    elif (g_before, width) in self._ratios:
      g, rho = g_after, ratio * self.cost(g_before, width)
    else:
      return
    self._ratios.setdefault((g, width), collections.deque(maxlen=self.window)).append(rho)
