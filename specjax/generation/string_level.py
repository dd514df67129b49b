"""String-level exact match (SLEM): a draft of another tokenizer drafts text.

Timor et al. 2025 (arXiv 2502.05202), SLEM; Hugging Face's universal assisted
generation. Each iteration:
  1. the host re-encodes the committed text in draft ids and feeds what changed
     (the draft's cache rolls back to the longest common prefix);
  2. the draft generates `draft_tokens` ids (one jitted call);
  3. the host re-encodes the last `window` committed tokens' text plus the
     drafted text with the target's tokenizer and proposes the ids after the
     window (if the window re-encodes differently: the drafted text's own
     encoding);
  4. `speculative_step` verifies it as a deterministic proposal (q one-hot).

This is exact at any temperature; the cost is a host round trip per iteration
(`StringLevelOutput.timings`). docs/cross_tokenizer.md compares it with TLI.
"""

from __future__ import annotations

import functools
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from specjax.drafting.base import DrafterBase, Proposal
from specjax.generation import validation
from specjax.generation.common import finalize, zero_padding
from specjax.generation.speculative import init_state, speculative_step
from specjax.generation.state import SpecConfig, SpeculativeStats
from specjax.models.kv_cache import KVCache
from specjax.models.transformer import Transformer
from specjax.sampling import SamplingParams, sample_tokens
from specjax.validation import check_positive_int
from specjax.vocab_map import backend_of, check_size, token_bytes


class StringLevelOutput(NamedTuple):
  """`GenerateOutput`'s fields plus where the time went.

  Attributes:
    tokens: `[B, max_new_tokens]` int32 target ids (pad_id past num_generated).
    num_generated: `[B]` int32.
    stats: `SpeculativeStats` (draft_calls counts the draft's jitted calls' model calls).
    timings: {"iterations", "host_seconds", "draft_seconds", "verify_seconds",
      "host_ms_per_iteration"}: host re-tokenisation against the two models' calls.
  """

  tokens: jax.Array
  num_generated: jax.Array
  stats: SpeculativeStats
  timings: dict[str, float]


@struct.dataclass
class GivenProposal(DrafterBase):
  """A drafter whose state is the host's proposal, `(tokens [B, gamma], lengths
  [B])`, set before each `speculative_step` (q one-hot)."""

  gamma: int = struct.field(pytree_node=False)
  vocab_size: int = struct.field(pytree_node=False)

  def init(self, prompts, prompt_lengths, first, capacity, hidden=None):
    b = prompts.shape[0]
    return jnp.zeros((b, self.gamma), jnp.int32), jnp.zeros((b,), jnp.int32)

  def propose(self, state, recent, key, limit, *, gamma, sampling):
    tokens, lengths = state
    return Proposal(tokens, None, jnp.minimum(lengths, limit), calls=jnp.int32(0)), state

  def commit(self, state, commit):
    return state


# The models travel as (static graph, parameters): flattening a module on every
# call of a host loop costs milliseconds (3 ms per call for the bundled target).
@functools.partial(jax.jit, static_argnames=("graph", "config"))
def _init(graph, params, drafter, prompts, prompt_lengths, key, *, config):
  target = nnx.merge(graph, params)
  return init_state(
    target, drafter, zero_padding(prompts, prompt_lengths), prompt_lengths, key, config
  )


# The state is donated (the host loop never reads it again): the caches are
# written in place instead of copied per iteration.
@functools.partial(jax.jit, static_argnames=("graph", "config"), donate_argnames=("state",))
def _step(graph, params, drafter, state, *, config):
  return speculative_step(nnx.merge(graph, params), drafter, state, config)


@functools.partial(
  jax.jit, static_argnames=("graph", "steps", "sampling"), donate_argnames=("cache",)
)
def _draft(
  graph,
  params,
  cache: KVCache,
  feed: jax.Array,
  feed_lengths: jax.Array,
  key: jax.Array,
  *,
  steps: int,
  sampling: SamplingParams,
) -> tuple[jax.Array, KVCache]:
  """Feeds row b's first `feed_lengths[b]` >= 1 ids of `feed [B, W]`, then
  generates `steps` ids: `([B, steps] ids, cache)` (all but the last fed)."""

  draft = nnx.merge(graph, params)
  logits, cache = draft.forward_cached(feed, cache, (feed_lengths - 1)[:, None])
  cache = cache.with_lengths(cache.lengths - feed.shape[1] + feed_lengths)
  keys = jax.random.split(key, steps)
  first, _ = sample_tokens(keys[0], logits[:, 0], sampling)

  def body(i, carry):
    tokens, cache = carry
    logits, cache = draft.forward_cached(tokens[:, i - 1][:, None], cache)
    token, _ = sample_tokens(keys[i], logits[:, 0], sampling)
    return tokens.at[:, i].set(token), cache

  tokens = jnp.zeros((feed.shape[0], steps), jnp.int32).at[:, 0].set(first)
  return jax.lax.fori_loop(1, steps, body, (tokens, cache))


def _text(pieces: list[bytes | None], ids) -> bytes:
  """The bytes of `ids` (ids with no text, e.g. specials, add nothing)."""
  return b"".join(pieces[i] or b"" if 0 <= i < len(pieces) else b"" for i in ids)


def _bucket(width: int) -> int:
  """Feed widths rounded up to a power of two (>= 8): few compiled shapes."""
  return max(8, 1 << (int(width) - 1).bit_length())


def _common_prefix(a: list[int], b: list[int]) -> int:
  n = 0
  for x, y in zip(a, b):
    if x != y:
      break
    n += 1
  return n


class _DraftSide:
  """The draft's host-side state: what each row's cache holds, in draft ids."""

  def __init__(self, draft, tokenizer, pieces, batch: int, capacity: int):
    self.graph, self.params = nnx.split(draft)
    self.backend = backend_of(tokenizer)
    self.pieces = pieces
    self.cache = draft.init_cache(batch, capacity)
    self.held: list[list[int]] = [[] for _ in range(batch)]
    self.calls = 0
    self.seconds = 0.0  # in the draft's jitted calls

  def continue_texts(self, texts: list[bytes], active, key, steps, sampling) -> list[bytes]:
    """Row b's draft continuation of `texts[b]` (b"" for rows that are not active or
    would outgrow the draft's cache)."""
    encodings = self.backend.encode_batch(
      [t.decode("utf-8", errors="ignore") for t in texts], add_special_tokens=False
    )
    capacity = self.cache.capacity
    held, keeps = [], []
    for b, enc in enumerate(encodings):
      ids = list(enc.ids) or [0]
      held.append(ids)
      # Feed at least one id: the logits after the last one start the draft.
      keeps.append(min(_common_prefix(self.held[b], ids), len(ids) - 1))
    fits = [bool(active[b]) and len(ids) + steps <= capacity for b, ids in enumerate(held)]
    width = min(
      capacity,
      _bucket(max((len(ids) - k for ids, k, ok in zip(held, keeps, fits) if ok), default=1)),
    )
    # The call writes `width` slots from each row's start; a row that does not fit
    # writes at slot 0 and drafts nothing.
    fits = [ok and k + width <= capacity for ok, k in zip(fits, keeps)]
    feed = np.zeros((len(held), width), np.int32)
    lengths = np.ones((len(held),), np.int32)
    starts = np.zeros((len(held),), np.int32)
    for b, (ids, k, ok) in enumerate(zip(held, keeps, fits)):
      self.held[b] = ids if ok else []
      if ok:
        feed[b, : len(ids) - k] = ids[k:]
        lengths[b], starts[b] = len(ids) - k, k
    t0 = time.perf_counter()
    tokens, self.cache = _draft(
      self.graph,
      self.params,
      self.cache.with_lengths(jnp.asarray(starts)),
      jnp.asarray(feed),
      jnp.asarray(lengths),
      key,
      steps=steps,
      sampling=sampling,
    )
    tokens = np.asarray(tokens)
    self.seconds += time.perf_counter() - t0
    self.calls += steps
    out = []
    for b in range(len(texts)):
      if not fits[b]:
        out.append(b"")
        continue
      self.held[b] = self.held[b] + tokens[b, :-1].tolist()
      ids = tokens[b].tolist()
      ends = [k for k, i in enumerate(ids) if i >= len(self.pieces) or self.pieces[i] is None]
      out.append(_text(self.pieces, ids[: ends[0]] if ends else ids))
    return out


def _propose(backend, pieces, committed: list[int], drafted: bytes, window: int, gamma: int):
  """At most `gamma` target ids continuing `committed` that spell the start of
  `drafted` (step 3 above)."""

  if not drafted:
    return []
  tail = committed[-window:]
  for k in range(len(tail) - 1, -1, -1):  # no special token inside the window
    if tail[k] >= len(pieces) or pieces[tail[k]] is None:
      tail = tail[k + 1 :]
      break
  text = (_text(pieces, tail) + drafted).decode("utf-8", errors="ignore")
  ids = backend.encode(text, add_special_tokens=False).ids
  if ids[: len(tail)] == tail:
    return ids[len(tail) : len(tail) + gamma]
  # The committed tail is not how the target's tokenizer would spell it (a model's
  # output need not be canonical): the drafted text's own encoding.
  own = backend.encode(drafted.decode("utf-8", errors="ignore"), add_special_tokens=False)
  return own.ids[:gamma]


def string_level_generate(
  target: Transformer,
  draft: Transformer,
  draft_tokenizer: Any,
  target_tokenizer: Any,
  prompts: jax.Array,
  prompt_lengths: jax.Array,
  *,
  gamma: int,
  max_new_tokens: int,
  sampling: SamplingParams = SamplingParams(),
  key: jax.Array | None = None,
  eos_id: int | list[int] | None = None,
  pad_id: int = 0,
  verifier: str = "auto",
  draft_tokens: int | None = None,
  window: int = 8,
) -> StringLevelOutput:
  """Exact speculative decoding with a draft of another tokenizer, through text.

  Args:
    target, draft: `specjax.Transformer`s; each model's vocab_size must cover
      its tokenizer.
    draft_tokenizer, target_tokenizer: `tokenizers.Tokenizer` or `specjax.data.Tokenizer`.
    prompts, prompt_lengths, max_new_tokens, sampling, key, eos_id, pad_id: as
      in `speculative_generate` (target ids).
    gamma: most target tokens proposed per iteration (>= 1).

    verifier: "auto" (greedy at temperature 0, else token), "token" or "block".
    draft_tokens: draft ids generated per iteration (>= 1); None = gamma + gamma // 2
      (a smaller vocabulary needs more ids for the same text).
    window: committed target tokens re-encoded with the draft's text (>= 1), so
      a token boundary the draft's text moves is caught.

  Returns:
    `StringLevelOutput(tokens [B, max_new_tokens], num_generated [B], stats, timings)`.
  """
  args, config, draft_tokens, window = _checked_run(
    target,
    draft,
    prompts,
    prompt_lengths,
    gamma=gamma,
    max_new_tokens=max_new_tokens,
    sampling=sampling,
    eos_id=eos_id,
    pad_id=pad_id,
    verifier=verifier,
    draft_tokens=draft_tokens,
    window=window,
  )
  draft_pieces, target_pieces = token_bytes(draft_tokenizer), token_bytes(target_tokenizer)
  check_size("draft_tokenizer", len(draft_pieces), draft.cfg.vocab_size)
  check_size("target_tokenizer", len(target_pieces), target.cfg.vocab_size)
  key = validation.check_key(key, sampling)
  # Twice the target's slots: rows whose text needs more stop drafting (see
  # `_DraftSide`); every draft call's cost grows with its cache.
  draft_capacity = min(draft.cfg.max_seq_len, 2 * args.capacity + 2 * draft_tokens)
  side = _DraftSide(draft, draft_tokenizer, draft_pieces, args.batch, draft_capacity)
  target_side = _TargetSide(target, target_tokenizer, target_pieces, config, window)
  draft_key, key = jax.random.split(key)
  state, iterations, verify_seconds, host_seconds = target_side.run(
    side, prompts, prompt_lengths, key, draft_key, draft_tokens
  )
  timings = dict(
    host_seconds=host_seconds - side.seconds,
    draft_seconds=side.seconds,
    verify_seconds=verify_seconds,
    iterations=iterations,
    host_ms_per_iteration=1e3 * (host_seconds - side.seconds) / max(1, iterations),
  )
  return StringLevelOutput(
    tokens=finalize(state.tokens, state.num_generated, args.max_new_tokens, args.pad_id),
    num_generated=state.num_generated,
    stats=state.stats.replace(draft_calls=jnp.int32(side.calls)),
    timings=timings,
  )


def _checked_run(
  target, draft, prompts, prompt_lengths, *, gamma, verifier, draft_tokens, window, **settings
) -> tuple[validation.GenerateArgs, SpecConfig, int, int]:
  """`string_level_generate`'s checks of its numbers and models, before anything
  compiles: `(args, config, draft_tokens, window)`."""
  gamma = check_positive_int("gamma", gamma)
  args = validation.check_generate_args(
    target.cfg,
    "target",
    prompts,
    prompt_lengths,
    gamma=gamma,
    per_row=False,  # a host loop over one warp
    **settings,
  )
  draft_tokens = check_positive_int(
    "draft_tokens", gamma + gamma // 2 if draft_tokens is None else draft_tokens
  )
  window = check_positive_int("window", window)
  if not isinstance(draft, Transformer):
    raise ValueError(f"draft must be a specjax.Transformer, got {type(draft).__name__}.")
  sampling = settings["sampling"]
  if sampling.has_warps:  # its host loop reads no token counts: refused, not dropped
    raise ValueError(
      "sampling: string-level decoding takes temperature, top_k and top_p only; "
      "penalties, logit_bias, min_p and the stop settings need speculative_generate "
      "(e.g. with a CrossTokenizerDrafter)."
    )
  config = SpecConfig(
    gamma=gamma,
    max_new_tokens=args.max_new_tokens,
    sampling=sampling,
    verifier=validation.resolve_verifier(verifier, sampling, allowed=("token", "block")),
    eos_id=args.eos_id,
    pad_id=args.pad_id,
    adaptive=None,
  )
  return args, config, draft_tokens, window


class _TargetSide:
  """The target's host-side loop: what each row committed, in target ids, and
  the jitted init and `speculative_step` on a proposal the host made."""

  def __init__(self, target, tokenizer, pieces, config: SpecConfig, window: int):
    self.graph, self.params = nnx.split(target)
    self.backend = backend_of(tokenizer)
    self.pieces = pieces
    self.vocab_size = target.cfg.vocab_size
    self.config = config
    self.window = window
    self.given = GivenProposal(gamma=config.gamma, vocab_size=target.cfg.vocab_size)

  def propose(self, committed: list[list[int]], drafted: list[bytes]):
    """`(proposal [B, gamma], proposed [B])` target ids spelling each row's draft."""
    gamma = self.config.gamma
    proposal = np.zeros((len(committed), gamma), np.int32)
    proposed = np.zeros((len(committed),), np.int32)
    for b, (ids, text) in enumerate(zip(committed, drafted)):
      ids = _propose(self.backend, self.pieces, ids, text, self.window, gamma)
      ids = [i for i in ids if i < self.vocab_size][:gamma]
      proposal[b, : len(ids)] = ids
      proposed[b] = len(ids)
    return proposal, proposed

  def run(self, side: _DraftSide, prompts, prompt_lengths, key, draft_key, draft_tokens: int):
    """Iterates until every row is done: `(state, iterations, verify_seconds,
    host_seconds)`, host seconds including the draft's calls."""
    config, graph, params = self.config, self.graph, self.params
    prompts = np.asarray(prompts, np.int32)
    lengths = np.asarray(prompt_lengths, np.int32)
    state = _init(
      graph, params, self.given, jnp.asarray(prompts), jnp.asarray(lengths), key, config=config
    )
    first = np.asarray(state.tokens[:, 0])
    committed = [prompts[b, : lengths[b]].tolist() + [int(first[b])] for b in range(len(first))]
    generated, done = np.ones((len(first),), np.int64), np.asarray(state.done)
    iteration, verify_seconds, host_seconds = 0, 0.0, 0.0
    while not done.all():
      t0 = time.perf_counter()
      texts = [_text(self.pieces, ids) for ids in committed]
      drafted = side.continue_texts(
        texts, ~done, jax.random.fold_in(draft_key, iteration), draft_tokens, config.sampling
      )
      proposal, proposed = self.propose(committed, drafted)
      t1 = time.perf_counter()
      state = state.replace(drafter_state=(jnp.asarray(proposal), jnp.asarray(proposed)))
      state = _step(graph, params, self.given, state, config=config)
      tokens, new_generated, done = jax.device_get((state.tokens, state.num_generated, state.done))
      t2 = time.perf_counter()
      for b, ids in enumerate(committed):
        ids.extend(tokens[b, generated[b] : new_generated[b]].tolist())
      generated = new_generated
      host_seconds += time.perf_counter() - t0 - (t2 - t1)
      verify_seconds += t2 - t1
      iteration += 1
    return state, iteration, verify_seconds, host_seconds
