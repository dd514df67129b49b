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

The `Engine` checks requests and composes three parts, after vLLM's v1 engine:
the `scheduler` (admission, constraint-table placement, expiry, compaction),
the `runner` (the batch on its devices and the slot programs: `slots`, `rows`,
`batch`) and the `output` (streams, finished requests, counters); `warmup`
compiles and times every program. Next door: `policy` (the draft length of
each step) and `calibration` (warm-up's timings for it), `store` (finished
requests) and `metrics`. On a mesh (`EngineConfig.mesh`) the runner places the
models and the batch (`specjax.serving.mesh`); across processes,
`specjax.serving.lockstep` keeps every process's engine taking process 0's
decisions through the engine's lockstep interface (`agree`, `late`,
`verify_costs`, `step(expire=False)`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from specjax import constraints
from specjax.drafting import Drafter, as_drafter
from specjax.generation.validation import check_sampling
from specjax.models.transformer import Transformer
from specjax.sampling import MAX_INT32
from specjax.serving.config import EngineConfig, fit_config
from specjax.serving.constraint_table import ConstraintPlacement
from specjax.serving.metrics import engine_metrics
from specjax.serving.output import NON_FINITE, Output
from specjax.serving.policy import SpeculationPolicy
from specjax.serving.request import Completion, Event, Request
from specjax.serving.runner import Runner, check_models, place_models, request_key
from specjax.serving.scheduler import Scheduler
from specjax.serving.warmup import warm_up
from specjax.validation import (
  FieldError,
  check_eos_ids,
  check_int,
  check_token_id,
  check_token_ids,
)

__all__ = [
  "NON_FINITE",
  "Completion",
  "Engine",
  "EngineConfig",
  "Event",
  "QueueFull",
  "Request",
  "request_key",
]

_DEFAULT_CONFIG = EngineConfig()


class QueueFull(Exception):
  """`Engine.submit` past `EngineConfig.max_queue` waiting requests (try again later)."""


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

  Attributes:
    scheduler, runner, output: its parts (`specjax.serving.scheduler`,
      `.runner`, `.output`).
    policy: the `SpeculationPolicy` choosing each step's draft length.
    counters: counts since start (requests by outcome, tokens, steps, ...).
    agree: None, or (one job over processes, `specjax.serving.lockstep`) a
      function each step's draft length goes through, which returns the
      leader's.
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
    # Checked against the devices before anything compiles.
    config, mesh, target, drafter = place_models(
      config, target, None if draft is None else as_drafter(draft)
    )
    if drafter is not None and drafter.tree is not None:
      raise ValueError(
        f"draft: {type(drafter).__name__} drafts token trees; the engine takes chain "
        "drafters (a draft model, prompt lookup, layer skip, draft heads without a tree)."
      )
    self.config = config = fit_config(config, target, drafter)
    self.eos_ids = check_eos_ids("eos_ids", eos_ids, self.vocab_size)
    capacity = check_models(config, target, drafter)
    self._constraints = None  # the constraint table's placement (shared with the parts)
    if config.constraint_states:
      self._constraints = ConstraintPlacement(self.vocab_size, config.constraint_states)
    self.output = Output(config.gamma, self.eos_ids)
    self.counters = self.output.counters
    self.runner = Runner(target, drafter, config, mesh, self.eos_ids, capacity, self._constraints)
    self.scheduler = Scheduler(config, self.runner, self._constraints, self.counters)
    self.policy = SpeculationPolicy(config.policy, config.draft_lengths)
    self._pending: list[Event] = []  # cancellations, streamed by the next step
    self.agree: Callable[[int], int] | None = None

  @property
  def target(self) -> Transformer:
    return self.runner.target

  @property
  def drafter(self) -> Drafter | None:
    return self.runner.drafter

  @property
  def mesh(self):
    return self.runner.mesh

  def on_mesh(self):
    """The context every program runs in (`Runner.on_mesh`)."""
    return self.runner.on_mesh()

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
    waiting = len(self.scheduler.queue)
    if self.config.max_queue and waiting >= self.config.max_queue:
      self.counters["refused_queue_full"] += 1
      raise QueueFull(f"{waiting} requests wait for a slot (max_queue); try again shortly.")
    self.counters["submitted"] += 1
    return self.scheduler.enqueue(request)

  def cancel(self, request_id: int, reason: str = "cancelled") -> None:
    """Stops a request now: its slot is freed (or it leaves the queue); the next
    `step()` streams its final event with `reason` ("stop": its client found a
    stop string). A request that already finished is left as it is."""
    live = self.scheduler.dequeue(request_id)
    if live is not None:
      self._pending.append(self.output.finish(live, reason))
      return
    slot = self.scheduler.slot_of(request_id)
    if slot is not None:
      with self.on_mesh():
        live = self.scheduler.release(slot)
      self._pending.append(self.output.finish(live, reason, row=(self.runner.counts, slot)))

  def has_work(self) -> bool:
    return bool(self.scheduler.queue or self._pending) or self.live_requests() > 0

  def live_requests(self) -> int:
    return self.scheduler.running

  def completion(self, request_id: int) -> Completion:
    """The finished request's `Completion` (KeyError if it has not finished)."""
    return self.output.completions.get(request_id)

  def pop_completion(self, request_id: int) -> Completion:
    return self.output.completions.pop(request_id)

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
      for request_id in self.late():
        self.cancel(request_id, "timeout")
    events, self._pending = self._pending, []
    events += self._admit()
    if not self.live_requests():
      return events
    width = self.scheduler.compact()
    rows = self.live_requests()
    gamma = self.scheduler.capped(self.policy.choose(width))
    if self.agree is not None:  # one job over processes: the leader's choice
      gamma = self.agree(gamma)
    try:
      counts, committed, seconds = self.runner.run(gamma, width, self.scheduler.asked())
    except Exception as error:  # the batch's state is gone (donated): start afresh
      return events + self._fail_live(f"engine step failed: {type(error).__name__}: {error}")
    self.policy.observe(gamma, width, seconds, int(counts.accepted), int(counts.evaluated), rows)
    self.output.count_step(gamma, counts)
    return events + self._stream(committed)

  def _admit(self) -> list[Event]:
    """Admits what the scheduler seats (`Scheduler.admit`); streams first tokens.
    After plain steps the drafter is re-synced from every row before it drafts
    again: prefilling it now would be work thrown away."""
    target_only = self.runner.drafter_stale and self.drafter is not None
    admitted, failed = self.scheduler.admit(target_only)
    events = [self.output.finish(live, "error", message) for live, message in failed]
    if admitted:
      events += self._stream(self.runner.committed(self.scheduler.asked()), admitted)
    return events

  def _stream(self, committed, only=None) -> list[Event]:
    """The seated requests' events (`Output.stream`); finished ones leave their slots."""
    events = self.output.stream(self.scheduler.seated(only), committed)
    self.scheduler.leave(e.request_id for e in events if e.finished)
    return events

  def _fail_live(self, message: str) -> list[Event]:
    """Fails every live request and empties the slots (a fresh blank batch)."""
    events = [self.output.finish(live, "error", message) for live in self.scheduler.evict()]
    self.runner.reset()
    return events

  # ------------------------------------------------- the lockstep interface

  def late(self) -> list[int]:
    """The ids of the requests past their deadline (`Request.timeout_s`): the
    clock is read here (a multi-host leader decides for every process)."""
    return self.scheduler.late()

  @property
  def verify_costs(self) -> dict[tuple[int, int], tuple[tuple[int, ...], tuple[float, ...]]]:
    """Warm-up's measurements of the verify lengths: `(draft length, width) ->
    (verify lengths, their relative costs)`; assigned, they replace them (a
    follower takes the leader's, so that every process runs the same programs)."""
    return dict(self.runner.verify)

  @verify_costs.setter
  def verify_costs(self, costs: dict) -> None:
    self.runner.verify = dict(costs)

  # --------------------------------------------------------------- warm-up

  def warmup(
    self, timed_runs: int = 3, progress: Callable[[str], None] | None = None
  ) -> dict[str, float]:
    """Compiles every program the engine can run (after this no request
    recompiles anything) and times each step program for the policy
    (`specjax.serving.warmup`).

    Args:
      timed_runs: timed runs per draft length and width (0: compile only).
      progress: called with one line per program group (the prefills, then
        each batch width) and its seconds; default: this module's logger at
        INFO (shown by absl's `app.run`).

    Returns:
      seconds per step program (the fastest run's median), by "gamma=G,width=W".
    """
    keep = self.live_requests() > 0
    return warm_up(self.runner, self.policy, self.config, timed_runs, progress, keep)

  def lowered_step(self, gamma: int, width: int | None = None) -> jax.stages.Lowered:
    """The step program of draft length `gamma` (0: a plain step) at batch
    `width` (default: every slot), lowered on the engine's batch as `step()`
    would run it, for reading its compiled HLO (`specjax.bench.hlo`: kernels,
    collectives on a mesh). Runs nothing; the batch is untouched."""
    return self.runner.lowered_step(gamma, self.config.slots if width is None else width)

  def metrics(self) -> dict:
    """Counters since start and latency percentiles of the recent completions
    (`specjax.serving.metrics.engine_metrics`)."""
    return engine_metrics(
      self.counters,
      self.output.completions.recent(),
      live=self.live_requests(),
      queued=len(self.scheduler.queue),
      draft_lengths=self.config.draft_lengths,
      policy=self.policy,
      positions=self.config.gamma,
    )
