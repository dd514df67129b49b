"""The engine's runner: the models and the batch on their devices, and the slot
programs run on them (after vLLM's v1 model runner, which keeps the device side
apart from the scheduler).

It owns the `SlotState` (`specjax.serving.batch`) and every call of a program
of `specjax.serving.slots` and `specjax.serving.rows` on it: prefill into a
slot, the step, the drafter's resync, row moves, releases and the constraint
table's shifts. It turns host values into the programs' inputs (`put`: on a
mesh, copied to every device alike, so that a program compiles once), places
the models on the mesh (`place_models`), and hands the host `Committed` copies
of the rows. The step's randomness is the engine's seed folded with the step
and admission counts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from specjax import constraints
from specjax.drafting import Drafter, check_drafter
from specjax.generation.state import SpecConfig
from specjax.generation.verify_length import check_verify_lengths
from specjax.models.kv_cache import check_capacity
from specjax.models.transformer import Transformer
from specjax.sampling import GREEDY, RowSampling
from specjax.serving import mesh as mesh_lib
from specjax.serving import rows, slots
from specjax.serving.batch import RowCounts, SlotConfig, SlotState, StepCounts
from specjax.serving.config import EngineConfig
from specjax.serving.constraint_table import ConstraintPlacement
from specjax.serving.output import Committed
from specjax.serving.request import Request

# A default meaning the runner's own (the verify lengths warm-up measured).
SAME = object()


def place_models(config: EngineConfig, target: Transformer, drafter: Drafter | None):
  """`(config, mesh, target, drafter)`: without `config.mesh` as given (mesh
  None); else the mesh resolved against the devices (before anything compiles)
  and the models placed on it (`specjax.serving.mesh.place_models`)."""
  if config.mesh is None:
    return config, None, target, drafter
  shape = mesh_lib.resolve(config.mesh)
  config = dataclasses.replace(config, mesh=shape)
  mesh = mesh_lib.build_mesh(shape)
  target, drafter = mesh_lib.place_models(
    target, drafter, mesh, config.draft_placement, config.vocab_placement
  )
  return config, mesh, target, drafter


def check_models(config: EngineConfig, target: Transformer, drafter: Drafter | None) -> int:
  """Checks that the models serve `config` (cache capacity, drafter, verify
  lengths); returns the KV-cache capacity per row."""
  capacity = check_capacity(
    "target", target.cfg.max_seq_len, config.max_prompt_len, config.max_new_tokens, config.gamma
  )
  if drafter is not None:
    check_drafter(
      drafter,
      target,
      prompt_width=config.max_prompt_len,
      max_new_tokens=config.max_new_tokens,
      gamma=config.gamma,
    )
  if config.verify_lengths is not None:
    if drafter is None:
      raise ValueError("verify_lengths needs a drafter (draft is None).")
    lengths = config.verify_lengths
    check_verify_lengths(lengths, (1.0,) * len(lengths), config.gamma, drafter)
  return capacity


def request_key(seed: int, choice: int = 0) -> jax.Array:
  """The key a seeded request draws with: the 64-bit seed as key data, folded
  with the choice's index. `autoregressive_generate(..., key=request_key(seed)[None])`
  gives the text the server gives the request (`specjax.coupling`)."""
  seed %= 2**64
  data = jnp.asarray([seed >> 32, seed & 0xFFFFFFFF], jnp.uint32)
  return jax.random.fold_in(jax.random.wrap_key_data(data), choice)


class Runner:
  """The batch of `config.slots` slots and the programs that change it.

  Args:
    target, drafter: the models (placed on `mesh`, if any); drafter None: plain steps.
    config: the engine's fitted `EngineConfig`.
    mesh: the engine's mesh, or None (one device).
    eos_ids: the model's EOS id(s).
    capacity: KV-cache slots per row.
    placement: the constraint table's placement (None: no table).

  Attributes:
    state: the `SlotState`; the programs donate it, so it is replaced by each.
    verify: `(draft length, width) -> (verify lengths, their costs)` of the step
      programs, as warm-up measured them (none: every drafted token verified).
    drafter_stale: plain steps ran since the drafter last drafted (it is
      re-synced from the rows' tokens before it drafts again).
    counts: the rows' `RowCounts` as last read (host), for requests stopped
      between steps.
  """

  def __init__(
    self, target, drafter, config: EngineConfig, mesh, eos_ids, capacity: int, placement
  ):
    self.target, self.drafter, self.mesh = target, drafter, mesh
    self.placement: ConstraintPlacement | None = placement
    spec = SpecConfig(
      gamma=config.gamma,
      max_new_tokens=config.max_new_tokens,
      sampling=None,  # every row its own (RowSampling)
      # Seeded rows: Gumbel-max coupling with their own keys (their text is
      # the same with or without speculation); the others: the token rule,
      # exact for any mix of greedy and sampled rows.
      verifier="coupled",
      coupled=True,
      eos_id=eos_ids,
      forced_drafts=config.forced_drafts,
    )
    self.slot_config = SlotConfig(spec, capacity, config.max_prompt_len, config.logprobs, mesh)
    self.slots, self.gamma, self.buckets = config.slots, config.gamma, config.prompt_buckets
    self.verify: dict[tuple[int, int], tuple[tuple[int, ...], tuple[float, ...]]] = {}
    self._placed_table = (None, None)  # (the table, its copy on the mesh)
    self.key, self._admit_key = self.put(jax.random.split(jax.random.key(config.seed)))
    self.steps = self.admitted = 0
    with self.on_mesh():
      self.reset()
    if drafter is not None:
      rows.check_per_row(self.state.spec.drafter_state, config.slots, "draft state")

  def on_mesh(self):
    """The context every program runs in: the mesh set (`jax.set_mesh`, which
    the models' sharding constraints read), or nothing without one."""
    return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

  def put(self, tree):
    """Host values (numpy arrays, a `RowSampling`, keys) as the programs' inputs:
    on a mesh, copied to every device (replicated), so that each program sees
    its inputs placed alike at warm-up and after and compiles once; else as
    JAX arrays on the default device."""
    if self.mesh is None:
      return jax.tree.map(lambda x: x if isinstance(x, jax.Array) else jnp.asarray(x), tree)
    return jax.tree.map(functools.partial(mesh_lib.replicate, self.mesh), tree)

  def table(self) -> constraints.ConstraintTable | None:
    """The constraint table as the programs take it (None: no table)."""
    if self.placement is None:
      return None
    table = self.placement.table
    if self.mesh is not None and table is not self._placed_table[0]:
      # Every device reads any row's state: the table is copied to each (once per change).
      self._placed_table = (table, self.put(table))
    return table if self.mesh is None else self._placed_table[1]

  def free_start(self, n: int):
    """Start states of `n` unconstrained rows (None: no table)."""
    if self.placement is None:
      return None
    return self.put(np.full((n,), constraints.FREE, np.int32))

  def blank(self) -> SlotState:
    """A batch of free slots (every row done)."""
    b = self.slots
    inputs = (
      np.zeros((b, 1), np.int32),
      np.ones((b,), np.int32),
      np.ones((b,), np.int32),  # budget 1: every blank slot is done
      np.full((b,), -1, np.int32),
      RowSampling.of(GREEDY, b),
    )
    return slots.blank(
      self.target,
      self.drafter,
      *self.put(inputs),
      self.key,
      table=self.table(),
      start=self.free_start(b),
      config=self.slot_config,
    )

  def reset(self) -> None:
    """A fresh batch of free slots (the last was lost, or warm-up is done)."""
    self.state = self.blank()
    self.drafter_stale = False
    self.counts: RowCounts | None = None

  def lost(self) -> bool:
    """Whether the batch's buffers are gone (a program failed after taking them)."""
    return any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(self.state))

  # ------------------------------------------------------------ row programs

  def admission_key(self) -> jax.Array:
    """The next admission's key (the seed's admission key folded with the count)."""
    key = jax.random.fold_in(self._admit_key, self.admitted)
    self.admitted += 1
    return key

  def admit(
    self, slot: int, request: Request, key: jax.Array, start: int | None, target_only=False
  ) -> None:
    """Prefills `request` into `slot` (padded to the smallest prompt bucket that
    holds it); `target_only`: the target alone (the drafter is re-synced before
    it drafts). `start`: its constraint's start state (None: no table)."""
    prompt = np.asarray(request.prompt, np.int32)
    width = next(p for p in self.buckets if p >= prompt.size)
    row_key = np.zeros((1, 2), np.uint32)  # unseeded (greedy rows: a seed changes nothing)
    if request.seed is not None and not request.sampling.greedy:
      row_key = np.asarray(jax.random.key_data(request_key(request.seed, request.choice)))[None]
    cap = self.gamma if request.max_draft_tokens is None else request.max_draft_tokens
    stop = -1 if request.stop_id is None else request.stop_id
    inputs = (
      np.int32(slot),
      np.pad(prompt, (0, width - prompt.size))[None],
      np.asarray([prompt.size], np.int32),
      np.asarray([request.max_new_tokens], np.int32),
      np.asarray([stop], np.int32),
      RowSampling.of([request.sampling]),
    )
    rest = (row_key, np.asarray(request.logprobs is not None), np.asarray([cap], np.int32))
    self.state = slots.admit(
      self.target,
      None if target_only else self.drafter,
      self.state,
      *self.put(inputs),
      key,
      *self.put(rest),
      self.table(),
      None if start is None else self.put(np.asarray([start], np.int32)),
      config=self.slot_config,
    )

  def move(self, source: int, dest: int) -> None:
    source, dest = self.put((np.int32(source), np.int32(dest)))
    self.state = rows.move(self.state, source, dest, mesh=self.mesh)

  def release(self, mask: np.ndarray) -> None:
    """Marks the slots of `mask [B]` (bool) done: they commit nothing more."""
    self.state = rows.release(self.state, self.put(mask), mesh=self.mesh)

  def shift_constraints(self, shift: np.ndarray) -> None:
    """Moves each constrained row's state by `shift [B]` (the table was packed)."""
    self.state = rows.shift_constraints(self.state, self.put(shift), mesh=self.mesh)

  # ----------------------------------------------------------------- the step

  def run(self, gamma: int, width: int, record: bool) -> tuple[StepCounts, Committed, float]:
    """One step of draft length `gamma` (0: plain) on the first `width` slots,
    waited for: its counts, the rows as committed (`record`: with the
    log-probabilities, which the step then computes) and its seconds."""
    if gamma and self.drafter_stale:
      self.state = slots.resync(
        self.target, self.drafter, self.state, width=width, config=self.slot_config
      )
      self.drafter_stale = False
    # The step is timed for the policy: what was dispatched before it (moves, a
    # resync) must not count in its time.
    jax.block_until_ready(self.state.spec.done)
    start = time.perf_counter()
    counts = self.step(gamma, width, jax.random.fold_in(self.key, self.steps), record)
    counts, committed = _fetch((counts, self._rows(record)))
    self.counts = committed.counts
    self.steps += 1
    self.drafter_stale |= gamma == 0
    return counts, committed, time.perf_counter() - start

  def committed(self, record: bool) -> Committed:
    """The rows as committed now (after admissions), host copies."""
    committed = _fetch(self._rows(record))
    self.counts = committed.counts
    return committed

  def _rows(self, record: bool) -> Committed:
    spec = self.state.spec
    logprobs = self.state.logprobs if record else None
    return Committed(spec.tokens, spec.num_generated, spec.done, RowCounts.of(self.state), logprobs)

  def step(self, gamma: int, width: int, key: jax.Array, record=False, verify=SAME) -> StepCounts:
    """Dispatches one step program on the batch; returns its counts (on device).
    `verify`: the step's (verify lengths, costs), by default warm-up's."""
    self.state, counts = slots.step(
      *self._step_inputs(gamma, key, record), **self._statics(gamma, width, verify)
    )
    return counts

  def lowered_step(self, gamma: int, width: int) -> jax.stages.Lowered:
    """The step program as `step` runs it, lowered on the batch (runs nothing)."""
    with self.on_mesh():
      return slots.step.lower(
        *self._step_inputs(gamma, self.key, False), **self._statics(gamma, width)
      )

  def _step_inputs(self, gamma: int, key: jax.Array, record: bool) -> tuple:
    # A plain step takes no drafter: its dispatch would flatten the draft model's
    # parameters for nothing.
    drafter = self.drafter if gamma else None
    return self.target, drafter, self.state, key, self.put(np.asarray(record)), self.table()

  def _statics(self, gamma: int, width: int, verify=SAME) -> dict:
    verify = self.verify.get((gamma, width)) if verify is SAME else verify
    return dict(gamma=gamma, width=width, config=self.slot_config, verify=verify)


def _fetch(tree):
  """`jax.device_get(tree)`; in a job over several processes every process gathers
  the rows the others hold (a collective each runs: they step in lockstep)."""
  if jax.process_count() == 1:
    return jax.device_get(tree)
  return multihost_utils.process_allgather(tree, tiled=True)
