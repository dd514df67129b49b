"""What a client asks the engine for, and what it gets back.

Request     one prompt with its own budget, stop id and sampling settings
Event       what one engine step streams for a request: its new tokens, and
            whether (and why) it finished
Completion  a finished request: its tokens, finish reason and timings (TTFT,
            TPOT, end-to-end) and its acceptance counters
SpeculationCounts  a request's speculation figures, as its usage reports them
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from specjax.constraints import Automaton
from specjax.sampling import GREEDY, SamplingParams

FINISH_REASONS = ("stop", "length", "cancelled", "error", "timeout")


@dataclasses.dataclass(frozen=True)
class Request:
  """One generation request.

  Attributes:
    prompt: token ids of the target's vocabulary, at least one.
    max_new_tokens: tokens to generate at most, >= 1 (the first comes from
      the prefill), at most the engine's `max_new_tokens`.
    sampling: this request's warp; temperature 0 (the default) is greedy.
    stop_id: the request stops after emitting this id (kept), besides the
      engine's EOS ids; None for none.
    seed: None, or an integer in [-2**63, 2**64): a sampled request then draws
      with its own key, of (seed, choice) only, by Gumbel-max coupling
      (`specjax.coupling`), in plain and speculative steps alike: its text
      depends on neither what else the engine serves, nor the draft length,
      nor the drafter, and equals the text with speculation off.
    choice: which of a request's samples this is.
    logprobs: None, or k in [0, `EngineConfig.logprobs`]: the events carry each
      token's log-probability under the request's warp and k alternatives.
    max_draft_tokens: None (the engine's policy decides), or an integer >= 0:
      no step drafts more than this many tokens for this request (0: it is
      decoded without speculation, in the same batch as the others).
    constraint: None, or the token automaton its text must follow
      (`specjax.constraints.compile_constraint` over the target's tokenizer,
      with the engine's EOS ids): every token, drafted or sampled, is drawn
      among what it allows, and the text ends only where it accepts.
    timeout_s: None, or the seconds from its submission by which it must
      finish: past them it is stopped with finish_reason "timeout" (waiting
      in the queue or running).
  """

  prompt: Sequence[int]
  max_new_tokens: int
  sampling: SamplingParams = GREEDY
  stop_id: int | None = None
  seed: int | None = None
  choice: int = 0
  logprobs: int | None = None
  max_draft_tokens: int | None = None
  constraint: Automaton | None = None
  timeout_s: float | None = None


@dataclasses.dataclass(frozen=True)
class SpeculationCounts:
  """What speculation did for one request (one choice), from its row's counters
  on the device, read when it finished.

  Attributes:
    drafted: drafted tokens offered for it (`Completion.proposed`).
    accepted: those the verifier kept.
    drafted_at_position: entry i counts the steps that drafted a token at
      position i + 1 for it (one entry per position up to the engine's largest
      draft length); they sum to `drafted`.
    accepted_at_position: entry i counts the steps that accepted its drafted
      token i + 1 (a chain: and every one before it); they sum to `accepted`.
    forced: of the accepted drafted tokens, those its constraint forced
      (`EngineConfig.forced_drafts`): counted in `drafted` and `accepted` too.
  """

  drafted: int = 0
  accepted: int = 0
  drafted_at_position: tuple[int, ...] = ()
  accepted_at_position: tuple[int, ...] = ()
  forced: int = 0

  def __add__(self, other: SpeculationCounts) -> SpeculationCounts:
    """The sum of two requests' counts (positions entry by entry)."""
    n = max(len(self.drafted_at_position), len(other.drafted_at_position))

    def pad(x):
      return tuple(x) + (0,) * (n - len(x))

    return SpeculationCounts(
      self.drafted + other.drafted,
      self.accepted + other.accepted,
      tuple(map(sum, zip(pad(self.drafted_at_position), pad(other.drafted_at_position)))),
      tuple(map(sum, zip(pad(self.accepted_at_position), pad(other.accepted_at_position)))),
      self.forced + other.forced,
    )

  def as_dict(self) -> dict:
    """The JSON of `usage.speculation` (docs/serving.md)."""
    return {
      "drafted": self.drafted,
      "accepted": self.accepted,
      "drafted_at_position": list(self.drafted_at_position),
      "accepted_at_position": list(self.accepted_at_position),
      "forced": self.forced,
    }


@dataclasses.dataclass(frozen=True)
class Event:
  """What one engine step streams for one request.

  Attributes:
    request_id: the id `Engine.submit` returned.
    tokens: the tokens committed by this step, in order (may be empty when the
      event only reports a finish).
    finished: the request is over; its `Completion` is ready.
    finish_reason: None until finished, then one of `FINISH_REASONS`: "stop"
      (an EOS or its stop id, which is the last token), "length" (its
      max_new_tokens), "cancelled", "error" or "timeout" (its `timeout_s`).
    error: the message when finish_reason is "error".
    logprobs: None (not asked for), or one `(logprob, ((id, logprob), ...))`
      per token: its log-probability and the most likely alternatives.
    speculation: a finished event's `SpeculationCounts` (None before).
  """

  request_id: int
  tokens: tuple[int, ...]
  finished: bool = False
  finish_reason: str | None = None
  error: str | None = None
  logprobs: tuple | None = None
  speculation: SpeculationCounts | None = None


@dataclasses.dataclass
class Completion:
  """A finished request (times are `time.perf_counter()` seconds).

  Attributes:
    request_id, prompt_length: which request.
    tokens: every generated token.
    finish_reason, error: as in `Event`.
    arrival_time: when it was submitted.
    first_token_time: when its first token was committed (None if none was).
    finish_time: when it finished.
    proposed, accepted, evaluated, iterations: its row's counters while it
      was decoded (`SpeculativeStats`: accepted / evaluated estimates alpha;
      iterations counts engine steps it took part in).
    drafted_at_position, accepted_at_position, forced: as in
      `SpeculationCounts` (`speculation` gathers them with proposed and accepted).
  """

  request_id: int
  prompt_length: int
  tokens: list[int]
  finish_reason: str
  arrival_time: float
  first_token_time: float | None
  finish_time: float
  error: str | None = None
  proposed: int = 0
  accepted: int = 0
  evaluated: int = 0
  iterations: int = 0
  drafted_at_position: tuple[int, ...] = ()
  accepted_at_position: tuple[int, ...] = ()
  forced: int = 0

  @property
  def speculation(self) -> SpeculationCounts:
    """Its speculation figures, as its usage reports them."""
    return SpeculationCounts(
      self.proposed,
      self.accepted,
      self.drafted_at_position,
      self.accepted_at_position,
      self.forced,
    )

  @property
  def ttft(self) -> float | None:
    """Time to first token, seconds (queueing and prefill included)."""
    return None if self.first_token_time is None else self.first_token_time - self.arrival_time

  @property
  def tpot(self) -> float | None:
    """Time per output token after the first, seconds; None for fewer than 2 tokens."""
    if self.first_token_time is None or len(self.tokens) < 2:
      return None
    return (self.finish_time - self.first_token_time) / (len(self.tokens) - 1)

  @property
  def e2e(self) -> float:
    """End-to-end latency, seconds."""
    return self.finish_time - self.arrival_time

  @property
  def acceptance_rate(self) -> float | None:
    """accepted / evaluated over its iterations (None if it never speculated)."""
    return self.accepted / self.evaluated if self.evaluated else None
