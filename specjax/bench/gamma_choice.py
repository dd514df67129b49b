"""A block drafter's draft length, measured at start-up on this machine.

A block drafter drafts its whole block in one call, so a longer draft costs it
almost nothing; but the target scores gamma + 1 rows per iteration, and on a CPU
(compute-bound even at batch 1) scoring 8 rows can cost twice scoring 5, while
the drafts deep in a block are rarely kept. Which gamma pays, and whether any
does, depends on the machine, the drafter and the temperature, so the launchers'
default (`gamma=0` with a block drafter) measures it: each candidate gamma and
plain decoding run the caller's own decode (the same compiled programs the run
then reuses), and the fastest gamma wins. When no gamma beats plain decoding the
choice says so (`GammaChoice.plain_wins`) and the caller decodes plainly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np

from specjax.bench.timing import time_calls


def candidate_gammas(most: int) -> tuple[int, ...]:
  """The draft lengths tried for a drafter of at most `most` tokens per call: 1, 2, 4
  and `most` (those <= `most`), few enough to compile at start-up."""
  return tuple(sorted({g for g in (1, 2, 4, most) if 1 <= g <= most}))


@dataclasses.dataclass(frozen=True)
class GammaChoice:
  """What the start-up measurement found.

  Attributes:
    gamma: the fastest candidate draft length.
    plain_ms: plain decoding's milliseconds per token.
    ms_per_token: {gamma: milliseconds per token} of every candidate.
  """

  gamma: int
  plain_ms: float
  ms_per_token: dict[int, float]

  @property
  def speedup(self) -> float:
    """The chosen gamma's speedup over plain decoding, as measured."""
    return self.plain_ms / self.ms_per_token[self.gamma]

  @property
  def plain_wins(self) -> bool:
    """Whether plain decoding was faster than every candidate."""
    return self.speedup < 1.0

  def report(self) -> dict:
    """JSON-ready figures: `{"gamma_probe": {...}}`."""
    return {
      "gamma_probe": {
        "chosen": self.gamma,
        "plain_ms_per_token": self.plain_ms,
        "ms_per_token": {str(g): ms for g, ms in self.ms_per_token.items()},
        "speedup": self.speedup,
        "plain_wins": self.plain_wins,
      }
    }


def _ms_per_token(seconds: float, output) -> float:
  # A loop runs until its longest row is done: its time per token of that row.
  return seconds * 1e3 / max(int(np.max(jax.device_get(output.num_generated))), 1)


def choose_gamma(
  spec: Callable[[int], Callable[[], object]],
  plain: Callable[[], object],
  candidates: Sequence[int],
  runs: int = 3,
  measure: Callable = time_calls,
) -> GammaChoice:
  """Times plain decoding and speculative decoding at each of `candidates`, after one
  warm-up call each (`bench.time_calls`, rounds interleaved), and picks the fastest.

  Args:
    spec: gamma -> a zero-argument call decoding at that gamma (returns a
      `GenerateOutput`: `num_generated [B]` counts its tokens).
    plain: a zero-argument call decoding the same batch without a drafter.
    candidates: the gammas tried (`candidate_gammas`), ints >= 1.
    runs: timed rounds after the warm-up, >= 1 (the median is kept).
    measure: `bench.time_calls` or a stand-in with its signature (tests).

  Raises:
    ValueError: no candidates, or one that is not an int >= 1.
  """
  gammas = tuple(candidates)
  if not gammas or not all(isinstance(g, int) and g >= 1 for g in gammas):
    raise ValueError(f"candidates must be ints >= 1, at least one, got {candidates!r}.")
  calls = {0: plain, **{g: spec(g) for g in gammas}}
  timings, outputs = measure(calls, runs)
  ms = {g: _ms_per_token(timings[g].median_s, outputs[g]) for g in calls}
  best = min(gammas, key=lambda g: ms[g])
  return GammaChoice(best, ms[0], {g: ms[g] for g in gammas})


def worst_case(choices: Sequence[GammaChoice]) -> tuple[int, float]:
  """Over several measurements of the same candidates (e.g. at T = 0 and T = 1), the
  gamma whose slowest speedup is best, and that speedup (< 1: plain decoding wins at
  one of them at least)."""
  gammas = choices[0].ms_per_token
  worst = {g: min(c.plain_ms / c.ms_per_token[g] for c in choices) for g in gammas}
  best = max(gammas, key=worst.get)
  return best, worst[best]
