"""Measuring what an iteration costs at each verify length on this machine
(`specjax.generation.verify_length`: the rule that chooses among them in-graph)."""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from specjax import compiler_options
from specjax.drafting import as_drafter
from specjax.generation.speculative import init_state, speculative_step
from specjax.generation.state import SpecConfig
from specjax.generation.verify_length import relative_costs
from specjax.sampling import GREEDY, SamplingParams


def measure_verify_costs(
  target,
  draft,
  prompts: jax.Array,
  prompt_lengths: jax.Array,
  *,
  gamma: int,
  lengths: Sequence[int],
  sampling: SamplingParams = GREEDY,
  key: jax.Array | None = None,
  runs: int = 5,
  window: int = 5,
) -> tuple[float, ...]:
  """The relative cost of a speculative iteration at each verify length, measured
  on this machine: for each k in `lengths`, one jitted `speculative_step` that
  drafts `gamma` tokens and verifies k of them (the draft, the target scoring
  k + 1 rows, verification and commit), on the batch `prompts [B, P]`,
  `prompt_lengths [B]` after its prefill: the lengths take turns in `runs`
  runs of `window` steps each; a length's cost is its fastest run's median.

  Returns:
    one cost per length (`relative_costs`: non-decreasing, gamma's 1):
    `speculative_generate`'s `verify_costs`.
  """
  drafter = as_drafter(draft)
  key = jax.random.key(0) if key is None else key
  config = SpecConfig(gamma=gamma, max_new_tokens=gamma + 2, sampling=sampling)
  prompts, prompt_lengths = jnp.asarray(prompts, jnp.int32), jnp.asarray(prompt_lengths, jnp.int32)
  state = jax.block_until_ready(_init(target, drafter, prompts, prompt_lengths, key, config=config))
  steps = []
  for k in lengths:
    forced = dataclasses.replace(config, verify_lengths=(int(k),), verify_costs=(1.0,))
    steps.append(functools.partial(_step, target, drafter, state, config=forced))
    jax.block_until_ready(steps[-1]())  # compiles
  # The lengths take turns in runs of `window` consecutive steps; each length's
  # fastest run's median (a shared machine's noise only adds time), as the serving
  # engine's calibration does.
  times = [[] for _ in steps]
  for _ in range(runs):
    for step, medians in zip(steps, times):
      seconds = []
      for _ in range(window):
        start = time.perf_counter()
        jax.block_until_ready(step())
        seconds.append(time.perf_counter() - start)
      medians.append(statistics.median(seconds))
  return relative_costs([min(t) for t in times])


@functools.partial(compiler_options.jit, static_argnames=("config",))
def _init(target, drafter, prompts, prompt_lengths, key, *, config):
  return init_state(target, drafter, prompts, prompt_lengths, key, config)


@functools.partial(compiler_options.jit, static_argnames=("config",))
def _step(target, drafter, state, *, config):
  return speculative_step(target, drafter, state, config)
