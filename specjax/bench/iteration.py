"""Where one speculative iteration's time goes: each part timed alone, and the
kernels each loop body launches (`specjax.bench.hlo`).

Each part runs `repeats` times inside one jitted `fori_loop`:
  target_forward_{1,gamma_plus_1}_ms   the target's forward over 1 and gamma + 1 tokens
  draft_forward_1_ms                   one draft call
  draft_propose_ms                     a whole proposal (gamma calls, warp and sampling)
  verify_ms                            target forward over gamma + 1, warp, verification
  prefill_ms                           the target's prefill (time to first token)
  ar_ms_per_token                      a whole autoregressive call / max_new_tokens
  spec_ms_per_iteration                a whole speculative call less the prefill,
                                       / iterations
  rest_of_iteration_ms                 spec - propose - score_verify: the commit
  overhead_fraction                    share of an iteration that is neither model's forward

and, from the compiled programs, the kernels of an AR step, a speculative
iteration and one draft call.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

import specjax
from specjax.bench import hlo
from specjax.bench.costs import call_seconds, prefill_timing
from specjax.bench.timing import time_calls
from specjax.drafting import ModelDrafter, Proposal
from specjax.generation.autoregressive import _autoregressive_program
from specjax.generation.speculative import _speculative_program, verifier_inputs
from specjax.generation.state import SpecConfig
from specjax.models.kv_cache import cache_capacity
from specjax.models.transformer import Transformer
from specjax.validation import check_positive_int
from specjax.verify import get_verifier


def _kernels(ar_text: str, spec_text: str) -> dict:
  """Kernels per loop body: the AR step, the speculative iteration, one draft call."""
  ar = max(hlo.loop_kernels(ar_text), key=lambda loop: loop["kernels"])
  counts = hlo.kernel_counts(spec_text)
  bodies = hlo.while_bodies(spec_text)
  outer = [b for b in bodies if counts[b]["while"]]
  spec = max(outer, key=lambda b: sum(counts[b].values()))
  # The draft loop: the largest other body (random-bit loops are small).
  draft = max((b for b in bodies if b != spec), key=lambda b: sum(counts[b].values()))
  return {
    "ar_step_kernels": ar["kernels"],
    "spec_iteration_kernels": sum(counts[spec].values()),
    "draft_call_kernels": sum(counts[draft].values()),
    "spec_iteration_calls": counts[spec]["call"],  # random-bit loops called per iteration
  }


@functools.partial(jax.jit, static_argnames=("config", "repeats"))
def _propose_loop(drafter, state, last, key, *, config: SpecConfig, repeats: int):
  """`repeats` whole proposals of `config.gamma` tokens after `last [1]` and a
  varying token (so no proposal is loop-invariant)."""
  gamma = config.gamma

  def body(i, acc):
    recent = jnp.stack([last, jnp.full((1,), i % 97)], axis=1)
    proposal, _ = drafter.propose(
      state,
      recent.astype(jnp.int32),
      jax.random.fold_in(key, i),
      jnp.full((1,), gamma, jnp.int32),
      gamma=gamma,
      sampling=config.sampling,
    )
    return acc + proposal.tokens[0, 0]

  return jax.lax.fori_loop(0, repeats, body, 0)


@functools.partial(jax.jit, static_argnames=("config", "repeats"))
def _score_verify_loop(model, cache, key, *, config: SpecConfig, repeats: int):
  """`repeats` x as the step does it: the target over gamma + 1 tokens, then the
  verifier's inputs (warp, q) and the rule itself."""
  gamma, sampling, vocab = config.gamma, config.sampling, model.cfg.vocab_size
  q = jax.nn.softmax(jnp.zeros((1, gamma, vocab)))

  def body(i, acc):
    block = jnp.full((1, gamma + 1), i % 97, jnp.int32)
    logits, _ = model.forward_cached(block, cache)
    proposal = Proposal(
      block[:, 1:], None if sampling.greedy else q, jnp.full((1,), gamma), jnp.int32(gamma)
    )
    inputs = verifier_inputs(proposal, logits, sampling, vocab, sampling.greedy)
    n, y = get_verifier(config.verifier)(jax.random.fold_in(key, i), *inputs)
    return acc + n[0] + y[0]

  return jax.lax.fori_loop(0, repeats, body, 0)


def _loop_texts(target, draft, prompts, lengths, key, config: SpecConfig) -> tuple[str, str]:
  """The compiled HLO of autoregressive and speculative decoding."""
  drafter = ModelDrafter(draft)
  ar = _autoregressive_program.lower(
    target,
    prompts,
    lengths,
    key,
    None,
    sampling=config.sampling,
    max_new_tokens=config.max_new_tokens,
    eos_id=None,
    pad_id=0,
    capacity=cache_capacity(prompts.shape[1], config.max_new_tokens),
  )
  spec = _speculative_program.lower(target, drafter, prompts, lengths, key, config=config)
  return ar.compile().as_text(), spec.compile().as_text()


def profile_iteration(
  target: Transformer,
  draft: Transformer,
  prompts: jax.Array,
  lengths: jax.Array,
  *,
  gamma: int = 4,
  repeats: int = 100,
  max_new_tokens: int = 64,
  temperature: float = 0.0,
  num_runs: int = 5,
  trace_dir: str | None = None,
) -> dict[str, Any]:
  """Milliseconds of each part of a speculative iteration (see the module doc).

  Args:
    target, draft: the pair; the draft drafts with `ModelDrafter`.
    prompts: `[1, P]` int32, one row; lengths `[1]`.
    gamma, max_new_tokens, temperature: the decoding profiled.
    repeats: iterations of each part's jitted loop; num_runs: runs (median).
    trace_dir: also write a `jax.profiler` trace of one generate call there.

  """
  check_positive_int("gamma", gamma)
  check_positive_int("repeats", repeats)
  check_positive_int("max_new_tokens", max_new_tokens)
  sampling = specjax.SamplingParams(temperature=temperature)
  verifier = "greedy" if sampling.greedy else "token"
  config = SpecConfig(
    gamma=gamma, max_new_tokens=max_new_tokens, sampling=sampling, verifier=verifier
  )
  key = jax.random.key(0)
  stats = _speculative(target, draft, prompts, lengths, key, config).stats
  iterations = int(stats.iterations)
  draft_calls = (int(stats.draft_calls) - 1) / max(iterations, 1)
  capacity = cache_capacity(prompts.shape[1], max_new_tokens, gamma)
  forward = functools.partial(
    call_seconds,
    prompts=prompts,
    prompt_lengths=lengths,
    capacity=capacity,
    num_steps=repeats,
    num_runs=num_runs,
  )
  result = {
    "gamma": gamma,
    "temperature": float(temperature),
    "target_params": target.num_params,
    "draft_params": draft.num_params,
    "target_forward_1_ms": 1e3 * forward(target, tokens_per_call=1),
    "target_forward_gamma_plus_1_ms": 1e3 * forward(target, tokens_per_call=gamma + 1),
    "draft_forward_1_ms": 1e3 * forward(draft, tokens_per_call=1),
  }
  args = (target, draft, prompts, lengths, key, config)
  result.update(_part_ms(*args, capacity=capacity, repeats=repeats, num_runs=num_runs))
  # The prefill is paid once per call, not per iteration (at the 1b shape it was
  # a tenth of the call, which `rest_of_iteration_ms` used to absorb).
  result["prefill_ms"] = 1e3 * (
    prefill_timing(
      target, prompts, lengths, capacity=capacity, sampling=sampling, key=key, num_runs=num_runs
    ).median_s
  )
  spec_ms = (result.pop("spec_ms_per_run") - result["prefill_ms"]) / iterations
  result["spec_ms_per_iteration"] = spec_ms
  models_ms = result["target_forward_gamma_plus_1_ms"] + draft_calls * result["draft_forward_1_ms"]
  result["rest_of_iteration_ms"] = spec_ms - result["draft_propose_ms"] - result["verify_ms"]
  result["overhead_fraction"] = 1 - models_ms / spec_ms
  result["iterations"] = iterations
  result["draft_calls_per_iteration"] = draft_calls
  result.update(_kernels(*_loop_texts(*args)))
  if trace_dir:
    with jax.profiler.trace(trace_dir):
      jax.block_until_ready(_speculative(*args).tokens)
  return {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}


def _speculative(target, draft, prompts, lengths, key, config: SpecConfig):
  """`speculative_generate` with `config`'s settings."""
  return specjax.speculative_generate(
    target,
    draft,
    prompts,
    lengths,
    gamma=config.gamma,
    max_new_tokens=config.max_new_tokens,
    sampling=config.sampling,
    key=key,
  )


def _part_ms(
  target, draft, prompts, lengths, key, config: SpecConfig, *, capacity, repeats, num_runs
) -> dict[str, float]:
  """Milliseconds of a proposal (`draft_propose_ms`), a scored and verified block
  (`verify_ms`), an autoregressive token (`ar_ms_per_token`) and a whole
  speculative call (`spec_ms_per_run`), timed together (`time_calls`)."""
  drafter = ModelDrafter(draft)
  cache = target.init_cache(1, capacity)
  cache = target.forward_cached(prompts, cache)[1].with_lengths(lengths)
  draft_state = drafter.init(prompts, lengths, jnp.zeros((1,), jnp.int32), capacity)
  last = prompts[:, int(lengths[0]) - 2]
  loops = dict(config=config, repeats=repeats)
  generate = dict(max_new_tokens=config.max_new_tokens, sampling=config.sampling, key=key)
  # name -> (call, units of work per call): a call's time / units is the figure.
  parts = {
    "draft_propose_ms": (lambda: _propose_loop(drafter, draft_state, last, key, **loops), repeats),
    "verify_ms": (lambda: _score_verify_loop(target, cache, key, **loops), repeats),
    "ar_ms_per_token": (
      lambda: specjax.autoregressive_generate(target, prompts, lengths, **generate).tokens,
      config.max_new_tokens,
    ),
    "spec_ms_per_run": (
      lambda: _speculative(target, draft, prompts, lengths, key, config).tokens,
      1,
    ),
  }
  timings, _ = time_calls({name: fn for name, (fn, _) in parts.items()}, num_runs)
  return {name: timings[name].median_s * 1e3 / units for name, (_, units) in parts.items()}
