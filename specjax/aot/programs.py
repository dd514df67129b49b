"""Every program a user runs, lowered for a target this host does not have.

  mesh = targets.get("v5e:2x2").mesh((1, 4))
  models = programs.build_models(target_cfg, draft_cfg, mesh)
  lowered = programs.lower("eagle", models, mesh, batch=8, context=2048)
  compiled = lowered.compile()           # the target's compiler, no device

Each program is the jitted function the library itself calls (`_autoregressive_program`,
`_speculative_program`, the serving engine's `slots.step`, the trainer's `train_step`),
lowered on abstract arguments placed on `mesh` (`specjax.aot.place`): the target's
parameters by the logical-axis rules, small drafters replicated, the batch's rows over
`data`. Nothing is allocated, so a 70B-shaped program lowers on a laptop. `PROGRAMS`
names them in the order reports list them; `lower(name, ...)` lowers one.

Shapes: `context` is a row's KV-cache capacity, the same for every program: the prompt
is `context // 2` tokens wide and the budget what the rest leaves (a drafting program
keeps `gamma + 1` slots of it for its verification block, `cache_capacity`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import Mesh

from specjax import compiler_options, heads
from specjax.aot.decode import constrained, draft_model, head_program, plain, prompt_lookup, tree
from specjax.aot.models import SAMPLING, Models, build_models
from specjax.aot.serving import engine_plain_step, engine_step
from specjax.aot.training import train_step, train_target

__all__ = ["PROGRAMS", "SAMPLING", "Models", "build_models", "lower"]

# ------------------------------------------------------------------ the registry

PROGRAMS: dict[str, Callable[..., jax.stages.Lowered]] = {
  "plain": plain,
  "draft_model": draft_model,
  **{kind: head_program(kind) for kind in heads.names()},
  "prompt_lookup": prompt_lookup,
  "tree": tree,
  "constrained": constrained,
  "engine_step": engine_step,
  "engine_plain_step": engine_plain_step,
  "train_step": train_step,
  "train_target": train_target,
}


def lower(
  name: str,
  models: Models,
  mesh: Mesh,
  batch: int,
  context: int,
  gamma: int = 4,
  **options,
) -> jax.stages.Lowered:
  """Program `name` of `PROGRAMS` lowered for `mesh`'s devices (inside
  `jax.set_mesh(mesh)`, traced for their platform: `compiler_options.target_platform`).

  Args:
    batch: rows (a multiple of the mesh's `data` size splits them over it).
    context: each row's KV-cache capacity: a `context // 2`-token prompt and the
      new tokens the rest leaves.
    gamma: the draft length (a tree drafter's nodes).
    options: the decode programs' `sampling` (default `SAMPLING`).

  Raises:
    ValueError: an unknown `name` (naming the programs), or a program these models
      cannot run (no draft model, a head kind not built).
  """
  if name not in PROGRAMS:
    raise ValueError(f"unknown program {name!r}; the programs: {', '.join(PROGRAMS)}.")
  limit = models.target.cfg.max_seq_len
  if not 2 <= context <= limit:
    raise ValueError(f"context must be in [2, the target's max_seq_len={limit}], got {context}.")
  platform = next(iter(mesh.devices.flat)).platform
  with jax.set_mesh(mesh), compiler_options.target_platform(platform):
    return PROGRAMS[name](models, mesh, batch, context, gamma, **options)
