"""The engine on a mesh: checking a mesh shape, placing the models and the slots.

  check_shape      an `EngineConfig.mesh` value, checked before anything compiles
  build_mesh       the `(data, model)` mesh of that shape over the devices, or a
                   ValueError naming `mesh` and the devices there are
  place_models     the target sharded by the logical-axis rules; the drafter's
                   modules sharded too, or replicated (a small draft then drafts
                   with no communication)
  slot_shardings   where each leaf of the engine's batch lives: rows over `data`,
                   KV caches' kv heads over `model`, batch-wide leaves replicated
  row_order        the order slots fill in, so that each step's rows are spread
                   evenly over the `data` devices

Why a row order: a step at width W < B runs on W of the B slots. On one device
those are the first W rows. With the rows split into D blocks over `data`, the
first W rows would all sit on the first devices, and slicing them out would move
their caches between devices each step. Instead the engine fills slots block by
block in turn (slot 0 of every block, then slot 1, ...), and a step at width W
takes the first W / D rows of every block (`specjax.serving.rows.prefix`): a local
slice on each device. Widths are therefore multiples of D.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from specjax.distributed import make_mesh, named_sharding, resolve_shape, shard_model
from specjax.distributed.mesh import DATA, LOGICAL_RULES
from specjax.models.kv_cache import CACHE_AXES, STACKED_CACHE_AXES, KVCache
from specjax.validation import is_int

DRAFT_PLACEMENTS = ("replicate", "shard")
VOCAB_PLACEMENTS = ("replicate", "shard")


def check_shape(shape) -> tuple[int, int] | None:
  """`EngineConfig.mesh` as a tuple: None (one device), or `(data, model)` of
  integers >= 1, one of which may be -1 ("the rest of the devices")."""
  if shape is None:
    return None
  shape = tuple(shape) if isinstance(shape, (tuple, list)) else shape
  if (
    not isinstance(shape, tuple)
    or len(shape) != 2
    or not all(is_int(s) and (s >= 1 or s == -1) for s in shape)
    or shape.count(-1) > 1
  ):
    raise ValueError(
      "mesh must be None (one device) or (data, model): two integers >= 1, one of which "
      f"may be -1 for the rest of the devices; got {shape!r}."
    )
  return tuple(int(s) for s in shape)


def resolve(shape: tuple[int, int], num_devices: int | None = None) -> tuple[int, int]:
  """`shape` with -1 filled in from the devices (default: all of JAX's), or a
  ValueError naming `mesh` when it does not fit them."""
  num_devices = jax.device_count() if num_devices is None else num_devices
  try:
    return resolve_shape(shape, num_devices)
  except ValueError as error:
    kinds = sorted({d.platform for d in jax.devices()})
    raise ValueError(
      f"mesh {shape} does not fit this job's {num_devices} {'/'.join(kinds)} device(s): "
      f"{error} Give (data, model) with data * model = {num_devices}, e.g. (1, "
      f"{num_devices}) for tensor parallelism over all of them."
    ) from None


def build_mesh(shape: Sequence[int]) -> Mesh:
  """The `(data, model)` mesh over every device of the job (all processes')."""
  return make_mesh(resolve(tuple(shape)))


def data_size(mesh: Mesh | None) -> int:
  """D, the devices the slots are split over (1 without a mesh)."""
  return 1 if mesh is None else int(mesh.shape[DATA])


def row_order(slots: int, blocks: int) -> tuple[int, ...]:
  """The slots in the order they fill: with `blocks` = D row blocks of B / D
  rows, the first row of each block, then the second, ... (the identity for D = 1).
  The first W of them are the rows a step at width W runs on."""
  per = slots // blocks
  return tuple(b * per + j for j in range(per) for b in range(blocks))


def place_models(
  target, drafter, mesh: Mesh, draft_placement: str = "replicate", vocab: str = "shard"
):
  """`(target, drafter)` on `mesh`: the target's parameters placed by their
  logical axes (`specjax.distributed.shard_model`), every module the drafter
  holds likewise (`draft_placement` "shard") or copied to every device
  ("replicate"); a module that is the target itself (layer skip, a head that
  reads the target's features) becomes the placed target, never a second copy.
  `vocab` "replicate" copies the embedding and the LM head to every device
  instead of splitting their vocabulary over `model`: the logits are then whole
  on each device, and sampling and verification over them run without the
  dozens of small reductions a vocabulary split over devices needs per step.

  Shapes are unchanged; only where the arrays live.
  """
  if vocab not in VOCAB_PLACEMENTS:
    raise ValueError(f"vocab must be one of {', '.join(VOCAB_PLACEMENTS)}, got {vocab!r}.")
  if draft_placement not in DRAFT_PLACEMENTS:
    raise ValueError(
      f"draft_placement must be one of {', '.join(DRAFT_PLACEMENTS)}, got {draft_placement!r}."
    )
  rules = LOGICAL_RULES if vocab == "shard" else {**LOGICAL_RULES, "vocab": None}
  placed = shard_model(target, mesh, rules)
  if drafter is None:
    return placed, None
  replicate = draft_placement == "replicate"

  def place(value):
    if value is target:
      return placed
    if isinstance(value, nnx.Module):
      return shard_model(value, mesh, rules, replicate=replicate)
    return value

  fields = getattr(drafter, "__dataclass_fields__", {})
  changes = {name: place(getattr(drafter, name)) for name in fields}
  changed = {k: v for k, v in changes.items() if v is not getattr(drafter, k)}
  return placed, (drafter.replace(**changed) if changed else drafter)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def replicate(mesh: Mesh, value) -> jax.Array:
  """A host value (identical on every process; a key array too) as one global
  array copied to every device of `mesh`, in a job of one process or many
  (`jax.device_put` takes only this process's devices)."""
  if isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
    return jax.random.wrap_key_data(replicate(mesh, jax.random.key_data(value)))
  host = np.asarray(value)
  return jax.make_array_from_callback(host.shape, replicated(mesh), lambda index: host[index])


def slot_shardings(state, mesh: Mesh, slots: int):
  """A pytree like `state` (the engine's `SlotState`, or any part of it) of
  `NamedSharding`s: each KV cache's k and v by `CACHE_AXES` (rows over `data`,
  kv heads over `model` where it divides them), every other leaf whose leading
  axis has `slots` rows split over `data`, and the rest (keys, step counters)
  replicated."""

  def leaf(x):
    shape = getattr(x, "shape", ())
    if len(shape) >= 1 and shape[0] == slots:
      return named_sharding(mesh, ("batch",) + (None,) * (len(shape) - 1), shape)
    return replicated(mesh)

  def cache(c: KVCache):
    axes = STACKED_CACHE_AXES if c.stacked else CACHE_AXES

    def kv(x):
      return named_sharding(mesh, axes, x.shape)

    return KVCache(k=jax.tree.map(kv, c.k), v=jax.tree.map(kv, c.v), lengths=leaf(c.lengths))

  return jax.tree.map(
    lambda x: cache(x) if isinstance(x, KVCache) else leaf(x),
    state,
    is_leaf=lambda x: isinstance(x, KVCache),
  )


def constrain_slots(state, mesh: Mesh | None, slots: int):
  """`state` pinned to `slot_shardings` inside a program (an identity without a
  mesh): every program hands the batch back where it found it, so the next one
  (donating it) takes it as it is, and nothing recompiles for a new layout."""
  if mesh is None:
    return state
  return jax.lax.with_sharding_constraint(state, slot_shardings(state, mesh, slots))
