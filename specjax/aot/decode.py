"""The decode programs, lowered: plain, speculative with each drafter, trees, constraints.

Each is the jitted function `autoregressive_generate` / `speculative_generate`
calls (`_autoregressive_program`, `_speculative_program`) on abstract arguments
(`specjax.aot.models`); `specjax.aot.programs` names them.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from specjax import constraints, heads
from specjax.aot import place
from specjax.aot.models import CONSTRAINT_STATES, SAMPLING, Models, batch_arrays, budget
from specjax.drafting.ngram import NGramDrafter
from specjax.drafting.tree import TreeDrafter
from specjax.models.kv_cache import cache_capacity

# ------------------------------------------------------------------- generation


def _autoregressive(model, mesh, batch, context, sampling, rules=None) -> jax.stages.Lowered:
  from specjax.generation.autoregressive import _autoregressive_program

  prompts, lengths, key = batch_arrays(mesh, batch, context)
  new_tokens = budget(context, None)
  return _autoregressive_program.lower(
    model,
    prompts,
    lengths,
    key,
    None,
    rules,
    sampling=sampling,
    max_new_tokens=new_tokens,
    eos_id=None,
    pad_id=0,
    capacity=cache_capacity(prompts.shape[1], new_tokens),
    loop="while",
    loop_chunk=8,
  )


def _speculative(
  target, drafter, mesh, batch, context, gamma, sampling, rules=None
) -> jax.stages.Lowered:
  """`speculative_generate`'s program for `drafter` (a draft model or any drafter)."""
  from specjax.bench.compile import speculative_config
  from specjax.generation.speculative import _speculative_program

  prompts, lengths, key = batch_arrays(mesh, batch, context)
  drafter, config = speculative_config(
    target, drafter, batch, prompts.shape[1], budget(context, gamma), gamma, sampling=sampling
  )
  return _speculative_program.lower(
    target, drafter, prompts, lengths, key, None, rules, config=config
  )


def plain(
  models: Models, mesh: Mesh, batch: int, context: int, gamma: int = 4, *, sampling=SAMPLING
):
  """Autoregressive decoding (`autoregressive_generate`); `gamma` is unused."""
  return _autoregressive(models.target, mesh, batch, context, sampling)


def draft_model(
  models: Models, mesh: Mesh, batch: int, context: int, gamma: int = 4, *, sampling=SAMPLING
):
  """Speculative decoding with the draft model (`ModelDrafter`)."""
  if models.draft is None:
    raise ValueError("draft_model needs a draft model: build_models(target_cfg, draft_cfg, ...).")
  return _speculative(models.target, models.draft, mesh, batch, context, gamma, sampling)


def head_program(kind: str) -> Callable:
  def program(
    models: Models, mesh: Mesh, batch: int, context: int, gamma: int = 4, *, sampling=SAMPLING
  ):
    drafter = heads.drafter(models.target, models.head(kind))
    return _speculative(models.target, drafter, mesh, batch, context, gamma, sampling)

  program.__name__ = kind
  program.__doc__ = f"Speculative decoding with the {heads.kind(kind).title} (`heads.drafter`)."
  return program


def prompt_lookup(
  models: Models, mesh: Mesh, batch: int, context: int, gamma: int = 4, *, sampling=SAMPLING
):
  """Speculative decoding with prompt lookup (`NGramDrafter`, n-grams of 1 to 3)."""
  drafter = NGramDrafter(vocab_size=models.target.cfg.vocab_size)
  return _speculative(models.target, drafter, mesh, batch, context, gamma, sampling)


def tree_parents(nodes: int) -> tuple[int, ...]:
  """A token tree of `nodes` nodes, breadth-first: two children at the root, the
  first of them extended as a chain (`(-1, -1, 0, 2, ...)`; one node: `(-1,)`)."""
  if nodes <= 2:
    return (-1,) * nodes
  return (-1, -1, 0) + tuple(range(2, nodes - 1))


def tree(
  models: Models, mesh: Mesh, batch: int, context: int, gamma: int = 4, *, sampling=SAMPLING
):
  """Token-tree verification with the draft model drafting a tree of `gamma` nodes
  (`TreeDrafter`, `tree_parents(gamma)`)."""
  if models.draft is None:
    raise ValueError("tree needs a draft model: build_models(target_cfg, draft_cfg, ...).")
  drafter = TreeDrafter(models.draft, tree_parents(gamma))
  return _speculative(models.target, drafter, mesh, batch, context, gamma, sampling)


def abstract_constraints(vocab_size: int, batch: int, mesh: Mesh, states: int = CONSTRAINT_STATES):
  """An abstract `RowConstraints` of `batch` rows over `vocab_size` ids: the table a
  regex or JSON schema of up to `states` states compiles to (`row_constraints`'s
  layout: dense while it fits `DENSE_LIMIT_BYTES`, else by token class, `states`
  classes), replicated on `mesh` as a real run's table is."""
  dense = states * vocab_size * 4 <= constraints.DENSE_LIMIT_BYTES
  width = vocab_size if dense else states
  table = constraints.ConstraintTable(
    next_state=jax.ShapeDtypeStruct((states, width), jnp.int32),
    token_class=None if dense else jax.ShapeDtypeStruct((vocab_size,), jnp.int32),
    forced=jax.ShapeDtypeStruct((states,), jnp.int32),
  )
  rules = constraints.RowConstraints(table, jax.ShapeDtypeStruct((batch,), jnp.int32))
  return place.abstract_tree(rules, mesh)


def constrained(
  models: Models, mesh: Mesh, batch: int, context: int, gamma: int = 4, *, sampling=SAMPLING
):
  """Constrained decoding (a regex / JSON schema table, `abstract_constraints`):
  speculative with the draft model, autoregressive without one."""
  rules = abstract_constraints(models.target.cfg.vocab_size, batch, mesh)
  if models.draft is None:
    return _autoregressive(models.target, mesh, batch, context, sampling, rules)
  return _speculative(models.target, models.draft, mesh, batch, context, gamma, sampling, rules)
