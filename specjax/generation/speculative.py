"""Speculative decoding: one pure `speculative_step` inside one jitted while-loop.

An iteration reads like the algorithm (Leviathan et al. 2023, Chen et al. 2023):
  1. draft  - a drafter (`specjax.drafting`) proposes up to gamma tokens with their q;
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
from specjax.drafting import Drafter, ModelDrafter, fit_ids, proposal_probs
from specjax.models.kv_cache import write_rows
from specjax.models.transformer import Transformer
from specjax.sampling import SamplingParams, pad_vocab, warp_probs

ADAPTIVE = (None, "schedule", "confidence")


def as_drafter(draft: Transformer | Drafter) -> Drafter:
  """A `Transformer` becomes a `ModelDrafter`; drafters pass through."""
  return ModelDrafter(draft) if isinstance(draft, Transformer) else draft


def speculative_step(target: Transformer, drafter: Drafter | Transformer, state: SpecState,
                     config: SpecConfig) -> SpecState:
  """One speculative iteration for every row: draft, score, verify, commit.

  Pure: same models, drafter, state and config give the same new state. Rows
  already done run along (static shapes) but commit nothing and keep their
  lengths. Any `Drafter` plugs in; a row whose drafter proposed k < gamma
  tokens is verified as a block of k (q = 0 past them).
  """
  g = config.gamma
  drafter = as_drafter(drafter)
  key, draft_key, verify_key = jax.random.split(state.key, 3)
  active = ~state.done

  # 1. Draft.
  proposal, drafter_state = drafter.propose(state.drafter_state, state.recent, draft_key,
                                            state.draft_limit, config)
  draft_tokens, proposed = proposal.tokens, proposal.lengths

  # 2. Score gamma + 1 positions: s[-1] then the drafted tokens.
  block = jnp.concatenate([state.recent[:, 1:], draft_tokens], axis=1)  # [B, g+1]
  logits, target_cache = target.forward_cached(fit_ids(block, target.cfg.vocab_size),
                                               state.target_cache)
  # Both laws over one vocabulary: ids a model lacks get probability 0 there.
  vocab = max(target.cfg.vocab_size, drafter.vocab_size)
  target_probs = pad_vocab(warp_probs(logits, config.sampling), vocab)
  draft_probs = proposal_probs(proposal, vocab)

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

  # The target cache holds s'[:-1] for rows that go on. Rows that stopped keep
  # their old lengths so later (discarded) writes stay in bounds.
  goes_on = ~done
  old_length = state.target_cache.lengths + 1  # len(s)
  new_length = old_length + n + 1
  target_cache = target_cache.with_lengths(
      jnp.where(goes_on, new_length - 1, old_length - 1))
  drafter_state = drafter.commit(drafter_state, emitted, old_length, new_length, goes_on)
  history = jnp.concatenate([state.recent[:, 1:], emitted], axis=1)  # s[-1], emitted
  recent = jnp.take_along_axis(history, jnp.stack([n, n + 1], axis=1), axis=1)
  recent = jnp.where(goes_on[:, None], recent, state.recent)

  draft_limit = state.draft_limit
  if config.adaptive == "schedule":
    # Leviathan-style heuristic: +2 after a fully accepted block, -1 otherwise.
    longer = jnp.minimum(draft_limit + 2, g)
    shorter = jnp.maximum(draft_limit - 1, 1)
    draft_limit = jnp.where(active, jnp.where(n >= proposed, longer, shorter), draft_limit)

  stats = state.stats
  counted = active.astype(jnp.int32)
  stats = stats.replace(
      iterations=stats.iterations + 1,
      target_calls=stats.target_calls + 1,
      draft_calls=stats.draft_calls + proposal.calls,
      proposed=stats.proposed + counted * proposed,
      accepted=stats.accepted + counted * n,
      evaluated=stats.evaluated + counted * (n + (n < proposed)),
      row_iterations=stats.row_iterations + counted,
      generated=stats.generated + count,
      accepted_at_position=stats.accepted_at_position + jnp.sum(
          (jnp.arange(g)[None, :] < n[:, None]) & active[:, None], axis=0,
          dtype=jnp.int32),
  )
  return SpecState(target_cache=target_cache, drafter_state=drafter_state, recent=recent,
                   draft_limit=draft_limit, tokens=tokens, num_generated=num_generated,
                   done=done, key=key, stats=stats)


def init_state(target: Transformer, drafter: Drafter | Transformer, prompts: jax.Array,
               prompt_lengths: jax.Array, key: jax.Array, config: SpecConfig
               ) -> SpecState:
  """Prefills the target and the drafter and samples the first token from the target.

  Args:
    prompts: `[B, P]` right-padded (padding already zeroed); prompt_lengths `[B]`.
  """
  b, width = prompts.shape
  drafter = as_drafter(drafter)
  capacity = width + config.max_new_tokens + config.gamma + 1
  key, first_key = jax.random.split(key)
  first, target_cache = prefill(target, prompts, prompt_lengths, capacity, first_key,
                                config.sampling)
  last_prompt = jnp.take_along_axis(prompts, (prompt_lengths - 1)[:, None], axis=1)
  tokens = jnp.zeros((b, config.max_new_tokens + config.gamma + 1), jnp.int32)
  return SpecState(
      target_cache=target_cache,
      drafter_state=drafter.init(prompts, prompt_lengths, first, capacity),
      recent=jnp.concatenate([last_prompt, first[:, None]], axis=1),
      draft_limit=jnp.full((b,), config.gamma, jnp.int32),
      tokens=tokens.at[:, 0].set(first),
      num_generated=jnp.ones((b,), jnp.int32),
      done=first_done(first, config.max_new_tokens, config.eos_id),
      key=key,
      stats=SpeculativeStats.zeros(b, config.gamma,
                                   draft_calls=int(isinstance(drafter, ModelDrafter))))


@functools.partial(jax.jit, static_argnames=("config",))
def _speculative_program(target, drafter, prompts, prompt_lengths, key, *,
                         config: SpecConfig) -> GenerateOutput:
  TRACE_COUNTS["speculative"] += 1
  prompts = zero_padding(prompts, prompt_lengths)
  state = init_state(target, drafter, prompts, prompt_lengths, key, config)
  state = jax.lax.while_loop(lambda s: jnp.any(~s.done),
                             lambda s: speculative_step(target, drafter, s, config), state)
  return GenerateOutput(
      tokens=finalize(state.tokens, state.num_generated, config.max_new_tokens,
                      config.pad_id),
      num_generated=state.num_generated, stats=state.stats)


def speculative_generate(target: Transformer, draft: Transformer | Drafter,
                         prompts: jax.Array, prompt_lengths: jax.Array, *, gamma: int,
                         max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
                         key: jax.Array | None = None, eos_id: int | None = None,
                         verifier: str = "auto", pad_id: int = 0,
                         adaptive: str | None = None,
                         confidence_threshold: float = 0.5) -> GenerateOutput:
  """Exact speculative decoding of up to `max_new_tokens` tokens per row.

  The output has the target's own distribution under `sampling` (token
  verification), and at temperature 0 equals the target's greedy decoding.

  Args:
    target: the `specjax.Transformer` whose distribution the output follows.
    draft: a `Transformer` over the same tokenizer (vocabulary sizes may
      differ: ids a model lacks get probability 0 in its law; the target itself
      is allowed, a perfect draft that exposes the overhead), or any
      `specjax.drafting` drafter (`NGramDrafter`, `layer_skip(target, k)`, ...).
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
    adaptive: per-row draft length within `gamma`: None (always gamma),
      "schedule" (+2 after a fully accepted block, -1 otherwise, from gamma) or
      "confidence" (a model drafter stops when its top probability falls below
      `confidence_threshold`). Exactness is unchanged.
    confidence_threshold: in (0, 1], for adaptive="confidence".

  Returns:
    `GenerateOutput(tokens [B, max_new_tokens], num_generated [B],
    stats: SpeculativeStats)`.
  """
  tcfg = target.cfg
  drafter = as_drafter(draft)
  validation.check_positive_int("gamma", gamma)
  validation.check_positive_int("max_new_tokens", max_new_tokens)
  validation.check_sampling(sampling, tcfg.vocab_size)
  validation.check_prompts(prompts, prompt_lengths, tcfg.vocab_size)
  validation.check_token_id("eos_id", eos_id, tcfg.vocab_size)
  slack = gamma + 1
  validation.check_capacity("target", tcfg, prompts.shape[1], max_new_tokens, slack)
  if isinstance(drafter, ModelDrafter):
    validation.check_capacity("draft", drafter.model.cfg, prompts.shape[1], max_new_tokens,
                              slack)
  if adaptive not in ADAPTIVE:
    raise ValueError(f"adaptive must be one of {ADAPTIVE}, got {adaptive!r}.")
  if adaptive == "confidence":
    if not isinstance(drafter, ModelDrafter):
      raise ValueError("adaptive='confidence' needs a model drafter (a Transformer, "
                       f"ModelDrafter or layer_skip), got {type(drafter).__name__}.")
    if not 0 < confidence_threshold <= 1:
      raise ValueError(f"confidence_threshold must be in (0, 1], got {confidence_threshold!r}.")
    drafter = drafter.replace(confidence=float(confidence_threshold))
  if verifier == "auto":
    verifier = "greedy" if sampling.greedy else "token"
  verify_lib.get_verifier(verifier)  # raises on an unknown name
  if verifier == "greedy" and not sampling.greedy:
    raise ValueError("verifier='greedy' needs temperature 0; use 'token', 'block' or 'auto'.")
  key = validation.check_key(key, sampling)
  config = SpecConfig(gamma=int(gamma), max_new_tokens=int(max_new_tokens),
                      sampling=sampling, verifier=verifier, eos_id=eos_id,
                      pad_id=int(pad_id), adaptive=adaptive)
  # Modules (and drafters) are passed as pytrees, as in autoregressive_generate.
  return _speculative_program(target, drafter, jnp.asarray(prompts, jnp.int32),
                              jnp.asarray(prompt_lengths, jnp.int32), key, config=config)
