"""Continuous batching with speculation: a fixed set of slots that requests come and go through.

Each `Engine.step()`:
  1. admits queued requests into free slots (prefill into that slot's rows of
     the caches, first token sampled; the other slots keep their state);
  2. keeps the live rows in front (a finished slot is refilled, or the last
     live row moves into it) and picks the smallest compiled width that holds
     them, so a light load runs a small batch;
  3. asks the speculation policy for the draft length (0 = a plain step);
  4. runs one speculative iteration (or plain step) for every slot of that
     width: one compiled program per (width, draft length), the very
     `speculative_step` of `speculative_generate`;
  5. streams each request's newly committed tokens and frees finished slots.

Every shape is static (slots, cache capacity, a few prompt-width buckets), so
after `warmup()` requests of any length and settings never recompile. Buckets
and the per-request budget left unset are fitted to the models' context
(`fit_config`). Each
request brings its own budget, stop id and sampling settings (`RowSampling`
rows: greedy and sampled requests share a step). The engine is
single-threaded; `specjax.serving.background` runs it behind a thread for
servers.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafting import Drafter, as_drafter
from specjax.generation.state import SpecConfig
from specjax.models.kv_cache import check_capacity
from specjax.models.transformer import Transformer
from specjax.sampling import GREEDY, RowSampling, SamplingParams
from specjax.serving import slots as programs
from specjax.serving.metrics import percentiles
from specjax.serving.policy import POLICIES, SpeculationPolicy
from specjax.serving.request import Completion, Event, Request
from specjax.validation import check_eos_ids, check_positive_int, is_int

logger = logging.getLogger(__name__)

# The derived largest prompt bucket and generation budget are at most this: each
# slot's caches hold prompt + budget + gamma + 1 positions, and a long-context
# model (32k positions) would otherwise get caches that long in every slot.
DERIVED_CAP = 256


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Static settings of an engine (each distinct value compiles its own programs).

  Attributes:
    slots: B, requests decoded at once.
    gamma: the largest draft length (the caches' verification slack).
    policy: "never" (plain decoding; needs no drafter), "always" (draft
      `gamma` every step) or "adaptive" (`SpeculationPolicy`: per step, from
      the batch width and the measured acceptance).
    gammas: the draft lengths the adaptive policy chooses among (compiled
      each); default (0, gamma).
    prompt_buckets: prompt widths compiled for prefill; a prompt is padded to
      the smallest that holds it; the largest is the longest prompt accepted.
      None: derived from the models' context (`fit_config`).
    max_new_tokens: the most tokens one request may ask for. None: derived
      from the models' context (`fit_config`).
    widths: batch widths compiled for steps (the live rows run at the
      smallest that holds them); default: powers of 2 up to `slots`, then
      `slots`.
    seed: the engine's PRNG seed (every random choice derives from it, the
      step count and the request count).
  """

  slots: int = 16
  gamma: int = 4
  policy: str = "adaptive"
  gammas: tuple[int, ...] | None = None
  prompt_buckets: tuple[int, ...] | None = None
  max_new_tokens: int | None = None
  widths: tuple[int, ...] | None = None
  seed: int = 0

  def __post_init__(self):
    check_positive_int("slots", self.slots)
    check_positive_int("gamma", self.gamma)
    if self.max_new_tokens is not None:
      check_positive_int("max_new_tokens", self.max_new_tokens)
    if self.policy not in POLICIES:
      raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}.")
    if self.prompt_buckets is not None:
      buckets = tuple(self.prompt_buckets)
      if not buckets or not all(is_int(p) and p >= 1 for p in buckets):
        raise ValueError(
          f"prompt_buckets must be non-empty integers >= 1 (or None: fit the model), "
          f"got {buckets!r}."
        )
      object.__setattr__(self, "prompt_buckets", tuple(sorted(set(int(p) for p in buckets))))
    if self.gammas is not None:
      gammas = tuple(self.gammas)
      if not gammas or not all(is_int(g) and 0 <= g <= self.gamma for g in gammas):
        raise ValueError(f"gammas must be integers in [0, gamma={self.gamma}], got {gammas!r}.")
      object.__setattr__(self, "gammas", tuple(sorted(set(int(g) for g in gammas))))
    if self.widths is not None:
      widths = tuple(self.widths)
      if not widths or not all(is_int(w) and 1 <= w <= self.slots for w in widths):
        raise ValueError(f"widths must be integers in [1, slots={self.slots}], got {widths!r}.")
      object.__setattr__(self, "widths", tuple(sorted(set(int(w) for w in widths) | {self.slots})))
    if not is_int(self.seed):
      raise ValueError(f"seed must be an integer, got {self.seed!r}.")

  @property
  def max_prompt_len(self) -> int | None:
    """The largest prompt bucket (None while the buckets are left to `fit_config`)."""
    return None if self.prompt_buckets is None else self.prompt_buckets[-1]

  @property
  def step_widths(self) -> tuple[int, ...]:
    if self.widths is not None:
      return self.widths
    powers = [w for w in (2**i for i in range(self.slots.bit_length())) if w < self.slots]
    return (*powers, self.slots)

  @property
  def draft_lengths(self) -> tuple[int, ...]:
    """The draft lengths the engine compiles (0 = plain steps)."""
    if self.policy == "never":
      return (0,)
    if self.policy == "always":
      return (self.gamma,)
    return self.gammas if self.gammas is not None else (0, self.gamma)


def context_limit(
  target: Transformer, draft: Transformer | Drafter | None = None
) -> tuple[str, int]:
  """`(role, max_seq_len)` of the shorter context: the target's, or a draft
  model's ("draft") when it is shorter. Drafters without a model of their own
  (prompt lookup, heads on the target) do not limit it."""
  limit = ("target", target.cfg.max_seq_len)
  drafter = None if draft is None else as_drafter(draft)
  model = getattr(drafter, "model", None)
  if isinstance(model, Transformer) and model.cfg.max_seq_len < limit[1]:
    limit = ("draft", model.cfg.max_seq_len)
  return limit


def fit_config(
  config: EngineConfig,
  target: Transformer,
  draft: Transformer | Drafter | None = None,
  *,
  names: Mapping[str, str] | None = None,
) -> EngineConfig:
  """`config` with prompt buckets and a generation budget that fit the models' context.

  A slot holds `max(prompt_buckets) + max_new_tokens + gamma + 1` positions in
  the target's cache and in a draft model's: at most the shorter `max_seq_len`,
  C. What `config` leaves None is derived from C (and logged):
    - the largest prompt bucket P is the largest power of two <= C / 2 (<= 256;
      given `max_new_tokens`, <= what it leaves), with P / 2 and P / 4 below;
    - max_new_tokens = C - P - gamma - 1 (<= 256).
  The caps keep a long-context model's caches small; set the fields for more.
  Given values are kept and checked. Nothing is compiled.

  Args:
    config: the engine's settings.
    target: the target `Transformer`.
    draft: the draft `Transformer` or drafter; None for plain decoding.
    names: how messages name `prompt_buckets`, `max_new_tokens` and `gamma`
      (e.g. a launcher's flags); default those field names.

  Returns:
    `config` with `prompt_buckets` and `max_new_tokens` set.

  Raises:
    ValueError: they cannot fit C; the message names the fields to change.
  """
  n = {k: k for k in ("prompt_buckets", "max_new_tokens", "gamma")}
  n.update(names or {})
  pb, mnt, gm = n["prompt_buckets"], n["max_new_tokens"], n["gamma"]
  role, context = context_limit(target, draft)
  gamma = config.gamma
  room = context - gamma - 1  # positions for the prompt and the new tokens
  where = f"{role}: max_seq_len={context}"
  if room < 2:
    raise ValueError(
      f"{where} holds no prompt and new token besides {gm} + 1 ({gamma + 1}); lower {gm}"
      + (f" (at most {context - 3})." if context >= 4 else "; this model's context is too short.")
    )
  largest, budget = config.max_prompt_len, config.max_new_tokens
  unset = f"or leave {pb} and {mnt} unset to fit them to the model"
  if largest is not None and budget is not None:
    if largest + budget > room:
      hints = []
      if room - largest >= 1:
        hints.append(f"{mnt}={room - largest} fits these buckets")
      if room - budget >= 1:
        hints.append(f"a largest bucket <= {room - budget} fits this {mnt}")
      hint = f" ({'; '.join(hints)})" if hints else ""
      raise ValueError(
        f"{role}: the largest of {pb} ({largest}) + {mnt} ({budget}) + {gm} + 1 ({gamma + 1}) "
        f"= {largest + budget + gamma + 1} exceeds max_seq_len={context}; lower {pb}, {mnt} "
        f"or {gm}{hint}, {unset}."
      )
    return config
  if largest is not None:  # the budget is what the buckets leave
    if room - largest < 1:
      raise ValueError(
        f"{role}: the largest of {pb} ({largest}) + {gm} + 1 ({gamma + 1}) leaves no room for "
        f"new tokens in max_seq_len={context}; lower {pb} (at most {room - 1}) or {gm}."
      )
    fitted = dataclasses.replace(config, max_new_tokens=min(DERIVED_CAP, room - largest))
  else:
    if budget is not None:
      if room - budget < 1:
        raise ValueError(
          f"{role}: {mnt} ({budget}) + {gm} + 1 ({gamma + 1}) leaves no room for a prompt in "
          f"max_seq_len={context}; lower {mnt} (at most {room - 1}) or {gm}."
        )
      top = _power_of_two_at_most(min(DERIVED_CAP, room - budget))
    else:
      top = _power_of_two_at_most(min(DERIVED_CAP, context // 2))
      while top > 1 and room - top < 1:
        top //= 2
      budget = min(DERIVED_CAP, room - top)
    buckets = tuple(sorted({max(1, top // 4), max(1, top // 2), top}))
    fitted = dataclasses.replace(config, prompt_buckets=buckets, max_new_tokens=budget)
  logger.info(
    "engine: prompt_buckets=%s, max_new_tokens=%d (derived for %s max_seq_len=%d, gamma=%d)",
    fitted.prompt_buckets,
    fitted.max_new_tokens,
    role,
    context,
    gamma,
  )
  return fitted


def _power_of_two_at_most(x: int) -> int:
  return 1 << (max(1, x).bit_length() - 1)


@dataclasses.dataclass
class _Live:
  """Host bookkeeping of a request that holds a slot (or waits for one)."""

  request_id: int
  request: Request
  arrival_time: float
  emitted: int = 0  # tokens streamed so far
  tokens: list[int] = dataclasses.field(default_factory=list)
  first_token_time: float | None = None


class Engine:
  """Serves requests through `config.slots` slots with speculative decoding.

  Args:
    target: the `specjax.Transformer` whose distribution every request follows.
    draft: a draft `Transformer` or any `specjax.drafting` drafter; None for
      plain decoding (policy "never").
    config: `EngineConfig`; prompt buckets and max_new_tokens left None are
      fitted to the models' context (`fit_config`), and `self.config` holds
      the values in use.
    eos_ids: the model's EOS id(s): every request stops after emitting one.
  """

  def __init__(
    self,
    target: Transformer,
    draft: Transformer | Drafter | None = None,
    config: EngineConfig = EngineConfig(),
    *,
    eos_ids: int | list[int] | tuple[int, ...] | None = None,
  ):
    self.target = target
    self.vocab_size = target.cfg.vocab_size
    if draft is None and config.policy != "never":
      raise ValueError(f"draft is None: policy must be 'never', got {config.policy!r}.")
    self.drafter = None if draft is None else as_drafter(draft)
    if self.drafter is not None and getattr(self.drafter, "tree", None) is not None:
      raise ValueError(
        f"draft: {type(self.drafter).__name__} drafts token trees; the engine takes chain "
        "drafters (a draft model, prompt lookup, layer skip, draft heads without a tree)."
      )
    self.config = config = fit_config(config, target, self.drafter)
    self.eos_ids = check_eos_ids("eos_ids", eos_ids, self.vocab_size)
    gamma = config.gamma
    capacity = check_capacity(
      "target", target.cfg.max_seq_len, config.max_prompt_len, config.max_new_tokens, gamma
    )
    if self.drafter is not None:
      self.drafter.check_capacity(config.max_prompt_len, config.max_new_tokens, gamma)
      if hasattr(self.drafter, "check_target"):
        self.drafter.check_target(target)
    self._programs = programs.SlotConfig(
      spec=SpecConfig(
        gamma=gamma,
        max_new_tokens=config.max_new_tokens,
        sampling=None,  # every row its own (RowSampling)
        verifier="token",  # exact for any mix of greedy and sampled rows
        eos_id=self.eos_ids,
      ),
      capacity=capacity,
      max_prompt_len=config.max_prompt_len,
    )
    self.policy = SpeculationPolicy(config.policy, config.draft_lengths)
    self._key, self._admit_key = jax.random.split(jax.random.key(config.seed))
    b = config.slots
    self._state = self._blank()
    if self.drafter is not None:
      programs.check_per_row(self._state.spec.drafter_state, b, "draft state")
    self._slots: list[_Live | None] = [None] * b
    self._queue: collections.deque[_Live] = collections.deque()
    self._queued: dict[int, _Live] = {}
    self._pending: list[Event] = []  # cancellations, streamed by the next step
    self._completions: collections.OrderedDict[int, Completion] = collections.OrderedDict()
    self._ids = itertools.count()
    self._steps = 0
    self._admitted = 0
    self._drafter_stale = False
    self.counters = collections.Counter()
    self._recent = collections.deque(maxlen=1000)  # the last completions, for metrics

  # ------------------------------------------------------------------ requests

  def check(self, request: Request) -> None:
    """Raises a ValueError naming the field when `request` cannot be served."""
    if not isinstance(request, Request):
      raise ValueError(f"request must be a specjax.serving.Request, got {type(request).__name__}.")
    prompt = np.asarray(request.prompt)
    if prompt.ndim != 1 or prompt.size == 0 or not np.issubdtype(prompt.dtype, np.integer):
      raise ValueError(
        f"prompt must be a non-empty list of token ids, got {len(request.prompt)} items "
        f"of dtype {prompt.dtype}."
      )
    if prompt.size > self.config.max_prompt_len:
      raise ValueError(
        f"prompt has {prompt.size} tokens; the engine takes at most "
        f"max_prompt_len={self.config.max_prompt_len}."
      )
    bad = (prompt < 0) | (prompt >= self.vocab_size)
    if bad.any():
      i = int(np.argmax(bad))
      raise ValueError(
        f"prompt must hold token ids in [0, vocab_size={self.vocab_size}); got {prompt[i]} "
        f"at position {i}."
      )
    cap = self.config.max_new_tokens
    if not is_int(request.max_new_tokens) or not 1 <= request.max_new_tokens <= cap:
      raise ValueError(f"max_new_tokens must be in [1, {cap}], got {request.max_new_tokens!r}.")
    if not isinstance(request.sampling, SamplingParams):
      raise ValueError(f"sampling must be a specjax.SamplingParams, got {request.sampling!r}.")
    if request.sampling.top_k > self.vocab_size:
      raise ValueError(
        f"sampling.top_k must be in [0, vocab_size={self.vocab_size}], got "
        f"{request.sampling.top_k}."
      )
    if request.stop_id is not None and (
      not is_int(request.stop_id) or not 0 <= request.stop_id < self.vocab_size
    ):
      raise ValueError(
        f"stop_id must be None or an id in [0, vocab_size={self.vocab_size}), got "
        f"{request.stop_id!r}."
      )

  def submit(self, request: Request) -> int:
    """Queues `request`; returns its id. Raises a ValueError naming the field for
    a request the engine cannot serve (nothing is queued then)."""
    self.check(request)
    request_id = next(self._ids)
    live = _Live(request_id, request, time.perf_counter())
    self._queue.append(live)
    self._queued[request_id] = live
    self.counters["submitted"] += 1
    return request_id

  def cancel(self, request_id: int) -> None:
    """Stops a request now: its slot is freed (or it leaves the queue); the next
    `step()` streams its final event, finish_reason "cancelled". A request that
    already finished is left as it is."""
    if request_id in self._queued:
      live = self._queued.pop(request_id)
      self._queue.remove(live)
      self._pending.append(self._finish(live, "cancelled"))
      return
    for slot, live in enumerate(self._slots):
      if live is not None and live.request_id == request_id:
        mask = np.zeros(self.config.slots, bool)
        mask[slot] = True
        self._state = programs.release(self._state, jnp.asarray(mask))
        self._slots[slot] = None
        self._pending.append(self._finish(live, "cancelled"))
        return

  def _blank(self) -> programs.SlotState:
    """A batch of free slots (every row done)."""
    b = self.config.slots
    return programs.blank(
      self.target,
      self.drafter,
      jnp.zeros((b, 1), jnp.int32),
      jnp.ones((b,), jnp.int32),
      jnp.ones((b,), jnp.int32),  # budget 1: every blank slot is done
      jnp.full((b,), -1, jnp.int32),
      RowSampling.of(GREEDY, b),
      self._key,
      config=self._programs,
    )

  def has_work(self) -> bool:
    return bool(self._queue or self._pending) or self.live_requests() > 0

  def live_requests(self) -> int:
    return sum(live is not None for live in self._slots)

  def completion(self, request_id: int) -> Completion:
    """The finished request's `Completion` (KeyError if it has not finished)."""
    return self._completions[request_id]

  def pop_completion(self, request_id: int) -> Completion:
    return self._completions.pop(request_id)

  def run(self, requests: list[Request]) -> list[Completion]:
    """Submits `requests` at once and steps until all are done (offline use)."""
    ids = [self.submit(r) for r in requests]
    while self.has_work():
      self.step()
    return [self.pop_completion(i) for i in ids]

  # ---------------------------------------------------------------- the step

  def step(self) -> list[Event]:
    """Admits, runs one iteration for the live slots, streams what they committed."""
    events, self._pending = self._pending, []
    events += self._admit()
    if not self.live_requests():
      return events
    width = self._compact()
    live = [i for i, s in enumerate(self._slots) if s is not None]
    gamma = self.policy.choose(width)
    if gamma and self._drafter_stale:
      self._state = programs.resync(
        self.target, self.drafter, self._state, width=width, config=self._programs
      )
      self._drafter_stale = False
    # The step is timed for the policy: what was dispatched before it (moves, a
    # resync) must not count in its time.
    jax.block_until_ready(self._state.spec.done)
    start = time.perf_counter()
    key = jax.random.fold_in(self._key, self._steps)
    try:
      counts = self._run_step(gamma, width, key)
      spec = self._state.spec
      tokens, num_generated, done, counts, stats = jax.device_get(
        (spec.tokens, spec.num_generated, spec.done, counts, self._row_stats())
      )
    except Exception as error:  # the batch's state is gone (donated): start afresh
      return events + self._fail_live(f"engine step failed: {type(error).__name__}: {error}")
    seconds = time.perf_counter() - start
    self._steps += 1
    self._drafter_stale |= gamma == 0
    committed = sum(int(num_generated[i]) - self._slots[i].emitted for i in live)
    self.policy.observe(
      gamma, width, seconds, int(counts[0]), int(counts[1]), tokens=committed, rows=len(live)
    )
    self.counters[f"steps_gamma_{gamma}"] += 1
    self.counters["accepted"] += int(counts[0])
    self.counters["evaluated"] += int(counts[1])
    return events + self._stream(tokens, num_generated, done, stats)

  def _run_step(self, gamma: int, width: int, key: jax.Array) -> jax.Array:
    """Dispatches one step program on the batch; returns its (accepted,
    evaluated) drafted-token counts. A plain step takes no drafter: its
    dispatch would flatten the draft model's parameters for nothing (about 1
    ms a step on the bundled pair, 5% of a plain step at 16 rows)."""
    self._state, counts = programs.step(
      self.target,
      self.drafter if gamma else None,
      self._state,
      key,
      gamma=gamma,
      width=width,
      config=self._programs,
    )
    return counts

  def _fail_live(self, message: str) -> list[Event]:
    """Fails every live request and empties the slots (a fresh blank batch)."""
    events = []
    for slot, live in enumerate(self._slots):
      if live is not None:
        self._slots[slot] = None
        events.append(self._finish(live, "error", message))
    self._state = self._blank()
    self._drafter_stale = False
    return events

  def _row_stats(self):
    s = self._state.spec.stats
    return s.proposed, s.accepted, s.evaluated, s.row_iterations

  def _admit(self) -> list[Event]:
    """Prefills queued requests into the lowest free slots; streams first tokens."""
    admitted = []
    events = []
    # After plain steps the drafter is re-synced from every row before it
    # drafts again: prefilling it now would be work thrown away.
    target_only = self._drafter_stale and self.drafter is not None
    drafter = None if target_only else self.drafter
    while self._queue and None in self._slots:
      live = self._queue.popleft()
      del self._queued[live.request_id]
      slot = self._slots.index(None)
      request = live.request
      prompt = np.asarray(request.prompt, np.int32)
      width = next(p for p in self.config.prompt_buckets if p >= prompt.size)
      key = jax.random.fold_in(self._admit_key, self._admitted)
      self._admitted += 1
      try:
        self._state = programs.admit(
          self.target,
          drafter,
          self._state,
          jnp.int32(slot),
          jnp.asarray(np.pad(prompt, (0, width - prompt.size))[None]),
          jnp.asarray([prompt.size], jnp.int32),
          jnp.asarray([request.max_new_tokens], jnp.int32),
          jnp.asarray([-1 if request.stop_id is None else request.stop_id], jnp.int32),
          RowSampling.of([request.sampling]),
          key,
          config=self._programs,
        )
      except Exception as error:  # one request's failure is its own
        events.append(self._finish(live, "error", f"{type(error).__name__}: {error}"))
        continue
      self._slots[slot] = live
      admitted.append(slot)
      self.counters["admitted_target_only"] += target_only
    if admitted:
      spec = self._state.spec
      tokens, num_generated, done, stats = jax.device_get(
        (spec.tokens, spec.num_generated, spec.done, self._row_stats())
      )
      events += self._stream(tokens, num_generated, done, stats, only=admitted)
    return events

  def _stream(self, tokens, num_generated, done, stats, only=None) -> list[Event]:
    """Events for the slots' newly committed tokens; finished slots are freed."""
    now = time.perf_counter()
    events = []
    for slot in range(self.config.slots) if only is None else only:
      live = self._slots[slot]
      if live is None:
        continue
      new = tokens[slot, live.emitted : num_generated[slot]].tolist()
      if new and live.first_token_time is None:
        live.first_token_time = now
      live.emitted = int(num_generated[slot])
      live.tokens += new
      self.counters["tokens"] += len(new)
      if done[slot]:
        self._slots[slot] = None
        last = live.tokens[-1]
        stopped = last == live.request.stop_id or (
          self.eos_ids is not None and last in np.atleast_1d(self.eos_ids)
        )
        events.append(
          self._finish(live, "stop" if stopped else "length", tokens=new, stats=stats, slot=slot)
        )
      elif new:
        events.append(Event(live.request_id, tuple(new)))
    return events

  def _finish(
    self, live: _Live, reason: str, error=None, tokens=(), stats=None, slot=None
  ) -> Event:
    proposed = accepted = evaluated = iterations = 0
    if stats is not None:
      proposed, accepted, evaluated, iterations = (int(x[slot]) for x in stats)
    completion = Completion(
      request_id=live.request_id,
      prompt_length=len(live.request.prompt),
      tokens=list(live.tokens),
      finish_reason=reason,
      arrival_time=live.arrival_time,
      first_token_time=live.first_token_time,
      finish_time=time.perf_counter(),
      error=error,
      proposed=proposed,
      accepted=accepted,
      evaluated=evaluated,
      iterations=iterations,
    )
    self._completions[live.request_id] = completion
    while len(self._completions) > 10_000:  # a long-running server keeps the recent ones
      self._completions.popitem(last=False)
    self._recent.append(completion)
    self.counters[reason] += 1
    return Event(live.request_id, tuple(tokens), True, reason, error)

  def _compact(self) -> int:
    """Moves live rows into the lowest slots when that lets the step run at a
    smaller width; returns the width of the next step."""
    live = [i for i, s in enumerate(self._slots) if s is not None]
    width = next(w for w in self.config.step_widths if w >= len(live))
    for source in [i for i in live if i >= width]:
      dest = self._slots.index(None)
      self._state = programs.move(self._state, jnp.int32(source), jnp.int32(dest))
      self._slots[dest], self._slots[source] = self._slots[source], None
      self.counters["moves"] += 1
    return width

  # --------------------------------------------------------------- warm-up

  def warmup(
    self, timed_runs: int = 3, progress: Callable[[str], None] | None = None
  ) -> dict[str, float]:
    """Compiles every program the engine can run (after this no request
    recompiles anything) and times each step program for the policy.

    At each width the draft lengths take turns in runs of `policy.window`
    consecutive steps, `timed_runs` runs each (and one more of the first to
    close): the policy takes each run's median over its neighbour's as a cost
    ratio, as it does live. Steps taking turns one by one would not do: a
    plain step right after a drafting one ran 20% slower here than in a run
    of plain steps, and the ratios came out that much too low.

    Args:
      timed_runs: timed runs per draft length and width (0: compile only).
      progress: called with one line per program group (the prefills, then
        each batch width) and its seconds; default: this module's logger at
        INFO (shown by absl's `app.run`).

    Returns:
      seconds per step program (the fastest run's median), by "gamma=G,width=W".
    """
    # The programs donate their input: live requests' rows are kept aside (a
    # batch of free slots is simply rebuilt), so warm-up holds at most three
    # batches of caches at once.
    busy = self.live_requests() > 0
    state = self._state if busy else None
    if busy:
      self._state = jax.tree.map(jnp.copy, state)
    t = self._programs
    key = self._key
    progress = progress or logger.info
    started = time.perf_counter()
    lengths = self.config.draft_lengths
    widths = self.config.step_widths
    progress(
      f"warm-up: compiling prefills for prompt widths {self.config.prompt_buckets}, then "
      f"steps of draft lengths {lengths} at batch widths {widths}"
    )

    def admit(slot, width, budget, drafter=self.drafter):
      self._state = programs.admit(
        self.target,
        drafter,
        self._state,
        jnp.int32(slot),
        jnp.zeros((1, width), jnp.int32),
        jnp.ones((1,), jnp.int32),
        jnp.full((1,), budget, jnp.int32),
        jnp.full((1,), -1, jnp.int32),
        RowSampling.of([GREEDY]),
        key,
        config=t,
      )

    for width in self.config.prompt_buckets:  # prefill programs per bucket
      admit(0, width, 1)
      if self.drafter is not None and 0 in self.config.draft_lengths:
        admit(0, width, 1, drafter=None)  # admission while plain steps run
    self._state = programs.move(self._state, jnp.int32(0), jnp.int32(0))
    self._state = programs.release(self._state, jnp.zeros((self.config.slots,), bool))
    # The steps are timed with every row live and a full budget, as under
    # load: on finished rows a drafter stops early and the step is cheaper.
    for slot in range(self.config.slots):
      admit(slot, self.config.prompt_buckets[0], self.config.max_new_tokens)
    live = jax.block_until_ready(self._state)
    progress(f"warm-up: prefills compiled ({time.perf_counter() - started:.1f} s)")
    times = {}
    run = self.policy.window
    for width in widths:
      width_start = time.perf_counter()
      self._state = jax.tree.map(jnp.copy, live)
      if self.drafter is not None and 0 in lengths:
        self._state = programs.resync(self.target, self.drafter, self._state, width=width, config=t)
      compiled = {}
      for gamma in lengths:  # compiles
        start = time.perf_counter()
        jax.block_until_ready(self._run_step(gamma, width, key))
        compiled[gamma] = time.perf_counter() - start
      medians = {gamma: [] for gamma in lengths}
      turns = list(lengths) * timed_runs + list(lengths[:1]) * (timed_runs > 0)
      for gamma in turns:
        self._state = jax.tree.map(jnp.copy, live)  # each run starts from live rows
        seconds = []
        for _ in range(run):
          start = time.perf_counter()
          jax.block_until_ready(self._run_step(gamma, width, key))
          seconds.append(time.perf_counter() - start)
          self.policy.observe(gamma, width, seconds[-1], 0, 0)
        medians[gamma].append(float(np.median(seconds)))
      self.policy.end_runs(width)
      for gamma in lengths:
        # The fastest run (noise on a shared machine only adds time); without
        # timed runs, the compiling step's.
        seconds = min(medians[gamma], default=compiled[gamma])
        self.policy.step_time[gamma, width] = seconds
        times[f"gamma={gamma},width={width}"] = seconds
      compiling = sum(compiled.values())
      line = f"warm-up: batch width {width} ({widths.index(width) + 1}/{len(widths)}): "
      line += f"compiled in {compiling:.1f} s"
      if timed_runs > 0:
        steps = ", ".join(
          f"gamma={g} {times[f'gamma={g},width={width}'] * 1e3:.1f}" for g in lengths
        )
        line += (
          f", timed in {time.perf_counter() - width_start - compiling:.1f} s (ms a step: {steps})"
        )
      progress(f"{line}; {time.perf_counter() - started:.1f} s so far")
    del live
    self._state = jax.block_until_ready(state) if busy else self._blank()
    return times

  # --------------------------------------------------------------- metrics

  def metrics(self) -> dict:
    """Counters since start and latency percentiles of the recent completions."""
    c = self.counters
    recent = list(self._recent)
    return {
      "requests": {
        "submitted": c["submitted"],
        "completed": c["stop"] + c["length"],
        "cancelled": c["cancelled"],
        "failed": c["error"],
        "live": self.live_requests(),
        "queued": len(self._queue),
      },
      "tokens": c["tokens"],
      "steps": {g: c[f"steps_gamma_{g}"] for g in self.config.draft_lengths},
      "acceptance_rate": c["accepted"] / c["evaluated"] if c["evaluated"] else None,
      "policy": {
        "kind": self.policy.kind,
        "alpha": self.policy.alpha,
        "gamma": self.policy.current,  # adaptive: the draft length in use (else None)
        "step_ms": self.policy.live_step_ms(),
      },
      "ttft_s": percentiles([x.ttft for x in recent]),
      "tpot_s": percentiles([x.tpot for x in recent]),
      "e2e_s": percentiles([x.e2e for x in recent]),
    }
