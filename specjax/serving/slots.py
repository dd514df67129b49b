"""The engine's device side: a batch of slots and the pure programs that change it.

`SlotState` is `speculative_step`'s own `SpecState` for B slots plus each slot's
prompt, so the engine runs the very step `speculative_generate` runs. Each
program is jitted once per static shape (the engine compiles them all at
warm-up):

  fresh_rows    prefill new prompts `[n, P]` into rows of their own (target and
                drafter caches, first token sampled with the row's settings)
  admit         `fresh_rows` for one request written into one slot (without
                a drafter: the target's prefill only)
  step          one speculative iteration (gamma >= 1) or one plain
                autoregressive step (gamma = 0) on the first `width` slots
  resync        the drafter's state rebuilt from the rows' tokens, after plain
                steps left it behind
  move          one slot's row copied into another (keeps live rows in front,
                so a light load runs at a small width)
  release       slots marked done (cancelled requests stop committing)

On a mesh (`SlotConfig.mesh`) every program hands the batch back placed by
`specjax.serving.mesh.slot_shardings` (rows over `data`, kv heads over
`model`), writes and reads single rows by masks, and a narrow step runs on the
first rows of each `data` device's block.

Rows of finished or free slots run along (static shapes) but commit nothing.
A seeded row draws with its own key's Gumbel noise at each generated index
(`specjax.coupling`), in plain and speculative steps alike, so its text does not
depend on the batch, the draft length or the drafter. A row's `draft_limit` is
its request's cap on the draft length (0: it takes no drafted tokens).
With `SlotConfig.logprobs` = K > 0 committed tokens can record their
log-probabilities and K alternatives, from the logits that verified them.
With a constraint table (`specjax.constraints.ConstraintTable`, passed to each
program; `specjax.serving.constraint_table` places the requests' automata in
it) every row follows its own automaton (state `FREE`: unconstrained), in plain
and speculative steps alike.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh

from specjax import constraints, coupling
from specjax.coupling import Coupling
from specjax.drafting import Commit, Drafter
from specjax.generation.common import prefill, zero_padding
from specjax.generation.speculative import (
  commit_cache,
  commit_tokens,
  next_recent,
  prefill_state,
  score,
  speculative_step,
  step_sampling,
)
from specjax.generation.state import SpecConfig, SpecState
from specjax.models.kv_cache import write_rows
from specjax.models.transformer import Transformer
from specjax.sampling import GREEDY, MIN_TEMPERATURE, RowSampling, finite_rows, warp_probs
from specjax.serving.mesh import constrain_slots, data_size

# SpecState fields that hold one entry per row (the rest are batch-wide).
ROW_FIELDS = (
  "target_cache",
  "drafter_state",
  "recent",
  "draft_limit",
  "tokens",
  "num_generated",
  "done",
  "budget",
  "stop",
  "sampling",
  "constraint_state",
  "history",
)
ROW_STATS = (
  "proposed",
  "accepted",
  "evaluated",
  "row_iterations",
  "generated",
  "forced",
  "non_finite",
)


@struct.dataclass
class SlotState:
  """The engine's batch: `spec` (rows = slots) and each slot's prompt.

  Attributes:
    spec: `SpecState` with `sampling` a `RowSampling` (every slot its own) and
      `keys` `[1, 2]` (the step's keys, given per call).
    prompts: `[B, P_max]` int32, each slot's prompt, zero-padded.
    prompt_lengths: `[B]` int32.
    row_keys: `[B, 2]` uint32, a seeded row's own key data (zeros: none).
    logprobs: None, or `(logprob [B, L], top_ids [B, L, K], top_logprobs [B, L, K])`
      laid out as `spec.tokens`.
    positions: `[B, 2, G]` int32 (G = the largest draft length), each row's
      counts since its admission: `[:, 0, i]` the steps that drafted a token at
      position i + 1 for it, `[:, 1, i]` those whose drafted token i + 1 was
      accepted (the request's `drafted_at_position` / `accepted_at_position`).
  """

  spec: SpecState
  prompts: jax.Array
  prompt_lengths: jax.Array
  row_keys: jax.Array
  logprobs: tuple | None = None
  positions: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class SlotConfig:
  """Static settings of the engine's programs (hashable).

  Attributes:
    spec: the `SpecConfig` of `speculative_step` (`gamma` the largest draft
      length, `max_new_tokens` the per-request cap, `sampling` None: per row).
    capacity: KV-cache slots per row.
    max_prompt_len: P_max.
    logprobs: K, the alternatives recorded per token (0: no log-probabilities).
    mesh: None (one device), or the engine's mesh: every program hands the batch
      back placed by `specjax.serving.mesh.slot_shardings`, rows are written
      and read by masks (no dynamic index into a sharded axis), and a step at
      width W runs on the first W / D rows of each of the D row blocks
      (`specjax.serving.mesh.row_order`).
  """

  spec: SpecConfig
  capacity: int
  max_prompt_len: int
  logprobs: int = 0
  mesh: Mesh | None = None

  @property
  def blocks(self) -> int:
    """D, the row blocks (the mesh's `data` size; 1 without a mesh)."""
    return data_size(self.mesh)


def map_rows(fn, *states: SlotState) -> SlotState:
  """Applies `fn` to every per-row leaf (leading axis B) of `states`, leaf by
  leaf; the batch-wide leaves (keys, step counters) come from the first."""
  first = states[0]

  def rows(get):
    return jax.tree.map(fn, *(get(s) for s in states))

  stats = first.spec.stats.replace(
    **{f: rows(lambda s, f=f: getattr(s.spec.stats, f)) for f in ROW_STATS}
  )
  spec = first.spec.replace(
    **{f: rows(lambda s, f=f: getattr(s.spec, f)) for f in ROW_FIELDS}, stats=stats
  )
  return first.replace(
    spec=spec,
    **{f: rows(lambda s, f=f: getattr(s, f)) for f in SLOT_FIELDS},
  )


SLOT_FIELDS = ("prompts", "prompt_lengths", "row_keys", "logprobs", "positions")


def _seeded(row_keys: jax.Array) -> jax.Array:
  return jnp.any(row_keys != 0, axis=-1)


def _coupled_rows(row_keys: jax.Array) -> dict:
  """`SpecState`'s coupling fields for `row_keys [B, 2]`: the seeded rows draw
  with their own key's Gumbel noise (`specjax.coupling`), the others as before."""
  return dict(row_keys=jax.random.wrap_key_data(row_keys), coupled_rows=_seeded(row_keys))


def token_logprobs(logits: jax.Array, tokens: jax.Array, sampling: RowSampling, k: int) -> tuple:
  """`(logprob [B, T], top_ids [B, T, k], top_logprobs [B, T, k])` of `tokens [B, T]`
  under each row's temperature, top-k and top-p of `logits [B, T, V]` (a greedy
  row's: at temperature 1; the warps that read its text are left out)."""
  t = sampling.temperature
  law = RowSampling(jnp.where(t < MIN_TEMPERATURE, 1.0, t), sampling.top_k, sampling.top_p)
  logp = jnp.log(warp_probs(logits, law))
  chosen = jnp.take_along_axis(logp, jnp.clip(tokens, 0, logp.shape[-1] - 1)[..., None], -1)
  top, ids = jax.lax.top_k(logp, k)
  return chosen[..., 0], ids.astype(jnp.int32), top


def _record(state: SlotState, spec: SpecState, logits, emitted, at, k: int, on) -> SlotState:
  """`state` with `spec` and, when `on` (a traced bool: some row asked), the
  log-probabilities of `emitted [B, T]` written at offsets `at [B]`; `logits()`
  gives their `[B, T, V]` (called only then)."""
  if not k:
    return state.replace(spec=spec)

  def write(buffers):
    new = token_logprobs(logits(), emitted, spec.sampling, k)
    return tuple(write_rows(b, n, at) for b, n in zip(buffers, new))

  return state.replace(spec=spec, logprobs=jax.lax.cond(on, write, lambda b: b, state.logprobs))


def fresh_rows(
  target: Transformer,
  drafter: Drafter | None,
  prompts: jax.Array,
  prompt_lengths: jax.Array,
  budget: jax.Array,
  stop: jax.Array,
  sampling: RowSampling,
  key: jax.Array,
  config: SlotConfig,
  row_keys: jax.Array | None = None,
  record=False,
  table: constraints.ConstraintTable | None = None,
  start: jax.Array | None = None,
) -> SlotState:
  """Rows for new requests: prompts `[n, P]` prefilled into caches of the engine's
  capacity, their first tokens sampled with their own settings.

  Args:
    prompts: `[n, P]` right-padded, P <= P_max; prompt_lengths, budget, stop `[n]`.
    sampling: the rows' `RowSampling` (n rows).
    row_keys: `[n, 2]` (default: unseeded); a seeded row draws its first token
      from its own key.
    record: (traced) bool, record the first tokens' log-probabilities.
    table, start: None, or the engine's constraint table and the rows' start
      states `[n]` (`FREE`: unconstrained): the first token among what they allow.
  """
  n, width = prompts.shape
  prompts = zero_padding(prompts, prompt_lengths)
  row_keys = jnp.zeros((n, 2), jnp.uint32) if row_keys is None else row_keys
  rules = None if table is None else constraints.RowConstraints(table, start)
  spec = prefill_state(
    target,
    drafter,
    prompts,
    prompt_lengths,
    key,
    config.spec,
    capacity=config.capacity,
    budget=budget,
    stop=stop,
    keys=jax.random.split(key, (1, 2)),  # the engine gives each step its keys
    rows=sampling,
    **_coupled_rows(row_keys),  # a seeded row's first token: its draw at index 0
    rules=rules,
  ).replace(row_keys=None, coupled_rows=None)  # they live in SlotState.row_keys
  padded = jnp.pad(prompts, ((0, 0), (0, config.max_prompt_len - width)))
  positions = jnp.zeros((n, 2, config.spec.gamma), jnp.int32)
  state = SlotState(spec, padded, prompt_lengths, row_keys, positions=positions)
  if not config.logprobs:
    return state
  # The first token's law: the last prompt position again (`prefill` keeps no logits).
  last = jnp.take_along_axis(prompts, (prompt_lengths - 1)[:, None], axis=1)
  cache = spec.target_cache.with_lengths(prompt_lengths - 1)
  shape = (n, spec.tokens.shape[1], config.logprobs)
  state = state.replace(
    logprobs=(jnp.zeros(shape[:2]), jnp.zeros(shape, jnp.int32), jnp.zeros(shape))
  )

  def first_logits():  # under the row's constraint, as the first token was drawn
    logits = score(target, last, cache)[0]
    return logits if table is None else constraints.mask_logits(logits, table, start[:, None])

  return _record(
    state,
    spec,
    first_logits,
    spec.tokens[:, :1],
    jnp.zeros_like(prompt_lengths),
    config.logprobs,
    record,
  )


def plain_step(
  target: Transformer, state: SpecState, config: SpecConfig, row_keys=None, table=None
) -> tuple[SpecState, jax.Array, jax.Array]:
  """One autoregressive step on a `SpecState`: the target scores s[-1], each active
  row commits one token drawn from its warped law (a seeded row by Gumbel-max with
  its own key `row_keys [B, 2]`'s noise at its generated index). The drafter's state
  is left as it was (behind by one token per step; `resync` catches it up).
  With a constraint `table`, each row draws among what its state allows.

  Returns:
    `(state, logits [B, 1, V], emitted [B, 1])`.
  """
  logits, cache, _ = score(target, state.recent[:, 1:], state.target_cache)
  if table is not None:
    logits = constraints.mask_logits(logits, table, state.constraint_state[:, None])
  sampling = step_sampling(state, config)  # with the rows' committed text
  probs = warp_probs(logits[:, 0], sampling)
  key = state.keys[0, 1]
  if row_keys is not None:  # seeded rows: the coupled draw at their generated index
    rows = _coupled_rows(row_keys)
    vocab = target.cfg.vocab_size
    key = Coupling.of(rows["row_keys"], state.num_generated, 1, vocab, key, rows["coupled_rows"])
  token = coupling.sample_tokens(key, probs)
  n = jnp.zeros_like(token)
  emitted = token[:, None]
  tokens, num_generated, done, count = commit_tokens(state, emitted, n, config)
  broken = ~finite_rows(probs) & ~state.done  # stopped, this draw not kept (`commit_step`)
  num_generated = jnp.where(broken, state.num_generated, num_generated)
  done, count = done | broken, jnp.where(broken, 0, count)
  history = None if state.history is None else state.history.after(emitted, count)
  goes_on = ~done
  old_length = state.target_cache.lengths + 1
  if table is not None:
    after = constraints.advance(table, state.constraint_state, token)
    state = state.replace(constraint_state=jnp.where(state.done, state.constraint_state, after))
  state = state.replace(
    target_cache=commit_cache(cache, Commit(emitted, old_length, old_length + 1, goes_on)),
    recent=next_recent(state.recent, emitted, n, goes_on),
    tokens=tokens,
    num_generated=num_generated,
    done=done,
    history=history,
    stats=state.stats.record(
      active=~state.done,
      proposed=n,
      accepted=n,
      generated=count,
      draft_calls=jnp.int32(0),
      non_finite=broken,
    ),
  )
  return state, logits, emitted


def _blocked(x: jax.Array, blocks: int) -> jax.Array:
  """`[B, ...]` as `[D, B / D, ...]`: each row block (one `data` device's) apart."""
  return x.reshape(blocks, x.shape[0] // blocks, *x.shape[1:])


def _prefix(state: SlotState, width: int, blocks: int = 1) -> SlotState:
  """The rows a step at `width` runs on: the first `width / D` of each row block
  (on one device, simply the first `width`)."""
  if width == state.prompts.shape[0]:
    return state
  if blocks == 1:
    return map_rows(lambda x: x[:width], state)
  return map_rows(
    lambda x: _blocked(x, blocks)[:, : width // blocks].reshape(width, *x.shape[1:]), state
  )


def _put_prefix(state: SlotState, part: SlotState, width: int, blocks: int = 1) -> SlotState:
  """`state` with its `_prefix` rows (and the batch-wide leaves) from `part`."""
  if width == state.prompts.shape[0]:
    return part
  if blocks == 1:
    return map_rows(lambda new, full: full.at[:width].set(new), part, state)

  def put(new, full):
    rows = _blocked(full, blocks).at[:, : width // blocks].set(_blocked(new, blocks))
    return rows.reshape(full.shape)

  return map_rows(put, part, state)


def _row_mask(x: jax.Array, row: jax.Array) -> jax.Array:
  """`[B, 1, ...]` bool, True at row `row` (broadcasts against `x [B, ...]`)."""
  return (jnp.arange(x.shape[0]) == row).reshape(-1, *(1,) * (x.ndim - 1))


def _set_row(full: jax.Array, new: jax.Array, row: jax.Array, mesh: Mesh | None) -> jax.Array:
  """`full [B, ...]` with row `row` (traced) replaced by `new [1, ...]`. On a
  mesh by a mask: a dynamic update of an axis split over devices would have
  XLA gather the whole array (a cache) to each device first."""
  if mesh is None:
    return full.at[row].set(new[0])
  return jnp.where(_row_mask(full, row), new, full)


def _get_row(x: jax.Array, row: jax.Array, mesh: Mesh | None) -> jax.Array:
  """`x[row]` (traced row); on a mesh a masked sum over the rows, which moves
  one row between devices (an all-reduce of its size), not the array."""
  if mesh is None:
    return x[row]
  picked = jnp.where(_row_mask(x, row), x, jnp.zeros((), x.dtype))
  return jnp.any(picked, axis=0) if x.dtype == jnp.bool_ else jnp.sum(picked, axis=0, dtype=x.dtype)


def _step(
  target: Transformer,
  drafter: Drafter | None,
  state: SlotState,
  key: jax.Array,
  record: jax.Array | bool = False,
  table: constraints.ConstraintTable | None = None,
  *,
  gamma: int,
  width: int,
  config: SlotConfig,
  verify: tuple[tuple[int, ...], tuple[float, ...]] | None = None,
) -> tuple[SlotState, jax.Array]:
  part = _prefix(state, width, config.blocks)
  part = part.replace(spec=part.spec.replace(keys=jax.random.split(key, (1, 2))))
  before = part.spec.stats
  spec_config = dataclasses.replace(config.spec, gamma=gamma)
  if verify is not None:  # (verify lengths, their costs) of this step (`SpecConfig`)
    spec_config = dataclasses.replace(spec_config, verify_lengths=verify[0], verify_costs=verify[1])
  if gamma == 0:
    spec, logits, emitted = plain_step(target, part.spec, spec_config, part.row_keys, table)
  else:
    coupled = part.spec.replace(**_coupled_rows(part.row_keys))
    if config.logprobs:
      spec, logits, emitted = speculative_step(
        target, drafter, coupled, spec_config, with_logits=True, table=table
      )
    else:
      spec = logits = emitted = speculative_step(target, drafter, coupled, spec_config, table=table)
    spec = spec.replace(row_keys=None, coupled_rows=None)
  at = part.spec.num_generated
  part = _record(part, spec, lambda: logits, emitted, at, config.logprobs, record)
  # Each row's drafted tokens this step and those accepted (0 for rows that
  # were done): the steps that drafted / accepted its token at each position.
  proposed = spec.stats.proposed - before.proposed
  accepted = spec.stats.accepted - before.accepted
  at = jnp.arange(config.spec.gamma)[None, None, :]
  step_positions = (at < jnp.stack([proposed, accepted], axis=1)[..., None]).astype(jnp.int32)
  part = part.replace(positions=part.positions + step_positions)
  # This step's counts over the rows: accepted and evaluated drafted tokens (the
  # policy's alpha), drafted ones, forced ones (among the accepted), then `[2, G]`
  # by position, flattened.
  counts = jnp.concatenate(
    [
      jnp.stack(
        [
          jnp.sum(accepted),
          jnp.sum(spec.stats.evaluated - before.evaluated),
          jnp.sum(proposed),
          jnp.sum(spec.stats.forced - before.forced),
        ]
      ),
      jnp.sum(step_positions, axis=0).reshape(-1),
    ]
  )
  return _placed(_put_prefix(state, part, width, config.blocks), config.mesh), counts


def _resync(
  target: Transformer, drafter: Drafter, state: SlotState, *, width: int, config: SlotConfig
) -> SlotState:
  """Rebuilds the drafter's state of the first `width` rows from their tokens
  s = prompt + generated (as its `init` would after prefilling s)."""
  part = _prefix(state, width, config.blocks)
  spec = part.spec
  length = part.prompt_lengths + spec.num_generated  # len(s)
  columns = jnp.arange(config.max_prompt_len + config.spec.max_new_tokens)[None, :]
  from_prompt = columns < part.prompt_lengths[:, None]
  prompt_part = jnp.take_along_axis(
    part.prompts, jnp.minimum(columns, config.max_prompt_len - 1), axis=1
  )
  generated = jnp.take_along_axis(
    spec.tokens, jnp.clip(columns - part.prompt_lengths[:, None], 0, spec.tokens.shape[1] - 1), 1
  )
  sequence = jnp.where(from_prompt, prompt_part, generated)  # [W, P_max + max_new]
  hidden = None
  if drafter.target_features:
    *_, hidden = prefill(
      target,
      sequence,
      length - 1,
      config.capacity,
      jax.random.key(0),  # its sampled token is not used
      GREEDY,
      return_hidden=drafter.target_features,
    )
  drafter_state = drafter.init(sequence, length - 1, spec.recent[:, 1], config.capacity, hidden)
  part = part.replace(spec=spec.replace(drafter_state=drafter_state))
  return _placed(_put_prefix(state, part, width, config.blocks), config.mesh)


def _admit(
  target: Transformer,
  drafter: Drafter | None,
  state: SlotState,
  slot: jax.Array,
  prompt: jax.Array,
  prompt_length: jax.Array,
  budget: jax.Array,
  stop: jax.Array,
  sampling: RowSampling,
  key: jax.Array,
  row_key: jax.Array,
  record: jax.Array,
  draft_cap: jax.Array,
  table: constraints.ConstraintTable | None = None,
  start: jax.Array | None = None,
  *,
  config: SlotConfig,
) -> SlotState:
  """One request (prompt `[1, P]`, its `row_key [1, 2]`, `record` its logprobs,
  `draft_cap [1]` the most tokens it lets a step draft for it, 0: none, `start
  [1]` its constraint's start state in `table`) prefilled into slot `slot` (a
  traced index).

  `drafter` None into a batch that has a drafter state prefills the target
  only and leaves the slot's drafter state as it was: the engine does so
  while plain steps run, since the drafter is re-synced from every row's
  tokens before it drafts again.
  """
  row = fresh_rows(
    target,
    drafter,
    prompt,
    prompt_length,
    budget,
    stop,
    sampling,
    key,
    config,
    row_key,
    record,
    table,
    start,
  )
  # The row's own cap on its draft length, whatever length a step drafts.
  limit = jnp.minimum(row.spec.draft_limit, draft_cap)
  row = row.replace(spec=row.spec.replace(draft_limit=limit))
  if drafter is None:  # keep the slot's (stale) drafter state: the trees must match
    stale = jax.tree.map(lambda x: _get_row(x, slot, config.mesh)[None], state.spec.drafter_state)
    row = row.replace(spec=row.spec.replace(drafter_state=stale))
  state = map_rows(lambda full, new: _set_row(full, new, slot, config.mesh), state, row)
  return _placed(state, config.mesh)


def _move(state: SlotState, source: jax.Array, dest: jax.Array, mesh: Mesh | None = None):
  state = map_rows(lambda x: _set_row(x, _get_row(x, source, mesh)[None], dest, mesh), state)
  return _placed(state, mesh)


def _shift_constraints(state: SlotState, shift: jax.Array, mesh: Mesh | None = None):
  """Each constrained row's state moved by `shift [B]` (its automaton moved in
  the table: `specjax.serving.constraint_table`); unconstrained rows stay FREE."""
  states = state.spec.constraint_state
  moved = jnp.where(states > constraints.FREE, states + shift, states)
  return _placed(state.replace(spec=state.spec.replace(constraint_state=moved)), mesh)


def _release(state: SlotState, slots: jax.Array, mesh: Mesh | None = None) -> SlotState:
  """Slots `slots [B]` (bool) stop: marked done, they commit nothing more."""
  return _placed(state.replace(spec=state.spec.replace(done=state.spec.done | slots)), mesh)


def _blank(*args, config: SlotConfig, **kwargs) -> SlotState:
  """`fresh_rows` for the whole batch, placed on the engine's mesh."""
  return _placed(fresh_rows(*args, config=config, **kwargs), config.mesh)


def _placed(state: SlotState, mesh: Mesh | None) -> SlotState:
  """`state` where the engine keeps it (`specjax.serving.mesh.constrain_slots`)."""
  return constrain_slots(state, mesh, state.prompts.shape[0])


# The batch state is donated: its caches are updated in place, not copied per step.
step = jax.jit(
  _step, static_argnames=("gamma", "width", "config", "verify"), donate_argnames=("state",)
)
resync = jax.jit(_resync, static_argnames=("width", "config"), donate_argnames=("state",))
admit = jax.jit(_admit, static_argnames=("config",), donate_argnames=("state",))
move = jax.jit(_move, static_argnames=("mesh",), donate_argnames=("state",))
release = jax.jit(_release, static_argnames=("mesh",), donate_argnames=("state",))
shift_constraints = jax.jit(
  _shift_constraints, static_argnames=("mesh",), donate_argnames=("state",)
)
blank = jax.jit(_blank, static_argnames=("config",))


def check_per_row(tree: Any, batch: int, what: str) -> None:
  """Raises unless every leaf of `tree` has leading axis `batch` (the engine moves
  rows between slots leaf by leaf)."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    if getattr(leaf, "ndim", 0) < 1 or leaf.shape[0] != batch:
      raise ValueError(
        f"{what}: every leaf must have one row per slot (leading axis {batch}) for the "
        f"engine to move rows; {jax.tree_util.keystr(path)} has shape "
        f"{getattr(leaf, 'shape', ())}."
      )
