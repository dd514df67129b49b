"""What both generation loops share: prefill, padding, output.

prefill         prompt through a fresh cache, first token sampled
prefill_first   the loops' prefill: the first token under the rows' text and rules
zero_padding    prompt ids past each row's length set to a valid id
first_done      rows finished by the prefill's token alone
is_eos          which tokens are an EOS (one id or several)
ends_row        which tokens end their row: EOS (unless ignored) or a stop id
bind_history    the rows' warp with the text its penalties read
finalize        output buffer cut to the budget, padded past each row's count
run_loop        a step repeated until every row is done ("while" or "chunked")
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax import constraints, coupling
from specjax.coupling import Coupling
from specjax.drafting.base import fixed_trip_loops
from specjax.models.transformer import Transformer
from specjax.sampling import (
  RowSampling,
  SamplingParams,
  TokenHistory,
  finite_rows,
  sample_tokens,
  warp_probs,
)


def prefill(
  model: Transformer,
  prompts: jax.Array,
  prompt_lengths: jax.Array,
  capacity: int,
  key: jax.Array | Coupling,
  sampling: SamplingParams,
  return_hidden: bool | tuple[int, ...] = False,
  constraint: tuple | None = None,
  mark_non_finite: bool = False,
):
  """Runs the prompt through a fresh cache and samples the first new token.

  Args:
    prompts: `[B, P]` right-padded; prompt_lengths `[B]` in [1, P].
    key: a key, or a `Coupling` whose noise at index 0 draws the first token.
    return_hidden: also return the model's features at every prompt position
      (`Transformer.forward_cached`), for draft heads.
    constraint: None, or `(ConstraintTable, states [B])`: the first token is
      drawn among the tokens each row's state allows (`specjax.constraints`).
    mark_non_finite: the first token is -1 where its law was not finite
      (`specjax.sampling.finite_rows`): the caller stops that row.

  Returns:
    `(first_token [B], cache)`, then `hidden [B, P, F]` if `return_hidden`; the
    cache holds the prompt (lengths = prompt_lengths), so the first token is
    the next to feed.
  """
  cache = model.init_cache(prompts.shape[0], capacity)
  out = model.forward_cached(
    prompts, cache, logit_indices=(prompt_lengths - 1)[:, None], return_hidden=return_hidden
  )
  logits = out[0][:, 0]
  if constraint is not None:  # the rows' grammars at their start states
    logits = constraints.mask_logits(logits, *constraint)
  if isinstance(key, Coupling):  # the rows' own noise at generated index 0
    probs = warp_probs(logits, sampling)
    first = coupling.sample_tokens(key, probs)
  else:
    first, probs = sample_tokens(key, logits, sampling)
  if mark_non_finite:
    first = jnp.where(finite_rows(probs), first, -1)
  cache = out[1].with_lengths(prompt_lengths)
  return (first, cache, out[2]) if return_hidden is not False else (first, cache)


def prefill_first(
  model: Transformer,
  prompts: jax.Array,
  prompt_lengths: jax.Array,
  capacity: int,
  key: jax.Array | Coupling,
  sampling: SamplingParams | RowSampling,
  eos_id: int | tuple[int, ...] | None,
  rules: constraints.RowConstraints | None = None,
  return_hidden: bool | tuple[int, ...] = False,
):
  """`prefill` as both loops start: the first token drawn under the rows' text
  (`start_history`), among what `rules`' start states allow, and marked where
  its law was not finite.

  Returns:
    `(first [B], broken [B], history, constraint_state, cache, hidden)`: first
    is 0 where broken (its law was not finite: the row stops with nothing
    generated); history and constraint_state are the rows' after `first` (None
    for a static warp, without rules); hidden is `[features]` if
    `return_hidden`, else `[]`.
  """
  history = start_history(sampling, prompts, prompt_lengths, model.cfg.vocab_size)
  first, cache, *hidden = prefill(
    model,
    prompts,
    prompt_lengths,
    capacity,
    key,
    bind_history(sampling, history, eos_id),
    return_hidden=return_hidden,
    constraint=None if rules is None else (rules.table, rules.start),
    mark_non_finite=True,
  )
  broken = first < 0  # its law was not finite: the row stops with nothing generated
  first = jnp.maximum(first, 0)
  history = None if history is None else history.after(first)
  state = None if rules is None else constraints.advance(rules.table, rules.start, first)
  return first, broken, history, state, cache, hidden


def zero_padding(prompts: jax.Array, prompt_lengths: jax.Array) -> jax.Array:
  """`[B, P]` prompts with every id past a row's length set to 0 (a valid id)."""
  valid = jnp.arange(prompts.shape[1])[None, :] < prompt_lengths[:, None]
  return jnp.where(valid, prompts, 0)


def is_eos(tokens: jax.Array, eos_id: int | tuple[int, ...]) -> jax.Array:
  """`tokens == eos_id` elementwise, or membership in a tuple of EOS ids
  (`specjax.validation.check_eos_ids` gives one or the other)."""
  if isinstance(eos_id, tuple):
    return jnp.isin(tokens, jnp.asarray(eos_id, tokens.dtype))
  return tokens == eos_id


def ends_row(
  tokens: jax.Array, eos_id: int | tuple[int, ...] | None, sampling: SamplingParams | RowSampling
) -> jax.Array:
  """`tokens [B, ...]` that end their row: an EOS id (unless the row's
  `ignore_eos`) or one of its `stop_token_ids`."""
  ends = jnp.zeros(tokens.shape, bool)
  rows = isinstance(sampling, RowSampling) and sampling.stop_token_ids is not None

  def per_row(x):
    return x.reshape(x.shape + (1,) * (tokens.ndim - 1))

  if eos_id is not None:
    eos = is_eos(tokens, eos_id)
    ends = ends | (eos & ~per_row(sampling.ignore_eos) if rows else eos)
  if rows:
    stop = sampling.stop_token_ids[:, None, :]  # [B, 1, S], -1: padding
    flat = tokens.reshape(tokens.shape[0], -1, 1)
    ends = ends | jnp.any((flat == stop) & (stop >= 0), axis=-1).reshape(tokens.shape)
  return ends


def start_history(
  sampling: SamplingParams | RowSampling, prompts: jax.Array, prompt_lengths: jax.Array, vocab: int
) -> TokenHistory | None:
  """The rows' `TokenHistory` before the first token (None for a static warp,
  which reads none)."""
  if not isinstance(sampling, RowSampling):
    return None
  return TokenHistory.of_prompts(prompts, prompt_lengths, vocab)


def bind_history(
  sampling: SamplingParams | RowSampling,
  history: TokenHistory | None,
  eos_id: int | tuple[int, ...] | None,
) -> SamplingParams | RowSampling:
  """The warp of rows whose text is `history` (`RowSampling.with_history`); a
  static warp as it is."""
  if not isinstance(sampling, RowSampling):
    return sampling
  return sampling.with_history(history, eos_id)


def first_done(
  first: jax.Array,
  max_new_tokens: int,
  eos_id: int | tuple[int, ...] | None,
  sampling: SamplingParams | RowSampling,
) -> jax.Array:
  """`[B]` bool: the prefill's token already ends the row (budget 1, EOS or a stop id)."""
  return jnp.full(first.shape, max_new_tokens <= 1) | ends_row(first, eos_id, sampling)


def finalize(
  tokens: jax.Array, num_generated: jax.Array, max_new_tokens: int, pad_id: int
) -> jax.Array:
  """Cuts the buffer to `[B, max_new_tokens]` and pads past each row's count."""
  tokens = tokens[:, :max_new_tokens]
  valid = jnp.arange(max_new_tokens)[None, :] < num_generated[:, None]
  return jnp.where(valid, tokens, pad_id)


def run_loop(step, state, loop: str, loop_chunk: int):
  """`state = step(state)` until every row is done (`state.done [B]` all True).

  loop="while" tests after every iteration; "chunked" runs `loop_chunk`
  iterations of known trip count per test (no GPU device-to-host wait per
  trip; docs/performance.md, "Loop modes"), the step's own loops too
  (`drafting.fixed_trip_loops`). Idle iterations after the last row finished
  change nothing (done rows commit nothing) and their statistics are not
  counted, so `stats.iterations`, which indexes the pre-drawn random numbers,
  stays put; only `stats` is selected, never the caches.


  Args:
    step: `state -> state`, pure, with `state.done` and `state.stats`.
    loop: "while" or "chunked" (`specjax.validation.check_loop`).
    loop_chunk: iterations per test of "chunked".
  """

  def going(s):
    return jnp.any(~s.done)

  if loop == "while":
    return jax.lax.while_loop(going, step, state)

  def masked(_, s):
    with fixed_trip_loops():
      new = step(s)
    counted = going(s)
    return new.replace(
      stats=jax.tree.map(lambda a, b: jnp.where(counted, a, b), new.stats, s.stats)
    )

  return jax.lax.while_loop(going, lambda s: jax.lax.fori_loop(0, loop_chunk, masked, s), state)
