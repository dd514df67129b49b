"""An engine's static settings, and fitting them to the models' context.

  EngineConfig   slots, draft lengths, prompt buckets, budget, batch widths, seed
  fit_config     prompt buckets and budget left unset derived from the shorter
                 context of target and draft (checked when given)

Nothing here compiles: a config that cannot fit is refused before any program
is built, with a message naming the fields (or a launcher's flags) to change.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

from specjax.drafting import Drafter, as_drafter
from specjax.generation.verify_length import check_lengths
from specjax.models.transformer import Transformer
from specjax.serving import mesh as mesh_lib
from specjax.serving.policy import POLICIES
from specjax.validation import check_int, check_positive_int, is_int

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
      step count and the request count; seeded requests use their own keys).
    logprobs: the most alternatives a request may ask for with its token
      log-probabilities (0: none are recorded, nothing computed).
    constraint_states: the states of the constraint table every step masks by
      (`specjax.serving.constraint_table`): the live requests' automata share
      it, one unconstrained state included. 0: no constraints (requests with
      one are refused, and steps mask nothing).
    max_queue: the most requests waiting for a slot; `submit` past it raises
      `QueueFull` (a server answers 429). 0: no bound.
    verify_lengths: None (off), or the verify lengths to compile (distinct ints
      in [1, gamma], sorted, gamma last): a drafting step then verifies its
      rows' chains cut to the length the drafter's confidence makes worth it,
      chosen in-graph across the batch (`specjax.generation.verify_length`),
      by the costs warm-up measures per draft length and width. Needs a chain
      drafter that gives confidence (a draft model, layer skip).
    forced_drafts: under a constraint, a drafting step drafts the tokens each
      row's state forces (a state that allows one token, and the chain of such
      states) first, at no drafter cost (`SpecConfig.forced_drafts`); counted
      apart in each request's usage (`speculation.forced`) and in
      `specjax_forced_tokens`.
    mesh: None (one device), or the `(data, model)` shape of the device mesh
      the engine runs on (`specjax.distributed.make_mesh`; one entry may be -1,
      the rest of the devices): slots split over `data`, the target (its
      attention heads, MLP and vocabulary, its caches' kv heads) over `model`.
      `slots` and every width must be multiples of `data`.
    draft_placement: on a mesh, "replicate" (every device holds the drafter's
      own modules: a small draft drafts with no communication) or "shard" (they
      are split by the same rules as the target: a large draft).
    vocab_placement: on a mesh, "replicate" (every device holds the embedding
      and LM head: whole logits on each, so sampling and verification need no
      communication) or "shard" (their vocabulary split over `model`: less
      memory, dozens of small collectives per step; docs/scale_out.md).
  """

  slots: int = 16
  gamma: int = 4
  policy: str = "adaptive"
  gammas: tuple[int, ...] | None = None
  prompt_buckets: tuple[int, ...] | None = None
  max_new_tokens: int | None = None
  widths: tuple[int, ...] | None = None
  seed: int = 0
  logprobs: int = 0
  constraint_states: int = 0
  max_queue: int = 0
  verify_lengths: tuple[int, ...] | None = None
  forced_drafts: bool = True
  mesh: tuple[int, int] | None = None
  draft_placement: str = "replicate"
  vocab_placement: str = "replicate"

  def __post_init__(self):
    object.__setattr__(self, "mesh", mesh_lib.check_shape(self.mesh))
    if self.vocab_placement not in mesh_lib.VOCAB_PLACEMENTS:
      raise ValueError(
        f"vocab_placement must be one of {', '.join(mesh_lib.VOCAB_PLACEMENTS)}, got "
        f"{self.vocab_placement!r}."
      )
    if self.draft_placement not in mesh_lib.DRAFT_PLACEMENTS:
      raise ValueError(
        f"draft_placement must be one of {', '.join(mesh_lib.DRAFT_PLACEMENTS)}, got "
        f"{self.draft_placement!r}."
      )
    check_int("max_queue", self.max_queue, 0)
    check_int("logprobs", self.logprobs, 0, 20)
    check_int("constraint_states", self.constraint_states, 0)
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
    if self.verify_lengths is not None:
      lengths = check_lengths(self.verify_lengths, self.gamma)
      object.__setattr__(self, "verify_lengths", lengths)
    if not isinstance(self.forced_drafts, bool):
      raise ValueError(f"forced_drafts must be True or False, got {self.forced_drafts!r}.")
    self._check_rows()

  @property
  def data(self) -> int:
    """D, the devices the slots are split over (1 without a mesh, or while its
    `data` entry is -1: known once the engine resolves it against the devices)."""
    return max(1, self.mesh[0]) if self.mesh is not None else 1

  def _check_rows(self) -> None:
    """Slots and widths split evenly over `data` (each device runs W / D rows)."""
    d = self.data
    if self.slots % d:
      raise ValueError(
        f"slots ({self.slots}) must be a multiple of the mesh's data axis ({d}): each data "
        f"device holds slots / {d} of them; try slots={-(-self.slots // d) * d}."
      )
    if self.widths is not None and any(w % d for w in self.widths):
      raise ValueError(
        f"widths must be multiples of the mesh's data axis ({d}), got {self.widths!r}: a "
        f"step runs width / {d} rows on each data device."
      )

  @property
  def max_prompt_len(self) -> int | None:
    """The largest prompt bucket (None while the buckets are left to `fit_config`)."""
    return None if self.prompt_buckets is None else self.prompt_buckets[-1]

  @property
  def step_widths(self) -> tuple[int, ...]:
    if self.widths is not None:
      return self.widths
    powers = (2**i for i in range(self.slots.bit_length()))
    return (*(w for w in powers if w < self.slots and w % self.data == 0), self.slots)

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
  role, context = context_limit(target, draft)
  fit = _Fit(role, context, config.gamma, {**_FIT_NAMES, **(names or {})})
  largest, budget = config.max_prompt_len, config.max_new_tokens
  if largest is not None and budget is not None:
    fit.check(largest, budget)
    return config
  if largest is not None:  # the budget is what the buckets leave
    fitted = dataclasses.replace(config, max_new_tokens=fit.budget_for(largest))
  else:
    buckets, budget = fit.buckets_for(budget)
    fitted = dataclasses.replace(config, prompt_buckets=buckets, max_new_tokens=budget)
  logger.info(
    "engine: prompt_buckets=%s, max_new_tokens=%d (derived for %s max_seq_len=%d, gamma=%d)",
    fitted.prompt_buckets,
    fitted.max_new_tokens,
    role,
    context,
    config.gamma,
  )
  return fitted


_FIT_NAMES = {k: k for k in ("prompt_buckets", "max_new_tokens", "gamma")}


@dataclasses.dataclass(frozen=True)
class _Fit:
  """`fit_config`'s arithmetic for one context: `room` positions hold the
  prompt and the new tokens; messages name the fields as `names` says."""

  role: str  # whose context: "target" or "draft"
  context: int  # its max_seq_len
  gamma: int
  names: Mapping[str, str]

  def __post_init__(self):
    if self.room < 2:
      c, gm = self.context, self.names["gamma"]
      raise ValueError(
        f"{self.role}: max_seq_len={c} holds no prompt and new token besides {gm} + 1 "
        f"({self.gamma + 1}); lower {gm}"
        + (f" (at most {c - 3})." if c >= 4 else "; this model's context is too short.")
      )

  @property
  def room(self) -> int:
    return self.context - self.gamma - 1

  def check(self, largest: int, budget: int) -> None:
    """Raises unless the largest bucket and the budget fit together."""
    if largest + budget <= self.room:
      return
    pb, mnt, gm = (self.names[k] for k in ("prompt_buckets", "max_new_tokens", "gamma"))
    hints = []
    if self.room - largest >= 1:
      hints.append(f"{mnt}={self.room - largest} fits these buckets")
    if self.room - budget >= 1:
      hints.append(f"a largest bucket <= {self.room - budget} fits this {mnt}")
    hint = f" ({'; '.join(hints)})" if hints else ""
    raise ValueError(
      f"{self.role}: the largest of {pb} ({largest}) + {mnt} ({budget}) + {gm} + 1 "
      f"({self.gamma + 1}) = {largest + budget + self.gamma + 1} exceeds "
      f"max_seq_len={self.context}; lower {pb}, {mnt} or {gm}{hint}, or leave {pb} and {mnt} "
      "unset to fit them to the model."
    )

  def budget_for(self, largest: int) -> int:
    """The budget the largest bucket leaves (<= DERIVED_CAP)."""
    if self.room - largest < 1:
      pb, gm = self.names["prompt_buckets"], self.names["gamma"]
      raise ValueError(
        f"{self.role}: the largest of {pb} ({largest}) + {gm} + 1 ({self.gamma + 1}) leaves no "
        f"room for new tokens in max_seq_len={self.context}; lower {pb} (at most "
        f"{self.room - 1}) or {gm}."
      )
    return min(DERIVED_CAP, self.room - largest)

  def buckets_for(self, budget: int | None) -> tuple[tuple[int, ...], int]:
    """`(buckets, budget)`: P / 4, P / 2 and P for the largest power of two P
    that the given budget leaves room for, or (no budget) <= C / 2 with the
    budget what P leaves."""
    if budget is not None:
      if self.room - budget < 1:
        mnt, gm = self.names["max_new_tokens"], self.names["gamma"]
        raise ValueError(
          f"{self.role}: {mnt} ({budget}) + {gm} + 1 ({self.gamma + 1}) leaves no room for a "
          f"prompt in max_seq_len={self.context}; lower {mnt} (at most {self.room - 1}) or {gm}."
        )
      top = _power_of_two_at_most(min(DERIVED_CAP, self.room - budget))
    else:
      top = _power_of_two_at_most(min(DERIVED_CAP, self.context // 2))
      while top > 1 and self.room - top < 1:
        top //= 2
      budget = min(DERIVED_CAP, self.room - top)
    return tuple(sorted({max(1, top // 4), max(1, top // 2), top})), budget


def _power_of_two_at_most(x: int) -> int:
  return 1 << (max(1, x).bit_length() - 1)
