"""Speculative decoding: one pure `speculative_step` inside one jitted while-loop.

An iteration reads like the algorithm (Leviathan et al. 2023, Chen et al. 2023):
  1. draft  - gamma draft calls (`lax.scan`) propose x_1..x_gamma with their q;
  2. score  - one target call over gamma + 1 positions gives p;
  3. verify - a verifier keeps n tokens and draws one more;
  4. commit - per-row output buffer, cache lengths (rollback is bookkeeping),
              EOS / budget, statistics.
Rows accept different numbers of tokens and stay in one compiled program.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from specjax import verify as verify_lib
from specjax.generation import validation
from specjax.generation.autoregressive import (TRACE_COUNTS, finalize, first_done, prefill,
                                               zero_padding)
from specjax.generation.state import (GenerateOutput, SpecConfig, SpeculativeStats,
                                      SpecState)
from specjax.models.kv_cache import write_rows
from specjax.models.transformer import Transformer
from specjax.sampling import SamplingParams, sample_tokens, warp_probs


def fit_ids(tokens: jax.Array, model: Transformer) -> jax.Array:
  """Maps ids the model's vocabulary lacks to 0 before feeding them to it.

  With draft and target of different vocabulary sizes the other model can emit
  such ids. Whatever the draft reads, its q is still the law its proposal was
  drawn from, so exactness is unaffected; a target never keeps an id it lacks
  (its p there is 0).
  """
  return jnp.where(tokens < model.cfg.vocab_size, tokens, 0)


def pad_vocab(probs: jax.Array, vocab_size: int) -> jax.Array:
  """Zero-pads probabilities `[..., V_model]` to `[..., vocab_size]`."""
  extra = vocab_size - probs.shape[-1]
  return jnp.pad(probs, [(0, 0)] * (probs.ndim - 1) + [(0, extra)]) if extra else probs


def draft_block(draft: Transformer, state: SpecState, key: jax.Array,
                config: SpecConfig):
  """Proposes gamma tokens per row with the draft model.

  The first call feeds `state.recent = [s[-2], s[-1]]` (2 tokens, re-syncing the
  cache), the other gamma - 1 calls one token each inside a `lax.scan`.

  Returns:
    `(tokens [B, gamma] int32, probs [B, gamma, V_draft] float32, draft_cache)`;
    probs[:, i] is the distribution tokens[:, i] was drawn from.
  """
  keys = jax.random.split(key, config.gamma)
  logits, cache = draft.forward_cached(
      fit_ids(state.recent, draft), state.draft_cache,
      logit_indices=jnp.ones((state.recent.shape[0], 1), jnp.int32))
  first, first_probs = sample_tokens(keys[0], logits[:, 0], config.sampling)

  def one(carry, step_key):
    token, cache = carry
    logits, cache = draft.forward_cached(token[:, None], cache)
    token, probs = sample_tokens(step_key, logits[:, 0], config.sampling)
    return (token, cache), (token, probs)

  (_, cache), (rest, rest_probs) = jax.lax.scan(one, (first, cache), keys[1:])
  tokens = jnp.concatenate([first[:, None], rest.T], axis=1)
  probs = jnp.concatenate([first_probs[:, None], jnp.swapaxes(rest_probs, 0, 1)], axis=1)
  return tokens, probs, cache


def speculative_step(target: Transformer, draft: Transformer, state: SpecState,
                     config: SpecConfig) -> SpecState:
  """One speculative iteration for every row: draft, score, verify, commit.

  Pure: same models, state and config give the same new state. Rows already
  done run along (static shapes) but commit nothing and keep their lengths.
  """
  g = config.gamma
  key, draft_key, verify_key = jax.random.split(state.key, 3)
  active = ~state.done

  # 1. Draft.
  draft_tokens, draft_probs, draft_cache = draft_block(draft, state, draft_key, config)

  # 2. Score gamma + 1 positions: s[-1] then the drafted tokens.
  block = jnp.concatenate([state.recent[:, 1:], draft_tokens], axis=1)  # [B, g+1]
  logits, target_cache = target.forward_cached(fit_ids(block, target), state.target_cache)
  target_probs = warp_probs(logits, config.sampling)
  # Both laws over one vocabulary: ids a model lacks get probability 0 there.
  vocab = max(target.cfg.vocab_size, draft.cfg.vocab_size)
  draft_probs, target_probs = pad_vocab(draft_probs, vocab), pad_vocab(target_probs, vocab)

  # 3. Verify.
  verifier = verify_lib.get_verifier(config.verifier)
  n, next_token = verifier(verify_key, draft_tokens, draft_probs, target_probs)

  # 4. Commit. emitted = x_1..x_n, y (then junk up to g + 1 slots).
  slots = jnp.arange(g + 1)[None, :]
  emitted = jnp.where(slots == n[:, None], next_token[:, None],
                      jnp.pad(draft_tokens, ((0, 0), (0, 1))))
  count = n + 1
  hit_eos = jnp.zeros_like(active)
  if config.eos_id is not None:
    is_eos = (emitted == config.eos_id) & (slots < count[:, None])
    hit_eos = jnp.any(is_eos, axis=1)
    count = jnp.where(hit_eos, jnp.argmax(is_eos, axis=1) + 1, count)
  count = jnp.minimum(count, config.max_new_tokens - state.num_generated)
  count = jnp.where(active, count, 0)
  tokens = write_rows(state.tokens, emitted, state.num_generated)
  num_generated = state.num_generated + count
  done = state.done | (num_generated >= config.max_new_tokens) | (active & hit_eos)

  # Caches: target holds s'[:-1], draft s'[:-2], for rows that go on. Rows that
  # stopped keep their old lengths so later (discarded) writes stay in bounds.
  old = state.target_cache.lengths
  goes_on = ~done
  target_cache = target_cache.with_lengths(jnp.where(goes_on, old + n + 1, old))
  draft_cache = draft_cache.with_lengths(
      jnp.where(goes_on, old + n, state.draft_cache.lengths))
  history = jnp.concatenate([state.recent[:, 1:], emitted], axis=1)  # s[-1], emitted
  recent = jnp.take_along_axis(history, jnp.stack([n, n + 1], axis=1), axis=1)
  recent = jnp.where(goes_on[:, None], recent, state.recent)

  stats = state.stats
  counted = active.astype(jnp.int32)
  stats = stats.replace(
      iterations=stats.iterations + 1,
      target_calls=stats.target_calls + 1,
      draft_calls=stats.draft_calls + g,
      accepted=stats.accepted + counted * n,
      evaluated=stats.evaluated + counted * (n + (n < g)),
      row_iterations=stats.row_iterations + counted,
      generated=stats.generated + count,
      accepted_at_position=stats.accepted_at_position + jnp.sum(
          (jnp.arange(g)[None, :] < n[:, None]) & active[:, None], axis=0,
          dtype=jnp.int32),
  )
  return SpecState(target_cache=target_cache, draft_cache=draft_cache, recent=recent,
                   tokens=tokens, num_generated=num_generated, done=done, key=key,
                   stats=stats)


def init_state(target: Transformer, draft: Transformer, prompts: jax.Array,
               prompt_lengths: jax.Array, key: jax.Array, config: SpecConfig
               ) -> SpecState:
  """Prefills both models and samples the first token from the target.

  Args:
    prompts: `[B, P]` right-padded (padding already zeroed); prompt_lengths `[B]`.
  """
  b, width = prompts.shape
  capacity = width + config.max_new_tokens + config.gamma + 1
  key, first_key = jax.random.split(key)
  first, target_cache = prefill(target, prompts, prompt_lengths, capacity, first_key,
                                config.sampling)
  # The draft needs no logits here; one position keeps the head cheap.
  _, draft_cache = draft.forward_cached(fit_ids(prompts, draft),
                                        draft.init_cache(b, capacity),
                                        logit_indices=jnp.zeros((b, 1), jnp.int32))
  last_prompt = jnp.take_along_axis(prompts, (prompt_lengths - 1)[:, None], axis=1)
  tokens = jnp.zeros((b, config.max_new_tokens + config.gamma + 1), jnp.int32)
  return SpecState(
      target_cache=target_cache,
      draft_cache=draft_cache.with_lengths(prompt_lengths - 1),
      recent=jnp.concatenate([last_prompt, first[:, None]], axis=1),
      tokens=tokens.at[:, 0].set(first),
      num_generated=jnp.ones((b,), jnp.int32),
      done=first_done(first, config.max_new_tokens, config.eos_id),
      key=key,
      stats=SpeculativeStats.zeros(b, config.gamma))


@functools.partial(jax.jit, static_argnames=("config",))
def _speculative_program(target, draft, prompts, prompt_lengths, key, *,
                         config: SpecConfig) -> GenerateOutput:
  TRACE_COUNTS["speculative"] += 1
  prompts = zero_padding(prompts, prompt_lengths)
  state = init_state(target, draft, prompts, prompt_lengths, key, config)
  state = jax.lax.while_loop(lambda s: jnp.any(~s.done),
                             lambda s: speculative_step(target, draft, s, config), state)
  return GenerateOutput(
      tokens=finalize(state.tokens, state.num_generated, config.max_new_tokens,
                      config.pad_id),
      num_generated=state.num_generated, stats=state.stats)


def speculative_generate(target: Transformer, draft: Transformer, prompts: jax.Array,
                         prompt_lengths: jax.Array, *, gamma: int, max_new_tokens: int,
                         sampling: SamplingParams = SamplingParams(),
                         key: jax.Array | None = None, eos_id: int | None = None,
                         verifier: str = "auto", pad_id: int = 0) -> GenerateOutput:
  """Exact speculative decoding of up to `max_new_tokens` tokens per row.

  The output has the target's own distribution under `sampling` (token
  verification), and at temperature 0 equals the target's greedy decoding.

  Args:
    target, draft: `specjax.Transformer`s over the same tokenizer; their
      vocabulary sizes may differ (ids a model lacks get probability 0 in its
      law). The same object twice is allowed: a perfect draft that exposes the
      overhead.
    prompts: `[B, P]` int32, right-padded; the padding is ignored.
    prompt_lengths: `[B]` int32 in [1, P].
    gamma: drafted tokens per iteration (>= 1, static).
    max_new_tokens: budget per row (>= 1, static).
    sampling: the warp shared by draft and target; temperature 0 is greedy.
    key: PRNG key; required unless sampling is greedy.
    eos_id: stop a row after it emits this id (kept and counted).
    verifier: "auto" (greedy at temperature 0, else token), "token", "block" or
      "greedy".
    pad_id: value of `tokens` past each row's `num_generated`.

  Returns:
    `GenerateOutput(tokens [B, max_new_tokens], num_generated [B],
    stats: SpeculativeStats)`.
  """
  tcfg, dcfg = target.cfg, draft.cfg
  validation.check_positive_int("gamma", gamma)
  validation.check_positive_int("max_new_tokens", max_new_tokens)
  validation.check_sampling(sampling, tcfg.vocab_size)
  validation.check_prompts(prompts, prompt_lengths, tcfg.vocab_size)
  validation.check_token_id("eos_id", eos_id, tcfg.vocab_size)
  slack = gamma + 1
  validation.check_capacity("target", tcfg, prompts.shape[1], max_new_tokens, slack)
  validation.check_capacity("draft", dcfg, prompts.shape[1], max_new_tokens, slack)
  if verifier == "auto":
    verifier = "greedy" if sampling.greedy else "token"
  verify_lib.get_verifier(verifier)  # raises on an unknown name
  if verifier == "greedy" and not sampling.greedy:
    raise ValueError("verifier='greedy' needs temperature 0; use 'token', 'block' or 'auto'.")
  key = validation.check_key(key, sampling)
  config = SpecConfig(gamma=int(gamma), max_new_tokens=int(max_new_tokens),
                      sampling=sampling, verifier=verifier, eos_id=eos_id,
                      pad_id=int(pad_id))
  # Modules are passed as pytrees, as in autoregressive_generate.
  return _speculative_program(target, draft, jnp.asarray(prompts, jnp.int32),
                              jnp.asarray(prompt_lengths, jnp.int32), key, config=config)
