"""What a model call and a drafter cost, and the speedup Leviathan's formula predicts.

`predict_speedup` is the one place measured times become the cost ratio c, the
verification's cost and the predicted speedup (`specjax.theory`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from specjax import theory
from specjax.bench.timing import Timing, random_prompts, time_calls
from specjax.drafting import Commit, as_drafter
from specjax.generation.common import prefill
from specjax.generation.speculative import init_state
from specjax.generation.state import SpecConfig
from specjax.models.kv_cache import KVCache, cache_capacity
from specjax.models.transformer import Transformer
from specjax.sampling import SamplingParams
from specjax.validation import check_positive_int


@functools.partial(jax.jit, static_argnames=("capacity", "sampling"))
def _prefill_program(model, prompts, prompt_lengths, key, *, capacity, sampling):
  return prefill(model, prompts, prompt_lengths, capacity, key, sampling)


@functools.partial(jax.jit, static_argnames=("num_steps", "tree"))
def _decode_loop(model, tokens, cache: KVCache, *, num_steps: int, tree=None):
  """`num_steps` cached calls on `tokens [B, T]`, each at the same cache length
  (with `tree`, the T tokens are a token tree's block, tree attention)."""
  start = cache.lengths
  layout = None if tree is None else (tree, 0)

  def body(_, carry):
    tokens, cache = carry
    logits, cache = model.forward_cached(tokens, cache, tree=layout)
    # The next tokens depend on the logits, so XLA cannot drop the output head
    # as dead code; rolling the lengths back (as a rejected block is rolled
    # back) keeps every call at the same position and inside the capacity.
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return tokens, cache.with_lengths(start)

  return jax.lax.fori_loop(0, num_steps, body, (tokens, cache))


def prefill_timing(
  model: Transformer,
  prompts: jax.Array,
  prompt_lengths: jax.Array,
  *,
  capacity: int,
  sampling: SamplingParams,
  key: jax.Array,
  num_runs: int,
) -> Timing:
  """Times one jitted `prefill` (time to first token, without the Python wrapper).

  Args:
    prompts: `[B, P]` int32; prompt_lengths `[B]`.
    capacity: cache slots S to allocate, as the generate call would.
  """
  run = functools.partial(
    _prefill_program, model, prompts, prompt_lengths, key, capacity=capacity, sampling=sampling
  )
  timings, _ = time_calls({"prefill": run}, num_runs)
  return timings["prefill"]


def call_seconds(
  model: Transformer,
  prompts: jax.Array,
  prompt_lengths: jax.Array,
  *,
  tokens_per_call: int,
  capacity: int,
  num_steps: int = 16,
  num_runs: int = 3,
  tree: tuple[int, ...] | None = None,
) -> float:
  """Median seconds of one `model.forward_cached` call over `tokens_per_call`
  tokens after a prefill: `num_steps` calls in one jitted `fori_loop`, divided.

  Args:
    prompts: `[B, P]` int32; prompt_lengths `[B]`.
    tokens_per_call: T (1: a decode step, gamma + 1: a verification).
    capacity: cache slots S >= max(prompt_lengths) + T.
    num_steps: N calls per timed loop.
    tree: None, or the static parents of a tree-attention block (-1: its root).

  """
  check_positive_int("tokens_per_call", tokens_per_call)
  if tree is not None and len(tree) != tokens_per_call:
    raise ValueError(f"tree must have tokens_per_call={tokens_per_call} entries, got {len(tree)}.")
  check_positive_int("num_steps", num_steps)
  first, cache = jax.block_until_ready(
    _prefill_program(
      model,
      prompts,
      prompt_lengths,
      jax.random.key(0),
      capacity=capacity,
      sampling=SamplingParams(temperature=0.0),
    )
  )
  tokens = jnp.tile(first[:, None], (1, tokens_per_call))
  run = functools.partial(_decode_loop, model, tokens, cache, num_steps=num_steps, tree=tree)
  timings, _ = time_calls({"loop": run}, num_runs)
  return timings["loop"].median_s / num_steps


@functools.partial(jax.jit, static_argnames=("config", "num_steps"))
def _drafting_loop(target, drafter, state, *, config, num_steps: int):
  """`num_steps` x (propose gamma tokens, commit them) from one prefilled state.

  Every row is committed as stopped (constant work per step), but the state is
  still carried, or XLA would hoist a greedy proposal out of the loop.
  """
  b, g = state.recent.shape[0], config.gamma
  features = drafter.target_features
  width = (
    0 if features is False else target.cfg.d_model * (1 if features is True else len(features))
  )
  old = state.target_cache.lengths + 1
  stopped = old < 0  # False, but not a constant the compiler could fold away

  def body(i, carry):
    total, drafter_state = carry
    proposal, drafted = drafter.propose(
      drafter_state,
      state.recent,
      jax.random.fold_in(jax.random.key(1), i),
      jnp.full((b,), g, jnp.int32),
      gamma=g,
      sampling=config.sampling,
    )
    # A chain commits g + 1 tokens; a tree its deepest path and one token.
    kept = g if proposal.tree is None else proposal.tree.depth
    emitted = jnp.pad(proposal.tokens[:, :kept], ((0, 0), (0, 1)))
    hidden = None if features is False else jnp.zeros((b, kept + 1, width), jnp.float32)
    path = None if proposal.tree is None else jnp.zeros((b, kept), jnp.int32)
    committed = drafter.commit(drafted, Commit(emitted, old, old + kept + 1, stopped, hidden, path))
    return total + jnp.sum(proposal.tokens), committed

  return jax.lax.fori_loop(0, num_steps, body, (jnp.int32(0), state.drafter_state))[0]


def drafting_seconds(
  target: Transformer,
  drafter,
  prompts: jax.Array,
  prompt_lengths: jax.Array,
  *,
  gamma: int,
  max_new_tokens: int,
  sampling: SamplingParams,
  num_steps: int = 16,
  num_runs: int = 3,
) -> float:
  """Median seconds a drafter spends per speculative iteration: proposing
  `gamma` tokens for every row and committing a fully accepted block (a
  feature drafter's commit includes its head call)."""
  check_positive_int("gamma", gamma)
  check_positive_int("num_steps", num_steps)
  config = SpecConfig(gamma=gamma, max_new_tokens=max_new_tokens, sampling=sampling)
  drafter = as_drafter(drafter)
  state = jax.jit(init_state, static_argnames="config")(
    target, drafter, prompts, prompt_lengths, jax.random.key(0), config=config
  )
  run = functools.partial(
    _drafting_loop, target, drafter, state, config=config, num_steps=num_steps
  )
  timings, _ = time_calls({"drafting": run}, num_runs)
  return timings["drafting"].median_s / num_steps


def _draft_seconds(
  target: Transformer, draft, stats: dict[str, Any], gamma: int, target_s: float, step, drafting
) -> tuple[float, float]:
  """(drafting seconds per iteration, draft calls per iteration), for `draft_cost`:
  the calls a run's statistics counted (less the prefill's, not part of an iteration;
  a block drafter's one call per iteration is 1, whatever it drafts; prompt lookup's
  0). A model's call is timed alone (`step`: `call_seconds`), times its calls; any
  other drafter's proposal + commit (`drafting`: `drafting_seconds`)."""
  if draft is target:  # a perfect draft: c is 1 by definition
    return target_s * gamma, float(gamma)
  iterations = max(stats["iterations"], 1)
  if isinstance(draft, Transformer):
    calls = (stats["draft_calls"] - 1) / iterations
    return step(draft, tokens_per_call=1) * calls, calls
  return drafting(), (stats["draft_calls"] - as_drafter(draft).prefill_calls) / iterations


def predict_speedup(
  *,
  gamma: int,
  target_step_s: float,
  verify_s: float,
  drafting_s: float,
  alpha: float | None = None,
  tokens_per_iteration: float | None = None,
  draft_steps: float | None = None,
) -> dict[str, float]:
  """The cost ratio c = drafting_s / (draft_steps * target_step_s), verify_cost =
  verify_s / target_step_s and the speedup `theory.predicted_speedup` (or, given
  `tokens_per_iteration`, `theory.speedup_from_tokens`) predicts.

  Args:
    target_step_s, verify_s: seconds of a target call over 1 and gamma + 1 tokens.
    drafting_s: the drafter's seconds per iteration.
    alpha: the measured acceptance rate (clipped to 1); or
    tokens_per_iteration: measured, where no closed form exists (trees, host loops).
    draft_steps: None (c per drafted token, gamma of them), or a host loop's
      draft calls per iteration.


  Returns:
    `{"c", "verify_cost", "predicted_speedup"}`.
  """
  if (alpha is None) == (tokens_per_iteration is None):
    raise ValueError("predict_speedup takes exactly one of alpha and tokens_per_iteration.")
  steps = gamma if draft_steps is None else draft_steps
  c = drafting_s / (steps * target_step_s)
  verify_cost = verify_s / target_step_s
  if alpha is not None:
    predicted = theory.predicted_speedup(min(alpha, 1.0), gamma, c, verify_cost)
  else:
    predicted = theory.speedup_from_tokens(tokens_per_iteration, steps, c, verify_cost)
  return {"c": c, "verify_cost": verify_cost, "predicted_speedup": predicted}


def draft_cost(
  target: Transformer,
  draft,
  prompts: jax.Array,
  prompt_lengths: jax.Array,
  *,
  gamma: int,
  max_new_tokens: int,
  sampling: SamplingParams,
  stats: dict[str, Any],
  num_steps: int = 16,
  num_runs: int = 3,
) -> dict[str, float]:
  """Leviathan's cost ratio c of `draft`, the verification's cost, and the
  speedup they predict with the measured acceptance rate (`predict_speedup`).

  A `Transformer` draft's one-token step is timed (times the draft calls per
  iteration in `stats`, a run's `stats.summary()`); any other drafter's
  proposal + commit (`drafting_seconds`).

  Returns:
    `target_step_s`, `verify_s`, `drafting_s` (per iteration), `draft_call_s` (per
    draft call), `draft_calls_per_iteration` (calls, as counted), `c`,
    `verify_cost`, `predicted_speedup`.
  """
  capacity = cache_capacity(prompts.shape[1], max_new_tokens, gamma)  # as speculative_generate
  step = functools.partial(
    call_seconds,
    prompts=prompts,
    prompt_lengths=prompt_lengths,
    capacity=capacity,
    num_steps=num_steps,
    num_runs=num_runs,
  )
  drafting = functools.partial(
    drafting_seconds,
    target,
    draft,
    prompts,
    prompt_lengths,
    gamma=gamma,
    max_new_tokens=max_new_tokens,
    sampling=sampling,
    num_steps=num_steps,
    num_runs=num_runs,
  )
  target_s = step(target, tokens_per_call=1)
  drafting_s, draft_calls = _draft_seconds(target, draft, stats, gamma, target_s, step, drafting)
  verify_s = step(target, tokens_per_call=gamma + 1)
  prediction = predict_speedup(
    gamma=gamma,
    target_step_s=target_s,
    verify_s=verify_s,
    drafting_s=drafting_s,
    alpha=stats["acceptance_rate"],
  )
  return {
    "target_step_s": target_s,
    "verify_s": verify_s,
    "drafting_s": drafting_s,
    # one call's seconds (0 for a drafter that calls no model: all its cost is drafting_s)
    "draft_call_s": drafting_s / draft_calls if draft_calls > 0 else 0.0,
    "draft_calls_per_iteration": draft_calls,
    **prediction,
  }


def long_prompt_prefill(
  target: Transformer, draft: Transformer | None, batch: int, width: int = 512, num_runs: int = 3
) -> dict[str, Any]:
  """Time to first token for a long prompt: each model's jitted prefill of `width`
  random ids (None for a model whose `max_seq_len` is below `width`)."""

  out: dict[str, Any] = {"long_prompt_tokens": width}
  for name, model in (("target", target), ("draft", draft)):
    if model is None or model.cfg.max_seq_len < width:
      out[f"{name}_long_prefill_ms"] = None
      continue
    prompts, lengths = random_prompts(jax.random.key(1), batch, width, model.cfg.vocab_size)
    timing = prefill_timing(
      model,
      prompts,
      lengths,
      capacity=width,
      sampling=SamplingParams(temperature=0.0),
      key=jax.random.key(0),
      num_runs=num_runs,
    )
    out[f"{name}_long_prefill_ms"] = timing.median_s * 1e3
  return out
