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

A step hands back its `StepCounts` (summed over its rows) beside the batch. The
state, its settings and its counts are `specjax.serving.batch`'s; the programs
that move rows between slots (`move`, `release`, `shift_constraints`) and the
row helpers they share with these are `specjax.serving.rows`'s (both are
importable from here too).

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

import jax
import jax.numpy as jnp

from specjax import compiler_options, constraints, coupling
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
  stop_broken,
)
from specjax.generation.state import SpecConfig, SpecState
from specjax.models.kv_cache import write_rows
from specjax.models.transformer import Transformer
from specjax.sampling import GREEDY, MIN_TEMPERATURE, RowSampling, finite_rows, warp_probs
from specjax.serving.batch import RowCounts, SlotConfig, SlotState, StepCounts  # noqa: F401
from specjax.serving.rows import (  # noqa: F401 (move, release, shift_constraints: the row programs)
  check_per_row,
  get_row,
  map_rows,
  move,
  placed,
  prefix,
  put_prefix,
  release,
  set_row,
  shift_constraints,
)


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
  return _first_logprobs(target, state, prompts, table, start, record, config.logprobs)


def _first_logprobs(target, state: SlotState, prompts, table, start, record, k: int) -> SlotState:
  """`state` (fresh rows of `prompts [n, P]`) with room for `k` log-probabilities
  per token, those of the first tokens written when `record`."""
  spec, lengths = state.spec, state.prompt_lengths
  # The first token's law: the last prompt position again (`prefill` keeps no logits).
  last = jnp.take_along_axis(prompts, (lengths - 1)[:, None], axis=1)
  cache = spec.target_cache.with_lengths(lengths - 1)
  shape = (prompts.shape[0], spec.tokens.shape[1], k)
  state = state.replace(
    logprobs=(jnp.zeros(shape[:2]), jnp.zeros(shape, jnp.int32), jnp.zeros(shape))
  )

  def first_logits():  # under the row's constraint, as the first token was drawn
    logits = score(target, last, cache)[0]
    return logits if table is None else constraints.mask_logits(logits, table, start[:, None])

  first = spec.tokens[:, :1]
  return _record(state, spec, first_logits, first, jnp.zeros_like(lengths), k, record)


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
  broken, num_generated, done, count = stop_broken(
    state, finite_rows(probs), num_generated, done, count
  )
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


def _count(part: SlotState, before, after, gamma: int) -> tuple[SlotState, StepCounts]:
  """A step's counts from its rows' `SpeculativeStats` `before` and `after` it:
  `part` with each row's counts by position advanced, and the step's sums."""
  # Each row's drafted tokens this step and those accepted (0 for rows that
  # were done): the steps that drafted / accepted its token at each position.
  proposed = after.proposed - before.proposed
  accepted = after.accepted - before.accepted
  at = jnp.arange(gamma)[None, None, :]
  step_positions = (at < jnp.stack([proposed, accepted], axis=1)[..., None]).astype(jnp.int32)
  counts = StepCounts(
    accepted=jnp.sum(accepted),
    evaluated=jnp.sum(after.evaluated - before.evaluated),
    drafted=jnp.sum(proposed),
    forced=jnp.sum(after.forced - before.forced),
    at_position=jnp.sum(step_positions, axis=0),
  )
  return part.replace(positions=part.positions + step_positions), counts


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
) -> tuple[SlotState, StepCounts]:
  part = prefix(state, width, config.blocks)
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
  part, counts = _count(part, before, spec.stats, config.spec.gamma)
  return placed(put_prefix(state, part, width, config.blocks), config.mesh), counts


def _resync(
  target: Transformer, drafter: Drafter, state: SlotState, *, width: int, config: SlotConfig
) -> SlotState:
  """Rebuilds the drafter's state of the first `width` rows from their tokens
  s = prompt + generated (as its `init` would after prefilling s)."""
  part = prefix(state, width, config.blocks)
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
  return placed(put_prefix(state, part, width, config.blocks), config.mesh)


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
    stale = jax.tree.map(lambda x: get_row(x, slot, config.mesh)[None], state.spec.drafter_state)
    row = row.replace(spec=row.spec.replace(drafter_state=stale))
  state = map_rows(lambda full, new: set_row(full, new, slot, config.mesh), state, row)
  return placed(state, config.mesh)


def _blank(*args, config: SlotConfig, **kwargs) -> SlotState:
  """`fresh_rows` for the whole batch, placed on the engine's mesh."""
  return placed(fresh_rows(*args, config=config, **kwargs), config.mesh)


# The batch state is donated: its caches are updated in place, not copied per step.
# specjax's compiler options (`compiler_options.jit`, the admission programs' too):
# on a GPU the step's draft loop and conditionals go into its command buffer, as
# the decode programs' do; a plain `jax.jit` left the loop on the host (27
# launches a trip on an H100).
step = compiler_options.jit(
  _step, static_argnames=("gamma", "width", "config", "verify"), donate_argnames=("state",)
)
resync = compiler_options.jit(
  _resync, static_argnames=("width", "config"), donate_argnames=("state",)
)
admit = compiler_options.jit(_admit, static_argnames=("config",), donate_argnames=("state",))
blank = jax.jit(_blank, static_argnames=("config",))
