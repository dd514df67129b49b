"""What a constraint's mask (`specjax.constraints`) costs a decoding step, two ways.

  mask ops alone      the work a constraint adds, at the step's shapes, in one
                      jitted loop against the same loop without it: the states
                      along the drafted chain, the target's masked logits
                      `[B, g + 1, V]`, the draft's γ masked laws `[B, V]` and
                      the state after the verifier's token (g = 0: a plain step)
  one iteration       a whole `speculative_step` from the same state, with the
                      rows' table and without it (the same drafted work, the
                      mask fused as XLA fuses it in the loop)

Both are medians of interleaved runs in one process (`time_calls`), each run
`repeats` trips of a `fori_loop` whose carry feeds the next trip, so nothing is
loop-invariant and no trip pays a dispatch.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from specjax import constraints
from specjax.bench.timing import time_calls
from specjax.drafting import DraftConstraint
from specjax.generation import validation
from specjax.generation.speculative import constrained_path, init_state, speculative_step
from specjax.generation.state import SpecConfig
from specjax.sampling import SamplingParams
from specjax.validation import check_positive_int


@functools.partial(jax.jit, static_argnames=("gamma", "repeats", "masked"))
def _mask_loop(table, start, logits, *, gamma: int, repeats: int, masked: bool):
  """`repeats` x reading `logits [B, g + 1, V]` as greedy drafting and
  verification read them (an argmax per drafted and per scored position), with
  the constraint's work (`masked`) or without it; `start [B]` the rows' states.
  The argmaxes are the next trip's tokens."""
  b, width, _ = logits.shape

  def body(_, tokens):  # [B, g + 1]
    x = jnp.where(tokens[:, :, None] < 0, 0.0, logits)  # never true: ties x to the carry
    if masked:
      path = constrained_path(table, start, tokens[:, :gamma])  # [B, g + 1]
      draft = [DraftConstraint(table, path[:, j]).logits(x[:, j]) for j in range(gamma)]
      x = constraints.mask_logits(x, table, path)
    else:
      draft = [x[:, j] for j in range(gamma)]
    scored = jnp.argmax(x, axis=-1).astype(jnp.int32)
    drafted = [jnp.argmax(q, axis=-1).astype(jnp.int32) for q in draft]
    last = scored[:, -1]
    if masked:  # the commit's advance past the verifier's token
      last = jnp.where(constraints.advance(table, path[:, -1], last) < -1, 0, last)
    return jnp.stack([*(jnp.maximum(d, s) for d, s in zip(drafted, scored.T)), last], axis=1)

  return jax.lax.fori_loop(0, repeats, body, jnp.zeros((b, width), jnp.int32))


@functools.partial(jax.jit, static_argnames=("config", "repeats"))
def _iteration_loop(target, drafter, state, table, *, config: SpecConfig, repeats: int):
  """`repeats` speculative iterations, each from `state` (`table` None: unmasked)."""

  def body(_, total):
    recent = jnp.where(total < 0, 0, state.recent)  # never true: ties the trip to the carry
    new = speculative_step(target, drafter, state.replace(recent=recent), config, table=table)
    return total + jnp.sum(new.num_generated)

  return jax.lax.fori_loop(0, repeats, body, jnp.int32(0))


def mask_ops_ms(
  rules: constraints.RowConstraints,
  vocab_size: int,
  *,
  gamma: int,
  repeats: int = 64,
  num_runs: int = 5,
) -> float:
  """Milliseconds the constraint's own work adds to one step: masked minus
  unmasked loop (`_mask_loop`), per trip. gamma 0: a plain autoregressive step
  (one masked position and an advance); gamma g: a speculative iteration."""
  check_positive_int("repeats", repeats)
  b = rules.start.shape[0]
  logits = jax.random.normal(jax.random.key(0), (b, gamma + 1, vocab_size), jnp.float32)
  loops = {
    name: functools.partial(
      _mask_loop, rules.table, rules.start, logits, gamma=gamma, repeats=repeats, masked=masked
    )
    for name, masked in (("masked", True), ("plain", False))
  }
  timings, _ = time_calls(loops, num_runs)
  return (timings["masked"].median_s - timings["plain"].median_s) * 1e3 / repeats


def iteration_ms(
  target,
  drafter,
  prompts: jax.Array,
  prompt_lengths: jax.Array,
  rules: constraints.RowConstraints,
  *,
  gamma: int,
  max_new_tokens: int,
  sampling: SamplingParams,
  verifier: str = "auto",
  eos_id: tuple[int, ...] | None = None,
  repeats: int = 16,
  num_runs: int = 5,
) -> dict[str, float]:
  """Milliseconds of one speculative iteration from the prefilled state of
  `prompts [B, P]` under `rules`, with its table (`masked`) and without
  (`unmasked`): the same drafter, shapes and verifier."""
  check_positive_int("repeats", repeats)
  config = SpecConfig(
    gamma=gamma,
    max_new_tokens=max_new_tokens,
    sampling=sampling,
    verifier=validation.resolve_verifier(verifier, sampling),
    eos_id=eos_id,
  )
  state = jax.jit(init_state, static_argnames="config")(
    target, drafter, prompts, prompt_lengths, jax.random.key(0), config=config, rules=rules
  )
  loops = {
    name: functools.partial(
      _iteration_loop, target, drafter, state, table, config=config, repeats=repeats
    )
    for name, table in (("masked", rules.table), ("unmasked", None))
  }
  timings, _ = time_calls(loops, num_runs)
  return {name: t.median_s * 1e3 / repeats for name, t in timings.items()}


def mask_cost(
  target,
  drafter,
  prompts: jax.Array,
  prompt_lengths: jax.Array,
  rules: constraints.RowConstraints,
  *,
  gamma: int,
  max_new_tokens: int,
  sampling: SamplingParams,
  verifier: str = "auto",
  eos_id: tuple[int, ...] | None = None,
  ar_step_ms: float,
  num_runs: int = 5,
) -> dict[str, Any]:
  """The mask's cost per step against the step (the decode job's result fields).

  Args:
    target, drafter: the models that decode (`drafter` any `Drafter` or draft).
    prompts: `[B, P]` int32; prompt_lengths `[B]`; rules: the rows' constraints.
    gamma, max_new_tokens, sampling, verifier, eos_id: the speculative loop's.
    ar_step_ms: the autoregressive step measured beside it (the plain step's
      fraction is against it).

  Returns:
    `mask_ms_per_iteration` (the ops alone), `iteration_ms_masked`,
    `iteration_ms_unmasked`, `mask_fraction` (ops alone over the unmasked
    iteration), `iteration_mask_fraction` (masked over unmasked iteration, less
    one: inside the machine's noise when the mask is cheap; it can be < 0),
    `ar_mask_ms_per_step` and `ar_mask_fraction` (against `ar_step_ms`).
  """
  vocab = target.cfg.vocab_size
  ops = mask_ops_ms(rules, vocab, gamma=gamma, num_runs=num_runs)
  ar_ops = mask_ops_ms(rules, vocab, gamma=0, num_runs=num_runs)
  iteration = iteration_ms(
    target,
    drafter,
    prompts,
    prompt_lengths,
    rules,
    gamma=gamma,
    max_new_tokens=max_new_tokens,
    sampling=sampling,
    verifier=verifier,
    eos_id=eos_id,
    num_runs=num_runs,
  )
  return {
    "mask_ms_per_iteration": ops,
    "iteration_ms_masked": iteration["masked"],
    "iteration_ms_unmasked": iteration["unmasked"],
    "mask_fraction": ops / iteration["unmasked"],
    "iteration_mask_fraction": iteration["masked"] / iteration["unmasked"] - 1,
    "ar_mask_ms_per_step": ar_ops,
    "ar_mask_fraction": ar_ops / ar_step_ms,
  }
