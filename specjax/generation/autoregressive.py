"""Autoregressive decoding: the baseline speculative decoding must match and beat.

The whole loop is one `jax.jit` program around `lax.while_loop` (`run_loop`):
prefill, then one token per step for every row, with per-row EOS and budgets.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from specjax import compiler_options, coupling
from specjax import constraints as constraints_lib
from specjax.coupling import Coupling
from specjax.generation import validation
from specjax.generation.common import (
  bind_history,
  ends_row,
  finalize,
  first_done,
  prefill_first,
  run_loop,
  zero_padding,
)
from specjax.generation.state import ARState, AutoregressiveStats, GenerateOutput
from specjax.models.kv_cache import write_rows
from specjax.models.transformer import Transformer
from specjax.sampling import (
  RowSampling,
  SamplingParams,
  finite_rows,
  sample_with_uniform,
  warp_probs,
)
from specjax.validation import check_loop


def autoregressive_step(
  model: Transformer,
  state: ARState,
  sampling: SamplingParams | RowSampling,
  max_new_tokens: int,
  eos_id: int | tuple[int, ...] | None,
  table: constraints_lib.ConstraintTable | None = None,
) -> ARState:
  """Feeds each row's last token, samples the next, commits it for active rows
  (with `table`, among the tokens its constraint state allows)."""
  active = ~state.done
  sampling = bind_history(sampling, state.history, eos_id)
  logits, cache = model.forward_cached(state.last[:, None], state.cache)
  if table is not None:
    logits = constraints_lib.mask_logits(logits, table, state.constraint_state[:, None])
  if sampling.greedy:  # the argmax of the logits is the argmax of the one-hot warp
    law = logits[:, 0]
    token = jnp.argmax(law, axis=-1).astype(jnp.int32)
  elif state.row_keys is not None:  # the rows' own noise at the index drawn
    gumbel = coupling.noise(state.row_keys, state.num_generated, 1, model.cfg.vocab_size)
    law = warp_probs(logits[:, 0], sampling)
    token = coupling.gumbel_max(law, gumbel[:, 0])
  else:
    u = state.uniforms[jnp.minimum(state.stats.iterations, state.uniforms.shape[0] - 1)]
    law = warp_probs(logits[:, 0], sampling)
    token = sample_with_uniform(u, law)
  # A row whose law was not finite stops and keeps nothing of this draw.
  broken = active & ~finite_rows(law)
  done_before, active = state.done | broken, active & ~broken
  # Finished rows keep their length, so their writes stay inside the capacity;
  # what they write into the output buffer lies past num_generated (padded later).
  cache = cache.with_lengths(jnp.where(active, cache.lengths, state.cache.lengths))
  tokens = write_rows(state.tokens, token[:, None], state.num_generated)
  num_generated = state.num_generated + active.astype(jnp.int32)
  done = (
    done_before | (num_generated >= max_new_tokens) | (active & ends_row(token, eos_id, sampling))
  )
  stats = AutoregressiveStats(
    iterations=state.stats.iterations + 1,
    target_calls=state.stats.target_calls + 1,
    non_finite=state.stats.non_finite | broken.astype(jnp.int32),
  )
  return ARState(
    cache=cache,
    last=jnp.where(active, token, state.last),
    tokens=tokens,
    num_generated=num_generated,
    done=done,
    uniforms=state.uniforms,
    stats=stats,
    row_keys=state.row_keys,
    history=None if state.history is None else state.history.after(token, active.astype(jnp.int32)),
    constraint_state=None
    if table is None
    else jnp.where(
      active, constraints_lib.advance(table, state.constraint_state, token), state.constraint_state
    ),
  )


# Models go into jit as pytrees (Flax NNX modules are pytrees): flattening them
# costs far less per call than nnx.split, and the module structure and config
# become part of the cache key. `compiler_options.jit`: jax.jit with the
# platform's options (on GPU, the loop as one command buffer).
@functools.partial(
  compiler_options.jit,
  static_argnames=(
    "sampling",
    "max_new_tokens",
    "eos_id",
    "pad_id",
    "capacity",
    "loop",
    "loop_chunk",
    "coupled",
  ),
)
def _autoregressive_program(
  model,
  prompts,
  prompt_lengths,
  key,
  rows,
  rules=None,
  *,
  sampling,
  max_new_tokens,
  eos_id,
  pad_id,
  capacity,
  loop="while",
  loop_chunk=8,
  coupled=False,
) -> GenerateOutput:
  sampling = rows if sampling is None else sampling  # per-row settings are data
  prompts = zero_padding(prompts, prompt_lengths)
  b = prompts.shape[0]
  key, row_keys = coupling.split_keys(key, b, coupled)
  key, first_key = jax.random.split(key)
  if coupled:
    zero = jnp.zeros((b,), jnp.int32)
    first_key = Coupling.of(row_keys, zero, 1, model.cfg.vocab_size, first_key)
  first, broken, history, constraint_state, cache, _ = prefill_first(
    model, prompts, prompt_lengths, capacity, first_key, sampling, eos_id, rules
  )
  # One slot of slack: finished rows keep writing at num_generated <= max_new_tokens.
  tokens = jnp.zeros((b, max_new_tokens + 1), jnp.int32).at[:, 0].set(first)
  state = ARState(
    cache=cache,
    last=first,
    tokens=tokens,
    num_generated=jnp.where(broken, 0, 1).astype(jnp.int32),
    done=first_done(first, max_new_tokens, eos_id, sampling) | broken,
    history=history,
    # All of the loop's random numbers in one computation, before it: a step
    # then only reads its row of uniforms.
    uniforms=jax.random.uniform(key, (0 if sampling.greedy or coupled else max_new_tokens, b)),
    stats=AutoregressiveStats(jnp.int32(0), jnp.int32(1), broken.astype(jnp.int32)),
    row_keys=row_keys,
    constraint_state=constraint_state,
  )
  table = None if rules is None else rules.table
  state = run_loop(
    lambda s: autoregressive_step(model, s, sampling, max_new_tokens, eos_id, table),
    state,
    loop,
    loop_chunk,
  )
  return GenerateOutput(
    tokens=finalize(state.tokens, state.num_generated, max_new_tokens, pad_id),
    num_generated=state.num_generated,
    stats=state.stats,
  )


def autoregressive_generate(
  model: Transformer,
  prompts: jax.Array,
  prompt_lengths: jax.Array,
  *,
  max_new_tokens: int,
  sampling: SamplingParams | RowSampling = SamplingParams(),
  key: jax.Array | None = None,
  eos_id: int | list[int] | None = None,
  pad_id: int = 0,
  loop: str = "while",
  loop_chunk: int = 8,
  sampler: str = "auto",
  constraints: constraints_lib.RowConstraints | None = None,
) -> GenerateOutput:
  """Decodes up to `max_new_tokens` tokens per row, one model call per token.

  Args:
    model: a `specjax.Transformer`.
    prompts, prompt_lengths, max_new_tokens, sampling, key, eos_id, pad_id: as
      in `speculative_generate` (`RowSampling`: each row its own, no recompile).

    loop, loop_chunk: "while" or "chunked" (a test per `loop_chunk` steps,
      static), as in `speculative_generate`. Same tokens and statistics.
    sampler: how sampled tokens are drawn: "inverse_cdf" (one uniform per row
      and step, from `key`), "coupled" (Gumbel-max with each row's own noise at
      each generated index, `specjax.coupling`: the text `speculative_generate`
      gives with verifier="coupled" and the same keys, whatever the drafter),
      or "auto": "coupled" when `key` is one key per row (`[B]`), else
      "inverse_cdf".
    constraints: None, or `specjax.constraints.RowConstraints` (a regex, JSON
      schema or choice per row, or none): each token is drawn from the warped
      law masked to what the row's automaton allows; EOS only where the text
      is complete. A new constraint of the same table bucket does not recompile.


  Returns:
    `GenerateOutput(tokens [B, max_new_tokens], num_generated [B], stats)`.
  """
  sampling = validation.as_rows(sampling, model.cfg.vocab_size, prompts)
  args = validation.check_generate_args(
    model.cfg,
    "model",
    prompts,
    prompt_lengths,
    max_new_tokens=max_new_tokens,
    sampling=sampling,
    eos_id=eos_id,
    pad_id=pad_id,
  )
  loop, loop_chunk = check_loop(loop, loop_chunk)
  key = validation.check_key(key, sampling, batch=args.batch)
  coupled = check_sampler(sampler, coupling.is_key_batch(key))
  return _autoregressive_program(
    model,
    jnp.asarray(prompts, jnp.int32),
    jnp.asarray(prompt_lengths, jnp.int32),
    key,
    sampling if isinstance(sampling, RowSampling) else None,
    constraints_lib.check_rows(constraints, args.batch, model.cfg.vocab_size),
    sampling=None if isinstance(sampling, RowSampling) else sampling,
    max_new_tokens=args.max_new_tokens,
    eos_id=args.eos_id,
    pad_id=args.pad_id,
    capacity=args.capacity,
    loop=loop,
    loop_chunk=loop_chunk,
    coupled=coupled and not (isinstance(sampling, SamplingParams) and sampling.greedy),
  )


SAMPLERS = ("auto", "inverse_cdf", "coupled")


def check_sampler(sampler: str, per_row_keys: bool) -> bool:
  """Whether `autoregressive_generate` draws coupled; a ValueError naming
  `sampler` when it is unknown or "inverse_cdf" with per-row keys."""
  if sampler not in SAMPLERS:
    raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}.")
  if sampler == "inverse_cdf" and per_row_keys:
    raise ValueError(
      "sampler='inverse_cdf' draws one batch of uniforms, so it cannot use one key per "
      "row: pass sampler='coupled' (or 'auto') with per-row keys, or one key."
    )
  return sampler == "coupled" or (sampler == "auto" and per_row_keys)
