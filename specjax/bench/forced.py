"""What drafts the grammar forces buy (`SpecConfig.forced_drafts`), on the JSON task.

For each drafter and temperature, three runs over the same prompts under the
same constraint: plain constrained decoding, and speculative decoding with
forced drafts off and on. Each is one `[B, P]` batch of right-padded prompts
(one compiled program), timed as the median of interleaved runs
(`time_calls`). A row reports per generated token: milliseconds, tokens per
iteration (committed tokens over the rows' iterations), the acceptance rate,
draft calls per iteration and the share of tokens the constraint forced; the
speedups are over plain decoding and on over off. At temperature 0 the three
texts must agree (`greedy_identical`). Beside them, one iteration from the
prefilled state with forced drafts off and on (`iteration_ms`: the same
drafter, shapes and verifier, interleaved), what the switch costs where the
row's state forces nothing, or saves where it does.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from specjax import constraints
from specjax.bench.masking import _iteration_loop
from specjax.bench.timing import time_calls
from specjax.drafting import as_drafter
from specjax.generation import validation
from specjax.generation.autoregressive import autoregressive_generate
from specjax.generation.speculative import init_state, speculative_generate
from specjax.generation.state import SpecConfig
from specjax.results import markdown_table
from specjax.sampling import SamplingParams
from specjax.validation import check_positive_int

COLUMNS = (
  ("drafter", "{drafter}"),
  ("T", "{temperature:g}"),
  ("γ", "{gamma}"),
  ("AR ms/tok", "{ar_ms_per_token:.2f}"),
  ("off ms/tok", "{off_ms_per_token:.2f}"),
  ("on ms/tok", "{on_ms_per_token:.2f}"),
  ("off tok/iter", "{off_tokens_per_iteration:.2f}"),
  ("on tok/iter", "{on_tokens_per_iteration:.2f}"),
  ("off calls/iter", "{off_draft_calls_per_iteration:.2f}"),
  ("on calls/iter", "{on_draft_calls_per_iteration:.2f}"),
  ("forced share", "{on_forced_share:.2f}"),
  ("speedup off", "{speedup_off:.2f}"),
  ("speedup on", "{speedup_on:.2f}"),
  ("on / off", "{on_over_off:.2f}"),
  ("iteration ms off / on", "{iteration_ms_off:.2f} / {iteration_ms_on:.2f}"),
  (
    "greedy identical",
    lambda r: "" if r["greedy_identical"] is None else f"{r['greedy_identical']}",
  ),
)


def _figures(out, seconds: float, plain: bool = False) -> dict[str, float]:
  """Per-token figures of one run's `GenerateOutput` taking `seconds` (`plain`
  decoding's: milliseconds only)."""
  s = out.stats
  if plain:
    return {"ms_per_token": seconds * 1e3 / max(int(np.sum(out.num_generated)), 1)}
  generated = int(np.sum(s.generated))
  iterations = max(int(np.sum(s.row_iterations)), 1)
  return {
    "ms_per_token": seconds * 1e3 / max(int(np.sum(out.num_generated)), 1),
    "tokens_per_iteration": generated / iterations,
    "acceptance_rate": float(s.acceptance_rate),
    "draft_calls_per_iteration": int(s.draft_calls) / max(int(s.iterations), 1),
    "forced_share": int(np.sum(s.forced)) / max(generated, 1),
  }


def iteration_ms(
  target,
  drafter,
  prompts: jax.Array,
  prompt_lengths: jax.Array,
  rules: constraints.RowConstraints,
  sampling: SamplingParams,
  *,
  gamma: int,
  max_new_tokens: int,
  eos_id: tuple[int, ...],
  repeats: int = 16,
  num_runs: int = 5,
) -> dict[str, float]:
  """Milliseconds of one speculative iteration from the prefilled state of
  `prompts [B, P]` under `rules`, forced drafts `off` and `on`
  (`bench.masking._iteration_loop`), and the forced tokens that state starts with."""
  drafter = as_drafter(drafter)
  loops, forced = {}, 0
  for setting in ("off", "on"):
    config = SpecConfig(
      gamma=gamma, max_new_tokens=max_new_tokens, sampling=sampling,
      verifier=validation.resolve_verifier("auto", sampling), eos_id=eos_id,
      forced_drafts=setting == "on",
    )  # fmt: skip
    state = jax.jit(init_state, static_argnames="config")(
      target, drafter, prompts, prompt_lengths, jax.random.key(0), config=config, rules=rules
    )
    _, count, _ = constraints.forced_chain(rules.table, state.constraint_state, gamma)
    forced = int(np.sum(count))
    loops[setting] = functools.partial(
      _iteration_loop, target, drafter, state, rules.table, config=config, repeats=repeats
    )
  timings, _ = time_calls(loops, num_runs)
  ms = {f"iteration_ms_{k}": t.median_s * 1e3 / repeats for k, t in timings.items()}
  return {**ms, "iteration_forced_tokens": forced}


def forced_drafts_rows(
  target,
  drafters: Mapping[str, Any],
  prompts: jax.Array,
  prompt_lengths: jax.Array,
  rules: constraints.RowConstraints,
  eos_id: Sequence[int],
  *,
  temperatures: Sequence[float] = (0.0, 1.0),
  gamma: int = 4,
  max_new_tokens: int = 64,
  num_runs: int = 3,
) -> list[dict[str, Any]]:
  """One row per (drafter, temperature): plain, forced drafts off and on.

  Args:
    target: the model decoded.
    drafters: name -> drafter (anything `speculative_generate` takes).
    prompts: `[B, P]` int32 right-padded; prompt_lengths `[B]`.
    rules: the rows' constraint (`constraints.RowConstraints`).
    eos_id: the ids that end a constrained text.
    temperatures: each >= 0 (0: greedy).
  """
  check_positive_int("gamma", gamma)
  check_positive_int("max_new_tokens", max_new_tokens)
  check_positive_int("num_runs", num_runs)
  for t in temperatures:
    if not t >= 0:
      raise ValueError(f"temperatures must be >= 0, got {t!r}.")
  eos = tuple(int(i) for i in eos_id)
  rows = []
  for temperature in temperatures:
    sampling = SamplingParams(temperature=float(temperature))
    run = dict(
      max_new_tokens=max_new_tokens, sampling=sampling, eos_id=eos, constraints=rules,
      key=None if sampling.greedy else jax.random.key(0),
    )  # fmt: skip
    plain = functools.partial(autoregressive_generate, target, prompts, prompt_lengths, **run)
    for name, drafter in drafters.items():
      calls = {"ar": plain}
      for setting in ("off", "on"):
        calls[setting] = functools.partial(
          speculative_generate, target, drafter, prompts, prompt_lengths, gamma=gamma,
          forced_drafts=setting == "on", **run,
        )  # fmt: skip
      timings, outputs = time_calls(calls, num_runs)
      figures = {k: _figures(outputs[k], timings[k].median_s, k == "ar") for k in calls}
      identical = None
      if sampling.greedy:
        texts = [np.asarray(outputs[k].tokens) for k in calls]
        identical = all(np.array_equal(texts[0], t) for t in texts[1:])
      ar_ms = figures["ar"]["ms_per_token"]
      one = iteration_ms(
        target, drafter, prompts, prompt_lengths, rules, sampling, gamma=gamma,
        max_new_tokens=max_new_tokens, eos_id=eos, num_runs=num_runs,
      )  # fmt: skip
      rows.append(
        {
          "drafter": name,
          "temperature": float(temperature),
          "gamma": gamma,
          "batch_size": int(prompts.shape[0]),
          "max_new_tokens": max_new_tokens,
          "ar_ms_per_token": ar_ms,
          **{f"{k}_{f}": v for k in ("off", "on") for f, v in figures[k].items()},
          "speedup_off": ar_ms / figures["off"]["ms_per_token"],
          "speedup_on": ar_ms / figures["on"]["ms_per_token"],
          "on_over_off": figures["off"]["ms_per_token"] / figures["on"]["ms_per_token"],
          "greedy_identical": identical,
          **one,
        }
      )
  return rows


def markdown(rows: Sequence[Mapping[str, Any]]) -> str:
  """`forced_drafts_rows`'s rows as a markdown table."""
  return markdown_table(rows, COLUMNS)
