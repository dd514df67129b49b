"""What the warps that read a row's text cost a speculative iteration, two ways.

warp ops alone (`warp_ops_ms`): the work the warps add at the iteration's shapes,
in one jitted loop against the same loop without it: the drafter's γ laws `[B, V]`
with the counts advanced along the chain, the target's `[B, g + 1, V]` with each
position's counts, and the commit's count update (g = 0: a plain step).

One iteration (`warp_cost`), three ways:

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

What each setting does to the speedup (`setting_speedups`): plain and
speculative decoding of a few prompts with each setting alone on (`SETTINGS`,
plus what the launcher adds) and all off, at each temperature.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from specjax.bench.masking import _iteration_loop
from specjax.bench.timing import time_calls
from specjax.generation import validation
from specjax.generation.autoregressive import autoregressive_generate
from specjax.generation.speculative import init_state, speculative_generate
from specjax.generation.state import SpecConfig
from specjax.sampling import RowSampling, SamplingParams, TokenHistory, penalized_logits
from specjax.validation import check_positive_int


@functools.partial(jax.jit, static_argnames=("gamma", "repeats", "warped"))
def _warp_loop(rows, history, logits, *, gamma: int, repeats: int, warped: bool):
  """`repeats` x reading `logits [B, g + 1, V]` as greedy drafting and verification
  read them (an argmax per drafted and per scored position), through the warps of
  `rows` over `history` (`warped`) or not; the argmaxes are the next trip's tokens."""
  b, width, _ = logits.shape

  def body(_, carry):
    tokens, history = carry  # [B, g + 1]
    x = jnp.where(tokens[:, :, None] < 0, 0.0, logits)  # never true: ties x to the carry
    draft, warp = [], rows.with_history(history, None)
    for j in range(gamma):
      draft.append(penalized_logits(x[:, j], warp) if warped else x[:, j])
      warp = warp.after(tokens[:, j]) if warped else warp
    if warped:
      scored = rows.with_history(history.along(tokens[:, :gamma]), None)
      x = penalized_logits(x, scored)
      history = history.after(tokens, jnp.ones((b,), jnp.int32))
    scored = jnp.argmax(x, axis=-1).astype(jnp.int32)
    drafted = [jnp.argmax(q, axis=-1).astype(jnp.int32) for q in draft]
    last = scored[:, -1]
    return jnp.stack([*(jnp.maximum(d, s) for d, s in zip(drafted, scored.T)), last], 1), history

  start = jnp.zeros((b, width), jnp.int32)
  return jax.lax.fori_loop(0, repeats, body, (start, history))[0]


def warp_ops_ms(
  sampling: SamplingParams,
  batch: int,
  vocab_size: int,
  *,
  gamma: int,
  repeats: int = 64,
  num_runs: int = 5,
) -> float:
  """Milliseconds the warps' own work adds to one step: warped minus plain loop
  (`_warp_loop`), per trip, for `batch` rows of `sampling`. gamma 0: a plain
  autoregressive step; gamma g: a speculative iteration."""
  check_positive_int("repeats", repeats)
  rows = RowSampling.of(sampling, batch)
  prompts = jax.random.randint(jax.random.key(1), (batch, 64), 0, vocab_size)
  history = TokenHistory.of_prompts(prompts, jnp.full((batch,), 64), vocab_size)
  history = history.after(prompts[:, :32])  # some generated text
  logits = jax.random.normal(jax.random.key(0), (batch, gamma + 1, vocab_size), jnp.float32)
  loops = {
    name: functools.partial(
      _warp_loop, rows, history, logits, gamma=gamma, repeats=repeats, warped=warped
    )
    for name, warped in (("warped", True), ("plain", False))
  }
  timings, _ = time_calls(loops, num_runs)
  return (timings["warped"].median_s - timings["plain"].median_s) * 1e3 / repeats


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
    `warp_ms_per_iteration` (the ops alone) and `warp_fraction` (over the
    per-row iteration), `ar_warp_ms_per_step` and `ar_warp_fraction` (over the
    per-row plain step), `iteration_ms_static`, `iteration_ms_rows`, `iteration_ms_warps`,
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
  vocab = target.cfg.vocab_size
  ops = warp_ops_ms(sampling, b, vocab, gamma=gamma, num_runs=num_runs)
  ar_ops = warp_ops_ms(sampling, b, vocab, gamma=0, num_runs=num_runs)
  return {
    "warp_ms_per_iteration": ops,
    "warp_fraction": ops / ms["rows"],
    "ar_warp_ms_per_step": ar_ops,
    "ar_warp_fraction": ar_ops / (timings["rows"].median_s * 1e3 / max_new_tokens),
    **{f"iteration_ms_{name}": value for name, value in ms.items()},
    **{f"ar_ms_per_token_{name}": t.median_s * 1e3 / max_new_tokens for name, t in timings.items()},
    "warps_over_rows": ms["warps"] / ms["rows"] - 1,
    "warps_over_static": ms["warps"] / ms["static"] - 1,
  }


# Each setting alone (and all together) for `setting_speedups`: the penalties at
# moderate values, min-p, a delayed EOS. logit_bias and stop ids need token ids:
# the launcher adds them (`experiments/warp_settings.py`).
SETTINGS = {
  "off": {},
  "presence_penalty": {"presence_penalty": 0.5},
  "frequency_penalty": {"frequency_penalty": 0.5},
  "repetition_penalty": {"repetition_penalty": 1.2},
  "min_p": {"min_p": 0.05},
  "min_tokens": {"min_tokens": 32},
}

SETTING_COLUMNS = (
  ("setting", "{setting}"),
  ("T", "{temperature:g}"),
  ("AR ms/tok", "{ar_ms_per_token:.2f}"),
  ("spec ms/tok", "{spec_ms_per_token:.2f}"),
  ("speedup", "{speedup:.2f}"),
  ("α", "{acceptance_rate:.3f}"),
  ("tok/iter", "{tokens_per_iteration:.2f}"),
  ("spec vs off", "{spec_over_off:+.1%}"),
  (
    "greedy identical",
    lambda r: "" if r["greedy_identical"] is None else f"{r['greedy_identical']}",
  ),
)


def setting_speedups(
  target,
  drafter,
  prompts: jax.Array,
  prompt_lengths: jax.Array,
  settings: dict[str, dict[str, Any]],
  *,
  temperatures: tuple[float, ...] = (0.0, 1.0),
  gamma: int = 4,
  max_new_tokens: int = 64,
  eos_id: tuple[int, ...] | None = None,
  num_runs: int = 3,
) -> list[dict[str, Any]]:
  """Speedup of speculative over plain decoding with each setting on (and off).

  Each prompt (`prompts [N, P]`, lengths `[N]`) is decoded alone (batch 1, the
  prompts padded to one width: one program per setting's shape), plain and
  speculative, interleaved (`time_calls`); a row sums the prompts' times and
  tokens. Settings are `SamplingParams` fields (`settings`: name -> fields, e.g.
  `SETTINGS`), given as per-row data (`RowSampling`), as a server runs them.

  Returns:
    One row per (temperature, setting): `ar_ms_per_token`, `spec_ms_per_token`,
    `speedup`, `acceptance_rate`, `tokens_per_iteration`, `spec_over_off` (the
    speculative ms/token over the same temperature's "off" row, less one; 0
    without an "off" setting) and `greedy_identical` (T = 0: the texts agree).
  """
  check_positive_int("gamma", gamma)
  check_positive_int("max_new_tokens", max_new_tokens)
  check_positive_int("num_runs", num_runs)
  rows = []
  for temperature in temperatures:
    if not temperature >= 0:
      raise ValueError(f"temperatures must be >= 0, got {temperature!r}.")
    for name, fields in settings.items():
      sampling = RowSampling.of(SamplingParams(temperature=float(temperature), **fields), 1)
      key = None if temperature == 0 else jax.random.key(0)
      seconds = {"ar": 0.0, "spec": 0.0}
      tokens = {"ar": 0, "spec": 0}
      accepted = evaluated = generated = iterations = 0
      identical = True
      for b in range(prompts.shape[0]):
        prompt, length = prompts[b : b + 1], prompt_lengths[b : b + 1]
        run = dict(max_new_tokens=max_new_tokens, sampling=sampling, key=key, eos_id=eos_id)
        calls = {
          "ar": functools.partial(autoregressive_generate, target, prompt, length, **run),
          "spec": functools.partial(
            speculative_generate, target, drafter, prompt, length, gamma=gamma, **run
          ),
        }
        timings, outputs = time_calls(calls, num_runs)
        for k in calls:
          seconds[k] += timings[k].median_s
          tokens[k] += int(outputs[k].num_generated.sum())
        s = outputs["spec"].stats
        accepted, evaluated = accepted + int(s.accepted.sum()), evaluated + int(s.evaluated.sum())
        generated += int(s.generated.sum())
        iterations += int(s.row_iterations.sum())
        identical &= bool((outputs["ar"].tokens == outputs["spec"].tokens).all())
      ar_ms = seconds["ar"] * 1e3 / max(tokens["ar"], 1)
      spec_ms = seconds["spec"] * 1e3 / max(tokens["spec"], 1)
      rows.append(
        {
          "setting": name,
          **fields,
          "temperature": float(temperature),
          "gamma": gamma,
          "prompts": int(prompts.shape[0]),
          "max_new_tokens": max_new_tokens,
          "ar_ms_per_token": ar_ms,
          "spec_ms_per_token": spec_ms,
          "speedup": ar_ms / spec_ms,
          "acceptance_rate": accepted / max(evaluated, 1),
          "tokens_per_iteration": generated / max(iterations, 1),
          "greedy_identical": identical if temperature == 0 else None,
        }
      )
    off = next((r for r in rows[-len(settings) :] if r["setting"] == "off"), None)
    for r in rows[-len(settings) :]:
      base = r["spec_ms_per_token"] if off is None else off["spec_ms_per_token"]
      r["spec_over_off"] = r["spec_ms_per_token"] / base - 1
  return rows
