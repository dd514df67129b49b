"""The abstract models and batches every program of `specjax.aot.programs` takes.

`build_models` places a target, its draft model and its heads on a target's mesh
as a real run does (`specjax.aot.place`); `prompt_len`, `budget` and
`batch_arrays` give a program's shapes from its context (a row's KV-cache
capacity: a `context // 2`-token prompt and the new tokens the rest leaves).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from specjax import heads
from specjax.aot import place
from specjax.models.config import ModelConfig
from specjax.models.transformer import Transformer
from specjax.sampling import SamplingParams

# The warp the decode programs sample with: temperature 1 (token verification, a
# drafter's sampled proposals), what a sampled run compiles; `lower(sampling=GREEDY)`
# gives the greedy programs.
SAMPLING = SamplingParams(temperature=1.0)
# States of the abstract constraint table (`constraints.row_constraints` pads a
# table's states to a power of two): a JSON schema of a few fields.
CONSTRAINT_STATES = 256
# The head kind `train_step` trains.
TRAIN_KIND = "eagle"


@dataclasses.dataclass(frozen=True)
class Models:
  """The abstract models of a run, placed on one mesh (`build_models`).

  Attributes:
    target: the target `Transformer`, its parameters placed by the logical-axis rules.
    draft: the draft `Transformer` (replicated when `replicate_drafters`), or None.
    heads: kind -> head module of that kind on the target (placed like `draft`).
    head_errors: kind -> why its head could not be built on this target (its
      settings do not fit it: an early exit past the last layer, EAGLE-3's three
      feature layers on a 2-layer target); its program raises that.
    replicate_drafters: whether the drafters are replicated (as
      `shard_model(replicate=True)` places a small draft) or placed by the rules.
  """

  target: Transformer
  draft: Transformer | None
  heads: dict[str, nnx.Module]
  head_errors: dict[str, str] = dataclasses.field(default_factory=dict)
  replicate_drafters: bool = True

  def head(self, kind: str) -> nnx.Module:
    """The head of `kind`; ValueError saying why it was not built."""
    if kind in self.head_errors:
      raise ValueError(f"no {kind} head on this target: {self.head_errors[kind]}")
    if kind not in self.heads:
      raise ValueError(
        f"no {kind} head was built (build_models(kinds=...) built {sorted(self.heads)})."
      )
    return self.heads[kind]


def build_models(
  target_cfg: ModelConfig,
  draft_cfg: ModelConfig | None,
  mesh: Mesh,
  kinds: Sequence[str] | None = None,
  replicate_drafters: bool = True,
  head_settings: dict[str, dict] | None = None,
) -> Models:
  """The abstract target, draft model and heads of `kinds` placed on `mesh`.

  Args:
    target_cfg: any target `ModelConfig` (a scaled preset, a Hugging Face config).
    draft_cfg: the draft model's, or None (then `draft_model` and `tree` cannot lower).
    kinds: the head kinds to build (default: every registered kind), each with
      its kind's default settings on `target_cfg` (`heads.config`) updated by
      `head_settings[kind]`.
    replicate_drafters: place the draft model and the heads on every device
      (what the serving engine and `shard_model(replicate=True)` do for a small
      drafter), else by the rules as the target.
  """
  kinds = heads.names() if kinds is None else tuple(kinds)
  settings = head_settings or {}
  target = place.abstract_on(Transformer, mesh, cfg=target_cfg)
  draft = None
  if draft_cfg is not None:
    draft = place.abstract_on(Transformer, mesh, replicate=replicate_drafters, cfg=draft_cfg)
  built, errors = {}, {}
  for kind in kinds:
    try:
      cfg = heads.config(kind, target_cfg, **settings.get(kind, {}))
    except heads.HeadConfigError as e:  # one kind's settings; the others still build
      errors[kind] = f"{e} (set head_settings[{kind!r}])"
      continue
    built[kind] = place.abstract_on(heads.make_head, mesh, replicate=replicate_drafters, cfg=cfg)
  return Models(target, draft, built, errors, replicate_drafters)


# ----------------------------------------------------------------------- shapes


def prompt_len(context: int) -> int:
  return context // 2


def budget(context: int, gamma: int | None) -> int:
  """max_new_tokens that fill a cache of `context` slots after the prompt."""
  budget = context - prompt_len(context) - (0 if gamma is None else gamma + 1)
  if budget < 1:
    raise ValueError(
      f"context {context} leaves no new tokens after a {prompt_len(context)}-token prompt"
      + ("" if gamma is None else f" and gamma + 1 = {gamma + 1} verification slots")
      + "; give a larger context."
    )
  return budget


def batch_arrays(mesh: Mesh, batch: int, context: int):
  """Abstract `(prompts [B, P], prompt_lengths [B], key)` on `mesh`."""
  width = prompt_len(context)
  return (
    place.array((batch, width), jnp.int32, mesh),
    place.array((batch,), jnp.int32, mesh),
    place.key(mesh),
  )
