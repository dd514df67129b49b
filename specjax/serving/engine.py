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
(`fit_config`). Each request brings its own budget, stop id and sampling
settings (`RowSampling` rows: greedy and sampled requests share a step). The
engine is single-threaded; `specjax.serving.background` runs it behind a
thread for servers.

On a mesh (`EngineConfig.mesh`) the same programs run over every device of the
job, placed by `specjax.serving.mesh`; across processes, `specjax.serving.lockstep`
keeps every process's engine taking process 0's decisions.

The engine schedules; the rest is next door: `slots` (the device programs
and the batch they change), `policy` (the draft length of each step) and
`calibration` (warm-up's step timings for it), `store` (finished requests)
and `metrics`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from specjax import constraints
from specjax.drafting import Drafter, as_drafter, check_drafter
from specjax.generation.state import SpecConfig
from specjax.generation.validation import check_sampling
from specjax.generation.verify_length import (
  check_verify_lengths,
  lengths_up_to,
  relative_costs,
)
from specjax.models.kv_cache import check_capacity
from specjax.models.transformer import Transformer
from specjax.sampling import GREEDY, MAX_INT32, RowSampling
from specjax.serving import mesh as mesh_lib
from specjax.serving import slots
from specjax.serving.calibration import WidthTimes, calibrate_width, time_in_runs
from specjax.serving.config import EngineConfig, fit_config
from specjax.serving.constraint_table import ConstraintPlacement
from specjax.serving.metrics import engine_metrics
from specjax.serving.policy import SpeculationPolicy
from specjax.serving.request import Completion, Event, Request
from specjax.serving.store import CompletionStore
from specjax.validation import (
  FieldError,
  check_eos_ids,
  check_int,
  check_token_id,
  check_token_ids,
)

logger = logging.getLogger(__name__)

# A default meaning the engine's own (`_warm_admit`'s drafter, `_run_step`'s verify lengths).
_SAME = object()
_DEFAULT_CONFIG = EngineConfig()


# A row stopped because its law held NaN or +inf (`SpeculativeStats.non_finite`).
NON_FINITE = (
  "the row's sampling law was not finite (NaN or inf) and no token could be drawn "
  "from it exactly: the model's logits, or settings at float32's edge; the request "
  "was stopped rather than given an arbitrary token."
)


class QueueFull(Exception):
  """`Engine.submit` past `EngineConfig.max_queue` waiting requests (try again later)."""


@dataclasses.dataclass
class _Live:
  """Host bookkeeping of a request that holds a slot (or waits for one)."""

  request_id: int
  request: Request
  arrival_time: float
  emitted: int = 0  # tokens streamed so far
  tokens: list[int] = dataclasses.field(default_factory=list)
  first_token_time: float | None = None

  @property
  def deadline(self) -> float | None:
    timeout = self.request.timeout_s
    return None if timeout is None else self.arrival_time + timeout


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

  With `config.mesh` the engine places the models on a mesh of that shape over
  all of JAX's devices (`specjax.serving.mesh`; `self.target` and
  `self.drafter` are then the placed ones), keeps its batch there, and runs
  every program under that mesh.
  """

  def __init__(
    self,
    target: Transformer,
    draft: Transformer | Drafter | None = None,
    config: EngineConfig = _DEFAULT_CONFIG,
    *,
    eos_ids: int | list[int] | tuple[int, ...] | None = None,
  ):
    self.vocab_size = target.cfg.vocab_size
    if draft is None and config.policy != "never":
      raise ValueError(f"draft is None: policy must be 'never', got {config.policy!r}.")
    drafter = None if draft is None else as_drafter(draft)
    self.mesh = None
    if config.mesh is not None:  # checked against the devices before anything compiles
      shape = mesh_lib.resolve(config.mesh)
      config = dataclasses.replace(config, mesh=shape)
      self.mesh = mesh_lib.build_mesh(shape)
      target, drafter = mesh_lib.place_models(
        target, drafter, self.mesh, config.draft_placement, config.vocab_placement
      )
    self.target, self.drafter = target, drafter
    if self.drafter is not None and self.drafter.tree is not None:
      raise ValueError(
        f"draft: {type(self.drafter).__name__} drafts token trees; the engine takes chain "
        "drafters (a draft model, prompt lookup, layer skip, draft heads without a tree)."
      )
    self.config = config = fit_config(config, target, self.drafter)
    self.eos_ids = check_eos_ids("eos_ids", eos_ids, self.vocab_size)
    capacity = check_capacity(
      "target", target.cfg.max_seq_len, config.max_prompt_len, config.max_new_tokens, config.gamma
    )
    if self.drafter is not None:
      check_drafter(
        self.drafter,
        target,
        prompt_width=config.max_prompt_len,
        max_new_tokens=config.max_new_tokens,
        gamma=config.gamma,
      )
    # (draft length, width) -> (verify lengths, their costs) of the step programs, as
    # warm-up measured them (`_measure_verify_costs`); none: every drafted token verified.
    self._verify: dict[tuple[int, int], tuple[tuple[int, ...], tuple[float, ...]]] = {}
    if config.verify_lengths is not None:
      if self.drafter is None:
        raise ValueError("verify_lengths needs a drafter (draft is None).")
      lengths = config.verify_lengths
      check_verify_lengths(lengths, (1.0,) * len(lengths), config.gamma, self.drafter)
    # The static settings of every slot program (`specjax.serving.slots`).
    self._slot_config = slots.SlotConfig(
      spec=SpecConfig(
        gamma=config.gamma,
        max_new_tokens=config.max_new_tokens,
        sampling=None,  # every row its own (RowSampling)
        # Seeded rows: Gumbel-max coupling with their own keys (their text is
        # the same with or without speculation); the others: the token rule,
        # exact for any mix of greedy and sampled rows.
        verifier="coupled",
        coupled=True,
        eos_id=self.eos_ids,
        forced_drafts=config.forced_drafts,
      ),
      capacity=capacity,
      max_prompt_len=config.max_prompt_len,
      logprobs=config.logprobs,
      mesh=self.mesh,
    )
    # The order slots fill in: each step's rows spread evenly over `data`.
    self._order = mesh_lib.row_order(config.slots, config.data)
    self._constraints = None
    self._placed_table = (None, None)  # (the table, its copy on the mesh)
    if config.constraint_states:
      self._constraints = ConstraintPlacement(self.vocab_size, config.constraint_states)
    self.policy = SpeculationPolicy(config.policy, config.draft_lengths)
    self._key, self._admit_key = self._put(jax.random.split(jax.random.key(config.seed)))
    with self.on_mesh():
      self._state = self._blank()
    if self.drafter is not None:
      slots.check_per_row(self._state.spec.drafter_state, config.slots, "draft state")
    # The request each slot holds (None: free).
    self._slot_requests: list[_Live | None] = [None] * config.slots
    self._queue: collections.deque[_Live] = collections.deque()
    self._queued: dict[int, _Live] = {}
    self._pending: list[Event] = []  # cancellations, streamed by the next step
    self._completions = CompletionStore()
    self._ids = itertools.count()
    self._steps = 0
    self._admitted = 0
    self._drafter_stale = False
    # The rows' counters (`_row_stats`) as last read, for requests stopped between steps.
    self._last_stats = None
    self.counters = collections.Counter()
    # One job over processes (`specjax.serving.lockstep`): each step's draft length
    # goes through `agree(gamma)`, which returns the leader's.
    self.agree: Callable[[int], int] | None = None

  def on_mesh(self):
    """The context every program runs in: the engine's mesh set (`jax.set_mesh`,
    which the models' sharding constraints read), or nothing without one."""
    return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

  def _put(self, tree):
    """Host values (numpy arrays, a `RowSampling`, keys) as the programs' inputs:
    on a mesh, copied to every device (replicated), so that each program sees
    its inputs placed alike at warm-up and after and compiles once; else as
    JAX arrays on the default device."""
    if self.mesh is None:
      return jax.tree.map(lambda x: x if isinstance(x, jax.Array) else jnp.asarray(x), tree)
    return jax.tree.map(functools.partial(mesh_lib.replicate, self.mesh), tree)

  # ------------------------------------------------------------------ requests

  def check(self, request: Request) -> None:
    """Raises a FieldError naming the field (the `Request`'s name for it) when
    `request` cannot be served."""
    if not isinstance(request, Request):
      raise FieldError(
        "request", f"request must be a specjax.serving.Request, got {type(request).__name__}."
      )
    prompt = check_token_ids("prompt", request.prompt, self.vocab_size)
    if prompt.size > self.config.max_prompt_len:
      raise FieldError(
        "prompt",
        f"prompt has {prompt.size} tokens; the engine takes at most "
        f"max_prompt_len={self.config.max_prompt_len}.",
      )
    check_int("max_new_tokens", request.max_new_tokens, 1, self.config.max_new_tokens)
    try:
      check_sampling(request.sampling, self.vocab_size, batch=1, per_row=False)
    except FieldError as error:
      if error.field != "sampling":  # SamplingParams' own field: the Request holds it as `sampling`
        raise error.within("sampling") from None
      raise
    check_token_id("stop_id", request.stop_id, self.vocab_size)
    check_int("choice", request.choice, 0)
    if request.logprobs is not None:
      if not self.config.logprobs:
        raise FieldError(
          "logprobs", "logprobs: this engine records none (EngineConfig.logprobs = 0)."
        )
      check_int("logprobs", request.logprobs, 0, self.config.logprobs)
    if request.seed is not None:
      check_int("seed", request.seed, -(2**63), 2**64 - 1)
    if request.max_draft_tokens is not None:
      check_int("max_draft_tokens", request.max_draft_tokens, 0, MAX_INT32)
    if request.constraint is not None:
      self._check_constraint(request.constraint)
    timeout = request.timeout_s
    if timeout is not None and (
      isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0
    ):
      raise FieldError("timeout_s", f"timeout_s must be None or a number > 0, got {timeout!r}.")

  def _check_constraint(self, automaton) -> None:
    if self._constraints is None:
      raise FieldError(
        "constraint",
        "constraint: this engine has no constraint table (EngineConfig.constraint_states = 0).",
      )
    if not isinstance(automaton, constraints.Automaton):
      raise FieldError(
        "constraint",
        "constraint must be a specjax.constraints.Automaton (compile_constraint), got "
        f"{type(automaton).__name__}.",
      )
    if automaton.vocab_size != self.vocab_size:
      raise FieldError(
        "constraint",
        f"constraint covers {automaton.vocab_size} ids; the model's vocabulary has "
        f"{self.vocab_size}.",
      )
    if not self._constraints.fits(automaton):
      raise FieldError(
        "constraint",
        f"constraint has {automaton.num_states} states; this engine's table holds at most "
        f"{self.config.constraint_states - 1} (EngineConfig.constraint_states).",
      )

  def submit(self, request: Request) -> int:
    """Queues `request`; returns its id. Raises a ValueError naming the field for
    a request the engine cannot serve, `QueueFull` past `config.max_queue`
    waiting requests (nothing is queued then)."""
    self.check(request)
    if self.config.max_queue and len(self._queue) >= self.config.max_queue:
      self.counters["refused_queue_full"] += 1
      raise QueueFull(
        f"{len(self._queue)} requests wait for a slot (max_queue); try again shortly."
      )
    request_id = next(self._ids)
    live = _Live(request_id, request, time.perf_counter())
    self._queue.append(live)
    self._queued[request_id] = live
    self.counters["submitted"] += 1
    return request_id

  def cancel(self, request_id: int, reason: str = "cancelled") -> None:
    """Stops a request now: its slot is freed (or it leaves the queue); the next
    `step()` streams its final event with `reason` ("stop": its client found a
    stop string). A request that already finished is left as it is."""
    if request_id in self._queued:
      live = self._queued.pop(request_id)
      self._queue.remove(live)
      self._pending.append(self._finish(live, reason))
      return
    for slot, live in enumerate(self._slot_requests):
      if live is not None and live.request_id == request_id:
        mask = np.zeros(self.config.slots, bool)
        mask[slot] = True
        with self.on_mesh():
          self._state = slots.release(self._state, self._put(mask), mesh=self.mesh)
        self._slot_requests[slot] = None
        self._pending.append(self._finish(live, reason, slot=slot))
        return

  def _table(self):
    if self._constraints is None:
      return None
    table = self._constraints.table
    if self.mesh is not None and table is not self._placed_table[0]:
      # Every device reads any row's state: the table is copied to each (once per change).
      self._placed_table = (table, self._put(table))
    return table if self.mesh is None else self._placed_table[1]

  def _free_start(self, n: int):
    """Start states of `n` unconstrained rows (None: the engine has no table)."""
    if self._constraints is None:
      return None
    return self._put(np.full((n,), constraints.FREE, np.int32))

  def _blank(self) -> slots.SlotState:
    """A batch of free slots (every row done)."""
    b = self.config.slots
    return slots.blank(
      self.target,
      self.drafter,
      *self._put(
        (
          np.zeros((b, 1), np.int32),
          np.ones((b,), np.int32),
          np.ones((b,), np.int32),  # budget 1: every blank slot is done
          np.full((b,), -1, np.int32),
          RowSampling.of(GREEDY, b),
        )
      ),
      self._key,
      table=self._table(),
      start=self._free_start(b),
      config=self._slot_config,
    )

  def has_work(self) -> bool:
    return bool(self._queue or self._pending) or self.live_requests() > 0

  def live_requests(self) -> int:
    return sum(live is not None for live in self._slot_requests)

  def completion(self, request_id: int) -> Completion:
    """The finished request's `Completion` (KeyError if it has not finished)."""
    return self._completions.get(request_id)

  def pop_completion(self, request_id: int) -> Completion:
    return self._completions.pop(request_id)

  def run(self, requests: list[Request]) -> list[Completion]:
    """Submits `requests` at once and steps until all are done (offline use)."""
    ids = [self.submit(r) for r in requests]
    while self.has_work():
      self.step()
    return [self.pop_completion(i) for i in ids]

  # ---------------------------------------------------------------- the step

  def step(self, expire: bool = True) -> list[Event]:
    """Admits, runs one iteration for the live slots, streams what they committed.
    `expire` False: requests past their deadline are left to the caller
    (`late()`; a multi-host leader decides them for every process)."""
    with self.on_mesh():
      return self._step(expire)

  def _step(self, expire: bool) -> list[Event]:
    if expire:
      self._expire()
    events, self._pending = self._pending, []
    events += self._admit()
    if not self.live_requests():
      return events
    width = self._compact()
    live = [i for i, s in enumerate(self._slot_requests) if s is not None]
    gamma = self._capped(self.policy.choose(width), live)
    if self.agree is not None:  # one job over processes: the leader's choice
      gamma = self.agree(gamma)
    if gamma and self._drafter_stale:
      self._state = slots.resync(
        self.target, self.drafter, self._state, width=width, config=self._slot_config
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
      tokens, num_generated, done, counts, stats, logprobs = _fetch(
        (spec.tokens, spec.num_generated, spec.done, counts, self._row_stats(), self._lp())
      )
    except Exception as error:  # the batch's state is gone (donated): start afresh
      return events + self._fail_live(f"engine step failed: {type(error).__name__}: {error}")
    self._last_stats = stats
    seconds = time.perf_counter() - start
    self._steps += 1
    self._drafter_stale |= gamma == 0
    self.policy.observe(gamma, width, seconds, int(counts[0]), int(counts[1]), rows=len(live))
    self.counters[f"steps_gamma_{gamma}"] += 1
    self.counters["accepted"] += int(counts[0])
    self.counters["evaluated"] += int(counts[1])
    self.counters["drafted"] += int(counts[2])
    self.counters["forced"] += int(counts[3])
    by_position = counts[4:].reshape(2, -1)
    for i, (drafted, accepted) in enumerate(zip(*by_position.tolist())):
      self.counters[f"drafted_at_{i + 1}"] += drafted
      self.counters[f"accepted_at_{i + 1}"] += accepted
    return events + self._stream(tokens, num_generated, done, stats, logprobs)

  def _capped(self, gamma: int, live: list[int]) -> int:
    """The policy's draft length, no longer than any live request lets a step
    draft for it (`Request.max_draft_tokens`), among the compiled lengths. Each
    row's own cap is its `draft_limit`, set at admission."""
    caps = [self._slot_requests[slot].request.max_draft_tokens for slot in live]
    bound = max(gamma if cap is None else min(gamma, cap) for cap in caps)
    fits = [g for g in self.config.draft_lengths if g <= bound]
    return max(fits) if fits else min(self.config.draft_lengths)

  def _asked(self) -> bool:
    """Whether a live request asked for log-probabilities (else none are computed)."""
    return any(s is not None and s.request.logprobs is not None for s in self._slot_requests)

  def _lp(self):
    return self._state.logprobs if self._asked() else None

  def _run_step(self, gamma: int, width: int, key: jax.Array, verify=_SAME) -> jax.Array:
    """Dispatches one step program on the batch; returns its counts over the
    rows: accepted, evaluated and drafted tokens, then the drafted and the
    accepted by position (`[2, gamma]` flattened). A plain step takes no
    drafter: its dispatch would flatten the draft model's parameters for nothing.
    `verify`: the step's (verify lengths, costs), by default warm-up's."""
    if verify is _SAME:
      verify = self._verify.get((gamma, width))
    self._state, counts = slots.step(
      self.target,
      self.drafter if gamma else None,
      self._state,
      key,
      self._put(np.asarray(self._asked())),
      self._table(),
      gamma=gamma,
      width=width,
      config=self._slot_config,
      verify=verify,
    )
    return counts

  def lowered_step(self, gamma: int, width: int | None = None) -> jax.stages.Lowered:
    """The step program of draft length `gamma` (0: a plain step) at batch
    `width` (default: every slot), lowered on the engine's batch as `step()`
    would run it, for reading its compiled HLO (`specjax.bench.hlo`: kernels,
    collectives on a mesh). Runs nothing; the batch is untouched."""
    width = self.config.slots if width is None else width
    with self.on_mesh():
      return slots.step.lower(
        self.target,
        self.drafter if gamma else None,
        self._state,
        self._key,
        self._put(np.asarray(False)),
        self._table(),
        gamma=gamma,
        width=width,
        config=self._slot_config,
        verify=self._verify.get((gamma, width)),
      )

  def _fail_live(self, message: str) -> list[Event]:
    """Fails every live request and empties the slots (a fresh blank batch)."""
    events = []
    for slot, live in enumerate(self._slot_requests):
      if live is not None:
        self._slot_requests[slot] = None
        events.append(self._finish(live, "error", message))
    self._state = self._blank()
    self._drafter_stale = False
    self._last_stats = None
    return events

  def _row_stats(self):
    s = self._state.spec.stats
    return (
      s.proposed,
      s.accepted,
      s.evaluated,
      s.row_iterations,
      self._state.positions,
      s.forced,
      s.non_finite,
    )

  def late(self) -> list[int]:
    """The ids of the requests past their deadline (`Request.timeout_s`)."""
    now = time.perf_counter()
    return [
      live.request_id
      for live in (*self._queue, *(s for s in self._slot_requests if s is not None))
      if live.deadline is not None and now >= live.deadline
    ]

  def _expire(self) -> None:
    """Stops the requests past their deadline: "timeout"."""
    for request_id in self.late():
      self.cancel(request_id, "timeout")

  def _admit(self) -> list[Event]:
    """Prefills queued requests into the lowest free slots, in arrival order;
    streams first tokens.

    A constrained request whose automaton does not fit beside the live ones
    waits, and does not hold back the unconstrained requests behind it (they
    need no table room); constrained ones behind it wait too, so the live
    automata drain and it is not starved. A request that fails to be placed or
    prefilled fails alone."""
    admitted = []
    events = []
    # After plain steps the drafter is re-synced from every row before it
    # drafts again: prefilling it now would be work thrown away.
    target_only = self._drafter_stale and self.drafter is not None
    drafter = None if target_only else self.drafter
    blocked = False  # a constrained request waits for table room
    for live in list(self._queue):
      if None not in self._slot_requests:
        break
      if blocked and live.request.constraint is not None:
        continue
      try:
        start = self._place(live.request.constraint)
      except Exception as error:  # its automaton could not be placed: the table is unchanged
        self._dequeue(live)
        events.append(self._finish(live, "error", f"{type(error).__name__}: {error}"))
        continue
      if start is False:  # its automaton waits for room in the table
        blocked = True
        self.counters["constraint_waits"] += 1
        continue
      self._dequeue(live)
      slot = self._free_slot()
      key = jax.random.fold_in(self._admit_key, self._admitted)
      self._admitted += 1
      try:
        self._admit_one(slot, live.request, drafter, key, start)
      except Exception as error:  # one request's failure is its own
        events.append(self._finish(live, "error", f"{type(error).__name__}: {error}"))
        if _deleted(self._state):  # it failed after the batch was donated: the batch is gone
          events += self._fail_live(f"admission failed: {type(error).__name__}: {error}")
          admitted = []
        continue
      self._slot_requests[slot] = live
      admitted.append(slot)
      self.counters["admitted_target_only"] += target_only
    if admitted:
      spec = self._state.spec
      tokens, num_generated, done, stats, logprobs = _fetch(
        (spec.tokens, spec.num_generated, spec.done, self._row_stats(), self._lp())
      )
      self._last_stats = stats
      events += self._stream(tokens, num_generated, done, stats, logprobs, only=admitted)
    return events

  def _dequeue(self, live: _Live) -> None:
    self._queue.remove(live)
    del self._queued[live.request_id]

  def _place(self, automaton):
    """The start state of a request's constraint, placed in the table (None:
    no table; `FREE` for no constraint; False: it does not fit beside the live
    rows' automata yet). Live rows whose automata moved are shifted."""
    if self._constraints is None:
      return None
    if automaton is None:
      return constraints.FREE
    live = [s.request.constraint for s in self._slot_requests if s is not None]
    placed = self._constraints.place(automaton, [a for a in live if a is not None])
    if placed is None:
      return False
    start, shifts = placed
    if shifts:
      shift = np.zeros(self.config.slots, np.int32)
      for slot, s in enumerate(self._slot_requests):
        if s is not None and s.request.constraint is not None:
          shift[slot] = shifts.get(id(s.request.constraint), 0)
      self._state = slots.shift_constraints(self._state, self._put(shift), mesh=self.mesh)
    self.counters["constraint_table_packs"] = self._constraints.packs
    return start

  def _admit_one(self, slot: int, request: Request, drafter, key: jax.Array, start=None) -> None:
    """Prefills `request` into `slot` (padded to the smallest prompt bucket
    that holds it); without a drafter, the target only. `start`: its
    constraint's start state (None: the engine has no table)."""
    prompt = np.asarray(request.prompt, np.int32)
    width = next(p for p in self.config.prompt_buckets if p >= prompt.size)
    row_key = np.zeros((1, 2), np.uint32)  # unseeded (greedy rows: a seed changes nothing)
    if _seeded(request):
      row_key = np.asarray(jax.random.key_data(request_key(request.seed, request.choice)))[None]
    cap = self.config.gamma if request.max_draft_tokens is None else request.max_draft_tokens
    inputs = self._put(
      (
        np.int32(slot),
        np.pad(prompt, (0, width - prompt.size))[None],
        np.asarray([prompt.size], np.int32),
        np.asarray([request.max_new_tokens], np.int32),
        np.asarray([-1 if request.stop_id is None else request.stop_id], np.int32),
        RowSampling.of([request.sampling]),
      )
    )
    rest = self._put(
      (row_key, np.asarray(request.logprobs is not None), np.asarray([cap], np.int32))
    )
    self._state = slots.admit(
      self.target,
      drafter,
      self._state,
      *inputs,
      key,
      *rest,
      self._table(),
      None if start is None else self._put(np.asarray([start], np.int32)),
      config=self._slot_config,
    )

  def _stream(self, tokens, num_generated, done, stats, logprobs, only=None) -> list[Event]:
    """Events for the slots' newly committed tokens; finished slots are freed."""
    now = time.perf_counter()
    events = []
    for slot in range(self.config.slots) if only is None else only:
      live = self._slot_requests[slot]
      if live is None:
        continue
      new = tokens[slot, live.emitted : num_generated[slot]].tolist()
      lp = None
      if live.request.logprobs is not None:
        lp = _logprobs(logprobs, slot, live.emitted, len(new), live.request.logprobs)
      if new and live.first_token_time is None:
        live.first_token_time = now
      live.emitted = int(num_generated[slot])
      live.tokens += new
      self.counters["tokens"] += len(new)
      if stats is not None and stats[6][slot]:  # none of the bad draw was committed
        self._slot_requests[slot] = None
        events.append(self._finish(live, "error", NON_FINITE, new, stats, slot, lp))
      elif done[slot]:
        self._slot_requests[slot] = None
        last, sampling = live.tokens[-1], live.request.sampling
        stopped = (
          last == live.request.stop_id
          or last in sampling.stop_token_ids
          or (
            not sampling.ignore_eos
            and self.eos_ids is not None
            and last in np.atleast_1d(self.eos_ids)
          )
        )
        reason = "stop" if stopped else "length"
        events.append(self._finish(live, reason, tokens=new, stats=stats, slot=slot, logprobs=lp))
      elif new:
        events.append(Event(live.request_id, tuple(new), logprobs=lp))
    return events

  def _finish(
    self, live: _Live, reason: str, error=None, tokens=(), stats=None, slot=None, logprobs=None
  ) -> Event:
    if stats is None and slot is not None:  # stopped between steps: the last step's counts
      stats = self._last_stats
    proposed = accepted = evaluated = iterations = forced = 0
    positions = np.zeros((2, self.config.gamma), np.int64)
    if stats is not None:
      proposed, accepted, evaluated, iterations = (int(x[slot]) for x in stats[:4])
      positions, forced = stats[4][slot], int(stats[5][slot])
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
      drafted_at_position=tuple(positions[0].tolist()),
      accepted_at_position=tuple(positions[1].tolist()),
      forced=forced,
    )
    self._completions.add(completion)
    self.counters[reason] += 1
    speculation = completion.speculation
    return Event(live.request_id, tuple(tokens), True, reason, error, logprobs, speculation)

  def _free_slot(self) -> int:
    """The first free slot in fill order (`specjax.serving.mesh.row_order`)."""
    return next(i for i in self._order if self._slot_requests[i] is None)

  def _compact(self) -> int:
    """Moves live rows into the first slots (in fill order) when that lets the
    step run at a smaller width; returns the width of the next step."""
    live = [i for i, s in enumerate(self._slot_requests) if s is not None]
    width = next(w for w in self.config.step_widths if w >= len(live))
    inside = set(self._order[:width])  # the rows a step at `width` runs on
    for source in [i for i in live if i not in inside]:
      dest = self._free_slot()
      source, dest = self._put((np.int32(source), np.int32(dest)))
      self._state = slots.move(self._state, source, dest, mesh=self.mesh)
      self._slot_requests[dest], self._slot_requests[source] = self._slot_requests[source], None
      self.counters["moves"] += 1
    return width

  # --------------------------------------------------------------- warm-up

  def warmup(
    self, timed_runs: int = 3, progress: Callable[[str], None] | None = None
  ) -> dict[str, float]:
    """Compiles every program the engine can run (after this no request
    recompiles anything) and times each step program for the policy
    (`specjax.serving.calibration`: runs of `policy.window` steps per draft
    length, taking turns).

    Args:
      timed_runs: timed runs per draft length and width (0: compile only).
      progress: called with one line per program group (the prefills, then
        each batch width) and its seconds; default: this module's logger at
        INFO (shown by absl's `app.run`).

    Returns:
      seconds per step program (the fastest run's median), by "gamma=G,width=W".
    """
    with self.on_mesh():
      return self._warmup(timed_runs, progress)

  def _warmup(self, timed_runs: int, progress: Callable[[str], None] | None) -> dict[str, float]:
    # The programs donate their input: live requests' rows are kept aside (a
    # batch of free slots is simply rebuilt), so warm-up holds at most three
    # batches of caches at once.
    kept = self._state if self.live_requests() > 0 else None
    if kept is not None:
      self._state = jax.tree.map(jnp.copy, kept)
    progress = progress or logger.info
    started = time.perf_counter()
    lengths, widths = self.config.draft_lengths, self.config.step_widths
    progress(
      f"warm-up: compiling prefills for prompt widths {self.config.prompt_buckets}, then "
      f"steps of draft lengths {lengths} at batch widths {widths}"
    )
    live = self._compile_admissions()
    progress(f"warm-up: prefills compiled ({time.perf_counter() - started:.1f} s)")
    times = {}
    for i, width in enumerate(widths):
      width_start = time.perf_counter()
      self._restart(live, width, resync=self.drafter is not None and 0 in lengths)
      if self.config.verify_lengths is not None:
        self._measure_verify_costs(live, width, max(timed_runs, 1), progress)
      result = calibrate_width(
        self.policy,
        width,
        lengths,
        timed_runs,
        run_step=self._blocking_step,
        restart=functools.partial(self._restart, live, width),
      )
      times.update({f"gamma={g},width={width}": s for g, s in result.step.items()})
      line = f"warm-up: batch width {width} ({i + 1}/{len(widths)}): "
      line += _timing_line(result, timed_runs, time.perf_counter() - width_start)
      progress(f"{line}; {time.perf_counter() - started:.1f} s so far")
    del live
    self._state = jax.block_until_ready(kept) if kept is not None else self._blank()
    return times

  def _compile_admissions(self) -> slots.SlotState:
    """Compiles the prefill (per prompt bucket), move and release programs;
    returns the batch with every slot admitted (a whole budget each), from
    which each timed run of steps starts."""
    plain_too = self.drafter is not None and 0 in self.config.draft_lengths
    for width in self.config.prompt_buckets:  # prefill programs per bucket
      self._warm_admit(0, width, 1)
      if plain_too:
        self._warm_admit(0, width, 1, drafter=None)  # admission while plain steps run
    zero = self._put(np.int32(0))
    self._state = slots.move(self._state, zero, zero, mesh=self.mesh)
    none = self._put(np.zeros((self.config.slots,), bool))
    self._state = slots.release(self._state, none, mesh=self.mesh)
    if self._constraints is not None:  # packing the table shifts live rows' states
      zeros = self._put(np.zeros((self.config.slots,), np.int32))
      self._state = slots.shift_constraints(self._state, zeros, mesh=self.mesh)
    for slot in range(self.config.slots):
      self._warm_admit(slot, self.config.prompt_buckets[0], self.config.max_new_tokens)
    return jax.block_until_ready(self._state)

  def _warm_admit(self, slot: int, width: int, budget: int, drafter=_SAME) -> None:
    """Admits a dummy greedy request (prompt width `width`) into `slot`."""
    self._state = slots.admit(
      self.target,
      self.drafter if drafter is _SAME else drafter,
      self._state,
      *self._put(
        (
          np.int32(slot),
          np.zeros((1, width), np.int32),
          np.ones((1,), np.int32),
          np.full((1,), budget, np.int32),
          np.full((1,), -1, np.int32),
          RowSampling.of([GREEDY]),
        )
      ),
      self._key,
      *self._put(
        (np.zeros((1, 2), np.uint32), np.asarray(False), np.asarray([self.config.gamma], np.int32))
      ),
      self._table(),
      self._free_start(1),
      config=self._slot_config,
    )

  def _restart(self, live: slots.SlotState, width: int, resync: bool = False) -> None:
    """The batch becomes a copy of `live` (donated programs consume their
    input); `resync` rebuilds the drafter's state for the first `width` rows."""
    self._state = jax.tree.map(jnp.copy, live)
    if resync:
      self._state = slots.resync(
        self.target, self.drafter, self._state, width=width, config=self._slot_config
      )

  def _blocking_step(self, gamma: int, width: int, verify=_SAME) -> None:
    """One step of the warm-up's batch, waited for."""
    jax.block_until_ready(self._run_step(gamma, width, self._key, verify))

  def _measure_verify_costs(
    self, live: slots.SlotState, width: int, timed_runs: int, progress: Callable[[str], None]
  ) -> None:
    """Times each drafting step at `width` verifying each of its verify lengths k
    (a program verifying k every step; the calibration's runs, `time_in_runs`);
    the step programs then choose among those lengths by these costs."""
    for gamma in self.config.draft_lengths:
      ks = lengths_up_to(self.config.verify_lengths, gamma) if gamma else ()
      if len(ks) < 2:
        continue
      # Verifying gamma is the program without verify lengths.
      forced = {k: None if k == gamma else ((k,), (1.0,)) for k in ks}
      _, seconds = time_in_runs(
        ks,
        timed_runs,
        self.policy.window,
        lambda k, gamma=gamma, forced=forced: self._blocking_step(gamma, width, forced[k]),
        functools.partial(self._restart, live, width),
      )
      costs = relative_costs([seconds[k] for k in ks])
      self._verify[gamma, width] = (ks, costs)
      line = ", ".join(f"k={k} {c:.2f}" for k, c in zip(ks, costs))
      progress(f"warm-up: width {width}, gamma={gamma}: verify costs {line}")

  # --------------------------------------------------------------- metrics

  def metrics(self) -> dict:
    """Counters since start and latency percentiles of the recent completions
    (`specjax.serving.metrics.engine_metrics`)."""
    return engine_metrics(
      self.counters,
      self._completions.recent(),
      live=self.live_requests(),
      queued=len(self._queue),
      draft_lengths=self.config.draft_lengths,
      policy=self.policy,
      positions=self.config.gamma,
    )


def request_key(seed: int, choice: int = 0) -> jax.Array:
  """The key a seeded request draws with: the 64-bit seed as key data, folded
  with the choice's index. `autoregressive_generate(..., key=request_key(seed)[None])`
  gives the text the server gives the request (`specjax.coupling`)."""
  seed %= 2**64
  data = jnp.asarray([seed >> 32, seed & 0xFFFFFFFF], jnp.uint32)
  return jax.random.fold_in(jax.random.wrap_key_data(data), choice)


def _fetch(tree):
  """`jax.device_get(tree)`; in a job over several processes every process gathers
  the rows the others hold (a collective each runs: they step in lockstep)."""
  if jax.process_count() == 1:
    return jax.device_get(tree)
  return multihost_utils.process_allgather(tree, tiled=True)


def _deleted(state) -> bool:
  """Whether a donated batch's buffers are gone (a program failed after taking them)."""
  return any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(state))


def _seeded(request: Request) -> bool:
  """Whether `request` draws from its own key (a seed matters only when sampling)."""
  return request.seed is not None and not request.sampling.greedy


def _logprobs(buffers, slot: int, start: int, count: int, k: int) -> tuple:
  """`Event.logprobs` of a slot's tokens [start, start + count) (`SlotState.logprobs`)."""
  chosen, ids, top = (b[slot, start : start + count] for b in buffers)
  return tuple(
    (float(c), tuple(zip(i[:k].tolist(), t[:k].tolist()))) for c, i, t in zip(chosen, ids, top)
  )


def _timing_line(result: WidthTimes, timed_runs: int, seconds: float) -> str:
  """What warm-up reports for one width: compile seconds, then (timed) the
  timing's seconds and each draft length's step time."""
  compiling = sum(result.compiled.values())
  line = f"compiled in {compiling:.1f} s"
  if timed_runs > 0:
    steps = ", ".join(f"gamma={g} {s * 1e3:.1f}" for g, s in result.step.items())
    line += f", timed in {seconds - compiling:.1f} s (ms a step: {steps})"
  return line
