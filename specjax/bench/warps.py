"""What the warps that read a row's text cost a speculative iteration.

  static   the iteration under a static warp (temperature, top-k, top-p as a
           `SamplingParams`: greedy verification at temperature 0)
  rows     the same settings as per-row data (`RowSampling`, its `TokenHistory`
           kept and advanced, the penalties off): the server's path
  warps    the rows with the penalties, bias and min-p on (the counts along the
           drafted chain, the target's per-position counts `[B, g + 1, V]`)

Each is a whole `speculative_step` from the same prefilled state, the three
timed as `specjax.bench.masking.iteration_ms` times the constraint's mask:
medians of interleaved runs in one process, each run `repeats` trips of a
`fori_loop` whose carry feeds the next trip. The plain loop's three are whole
`autoregressive_generate` runs of `max_new_tokens` tokens (no EOS), per token.
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from specjax.bench.masking import _iteration_loop
from specjax.bench.timing import time_calls
from specjax.generation import validation
from specjax.generation.autoregressive import autoregressive_generate
from specjax.generation.speculative import init_state
from specjax.generation.state import SpecConfig
from specjax.sampling import RowSampling, SamplingParams
from specjax.validation import check_positive_int


def warp_cost(
  target,
  drafter,
  prompts: jax.Array,
  prompt_lengths: jax.Array,
  sampling: SamplingParams,
  *,
  gamma: int,
  max_new_tokens: int,
  eos_id: tuple[int, ...] | None = None,
  repeats: int = 16,
  num_runs: int = 5,
) -> dict[str, Any]:
  """Milliseconds of one speculative iteration (the decode job's result fields).

  Args:
    target, drafter: the models that decode (`drafter` any `Drafter` or draft).
    prompts: `[B, P]` int32; prompt_lengths `[B]`.
    sampling: the warps on (`SamplingParams.has_warps`); its temperature, top-k
      and top-p alone are the static and rows baselines.

  Returns:
    `iteration_ms_static`, `iteration_ms_rows`, `iteration_ms_warps`,
    `ar_ms_per_token_{static,rows,warps}` (plain decoding), `warps_over_rows`
    and `warps_over_static` (the iteration's ratios less one: inside the
    machine's noise when the warps are cheap; they can be < 0).
  """
  check_positive_int("repeats", repeats)
  b = prompts.shape[0]
  plain = SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p)
  variants = {
    "static": (plain, None),
    "rows": (None, RowSampling.of(plain, b)),
    "warps": (None, RowSampling.of(sampling, b)),
  }
  loops = {}
  for name, (static, rows) in variants.items():
    config = SpecConfig(
      gamma=gamma,
      max_new_tokens=max_new_tokens,
      sampling=static,
      verifier=validation.resolve_verifier("auto", static or rows),
      eos_id=eos_id,
    )
    state = jax.jit(init_state, static_argnames="config")(
      target, drafter, prompts, prompt_lengths, jax.random.key(0), config=config, rows=rows
    )
    loops[name] = functools.partial(
      _iteration_loop, target, drafter, state, None, config=config, repeats=repeats
    )
  timings, _ = time_calls(loops, num_runs)
  ms = {name: t.median_s * 1e3 / repeats for name, t in timings.items()}
  plain_runs = {
    name: functools.partial(
      autoregressive_generate,
      target,
      prompts,
      prompt_lengths,
      max_new_tokens=max_new_tokens,
      sampling=static or rows,
      key=jax.random.key(0),
    )
    for name, (static, rows) in variants.items()
  }
  timings, _ = time_calls(plain_runs, num_runs)
  return {
    **{f"iteration_ms_{name}": value for name, value in ms.items()},
    **{f"ar_ms_per_token_{name}": t.median_s * 1e3 / max_new_tokens for name, t in timings.items()},
    "warps_over_rows": ms["warps"] / ms["rows"] - 1,
    "warps_over_static": ms["warps"] / ms["static"] - 1,
  }
