"""The serving engine's slot programs, lowered on a target's mesh (`slots.step`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from specjax.aot import place
from specjax.aot.models import Models, budget, prompt_len
from specjax.distributed.mesh import DATA, LOGICAL_RULES, MODEL
from specjax.drafting.model import as_drafter
from specjax.models.kv_cache import cache_capacity
from specjax.sampling import GREEDY, RowSampling

# ---------------------------------------------------------------------- serving


def _engine_configs(models: Models, mesh: Mesh, batch: int, context: int, gamma: int):
  """`(config, slot_config, target, drafter)` as `Engine.__init__` builds them for
  `batch` slots of `context` positions: the engine's settings (`fit_config`), its
  slot programs' (`SlotConfig`), the target placed as the engine places it (its
  default vocab placement copies the embedding and the LM head to every device)
  and the drafter."""
  from specjax.generation.state import SpecConfig
  from specjax.serving import slots
  from specjax.serving.config import EngineConfig, fit_config
  from specjax.validation import check_eos_ids

  config = EngineConfig(
    slots=batch,
    gamma=gamma,
    prompt_buckets=(prompt_len(context),),
    max_new_tokens=budget(context, gamma),
    widths=(batch,),
    mesh=(mesh.shape[DATA], mesh.shape[MODEL]),
    # Without a draft model, an engine of plain decoding (`Engine(target, None, ...)`).
    **({"policy": "never"} if models.draft is None else {}),
  )
  rules = LOGICAL_RULES if config.vocab_placement == "shard" else {**LOGICAL_RULES, "vocab": None}
  target = place.place_module(models.target, mesh, rules)
  drafter = None if models.draft is None else as_drafter(models.draft)
  config = fit_config(config, target, drafter)
  spec = SpecConfig(
    gamma=config.gamma,
    max_new_tokens=config.max_new_tokens,
    sampling=None,
    verifier="coupled",
    coupled=True,
    eos_id=check_eos_ids("eos_ids", None, target.cfg.vocab_size),
    forced_drafts=config.forced_drafts,
  )
  slot_config = slots.SlotConfig(
    spec=spec,
    capacity=cache_capacity(config.max_prompt_len, config.max_new_tokens, config.gamma),
    max_prompt_len=config.max_prompt_len,
    logprobs=config.logprobs,
    mesh=mesh,
  )
  return config, slot_config, target, drafter


def _engine_step(models: Models, mesh: Mesh, batch: int, context: int, gamma: int, plain: bool):
  """The serving engine's step program on `batch` slots of `context` positions,
  as `Engine(target, draft, EngineConfig(mesh=mesh.shape, slots=batch, ...))`
  builds and `Engine.lowered_step` lowers it, from the abstract models.

  The engine itself cannot take abstract models: its constructor places them
  with `jax.device_put` on a mesh of this host's devices and allocates its batch
  (`slots.blank`). So its settings are built here as the constructor builds them
  (`_engine_configs`) and the blank batch is shapes only (`jax.eval_shape`),
  placed by `serving.mesh.slot_shardings` as the engine keeps it."""
  from specjax.serving import mesh as serving_mesh
  from specjax.serving import slots

  if models.draft is None and not plain:
    raise ValueError("engine_step drafts with the draft model: build_models(..., draft_cfg, ...).")
  config, slot_config, target, drafter = _engine_configs(models, mesh, batch, context, gamma)

  def host(shape, dtype):
    return place.array(shape, dtype, mesh, PartitionSpec())

  b = config.slots
  # Shapes only: under the target's mesh nothing may run on this host's devices.
  sampling = place.abstract_tree(jax.eval_shape(lambda: RowSampling.of(GREEDY, b)), mesh)
  rows = [host((b, 1), jnp.int32)] + [host((b,), jnp.int32)] * 3
  state = jax.eval_shape(
    lambda *args: slots._blank(*args, config=slot_config),
    target,
    drafter,
    *rows,
    sampling,
    place.key(mesh),
  )
  shardings = serving_mesh.slot_shardings(state, mesh, b)
  state = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
  )
  return slots.step.lower(
    target,
    None if plain else drafter,
    state,
    place.key(mesh),
    host((), jnp.bool_),
    None,
    gamma=0 if plain else config.gamma,
    width=b,
    config=slot_config,
    verify=None,
  )


def engine_step(models: Models, mesh: Mesh, batch: int, context: int, gamma: int = 4, **_):
  """The serving engine's drafting step (draft model, draft length `gamma`) on
  `batch` slots: `Engine.lowered_step(gamma)`."""
  return _engine_step(models, mesh, batch, context, gamma, plain=False)


def engine_plain_step(models: Models, mesh: Mesh, batch: int, context: int, gamma: int = 4, **_):
  """The serving engine's plain step (one token per row, no drafter call) on
  `batch` slots: `Engine.lowered_step(0)`. With a draft model, the step of an
  engine that also drafts (its batch carries the drafter's state, and `gamma`
  sizes the slots' verification slack); without one, of a plain engine."""
  return _engine_step(models, mesh, batch, context, gamma, plain=True)
