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

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from specjax import compiler_options, constraints, heads
from specjax.aot import place
from specjax.distributed.mesh import DATA, LOGICAL_RULES, MODEL
from specjax.drafting.model import as_drafter
from specjax.drafting.ngram import NGramDrafter
from specjax.drafting.tree import TreeDrafter
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import cache_capacity
from specjax.models.transformer import Transformer
from specjax.sampling import GREEDY, RowSampling, SamplingParams

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


def _prompt_len(context: int) -> int:
  return context // 2


def _budget(context: int, gamma: int | None) -> int:
  """max_new_tokens that fill a cache of `context` slots after the prompt."""
  budget = context - _prompt_len(context) - (0 if gamma is None else gamma + 1)
  if budget < 1:
    raise ValueError(
      f"context {context} leaves no new tokens after a {_prompt_len(context)}-token prompt"
      + ("" if gamma is None else f" and gamma + 1 = {gamma + 1} verification slots")
      + "; give a larger context."
    )
  return budget


def _batch(mesh: Mesh, batch: int, context: int):
  """Abstract `(prompts [B, P], prompt_lengths [B], key)` on `mesh`."""
  width = _prompt_len(context)
  return (
    place.array((batch, width), jnp.int32, mesh),
    place.array((batch,), jnp.int32, mesh),
    place.key(mesh),
  )


# ------------------------------------------------------------------- generation


def _autoregressive(model, mesh, batch, context, sampling, rules=None) -> jax.stages.Lowered:
  from specjax.generation.autoregressive import _autoregressive_program

  prompts, lengths, key = _batch(mesh, batch, context)
  budget = _budget(context, None)
  return _autoregressive_program.lower(
    model,
    prompts,
    lengths,
    key,
    None,
    rules,
    sampling=sampling,
    max_new_tokens=budget,
    eos_id=None,
    pad_id=0,
    capacity=cache_capacity(prompts.shape[1], budget),
    loop="while",
    loop_chunk=8,
  )


def _speculative(
  target, drafter, mesh, batch, context, gamma, sampling, rules=None
) -> jax.stages.Lowered:
  """`speculative_generate`'s program for `drafter` (a draft model or any drafter)."""
  from specjax.generation.speculative import _checked_run, _speculative_program

  prompts, lengths, key = _batch(mesh, batch, context)
  width = prompts.shape[1]
  # The checks run on concrete host arrays of the batch's shape (they read shapes only).
  drafter, config = _checked_run(
    target,
    drafter,
    np.zeros(prompts.shape, np.int32),
    np.full(lengths.shape, width, np.int32),
    gamma=gamma,
    max_new_tokens=_budget(context, gamma),
    sampling=sampling,
    eos_id=None,
    verifier="auto",
    pad_id=0,
    adaptive=None,
    confidence_threshold=0.5,
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


def _head_program(kind: str) -> Callable:
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


# ---------------------------------------------------------------------- serving


def _engine_step(models: Models, mesh: Mesh, batch: int, context: int, gamma: int, plain: bool):
  """The serving engine's step program on `batch` slots of `context` positions,
  as `Engine(target, draft, EngineConfig(mesh=mesh.shape, slots=batch, ...))`
  builds and `Engine.lowered_step` lowers it, from the abstract models.

  The engine itself cannot take abstract models: its constructor places them
  with `jax.device_put` on a mesh of this host's devices and allocates its batch
  (`slots.blank`). So its settings are built here as the constructor builds them
  (`fit_config`, `SlotConfig`) and the blank batch is shapes only (`jax.eval_shape`),
  placed by `serving.mesh.slot_shardings` as the engine keeps it."""
  from specjax.generation.state import SpecConfig
  from specjax.serving import mesh as serving_mesh
  from specjax.serving import slots
  from specjax.serving.config import EngineConfig, fit_config
  from specjax.validation import check_eos_ids

  if models.draft is None and not plain:
    raise ValueError("engine_step drafts with the draft model: build_models(..., draft_cfg, ...).")
  width = _prompt_len(context)
  config = EngineConfig(
    slots=batch,
    gamma=gamma,
    prompt_buckets=(width,),
    max_new_tokens=_budget(context, gamma),
    widths=(batch,),
    mesh=(mesh.shape[DATA], mesh.shape[MODEL]),
    # Without a draft model, an engine of plain decoding (`Engine(target, None, ...)`).
    **({"policy": "never"} if models.draft is None else {}),
  )
  # The engine's placement (`serving.mesh.place_models`): its default vocab placement
  # copies the embedding and the LM head to every device; the drafter as built.
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
  replicated = PartitionSpec()

  def host(shape, dtype):
    return place.array(shape, dtype, mesh, replicated)

  b = config.slots
  # Shapes only: under the target's mesh nothing may run on this host's devices.
  sampling = place.abstract_tree(jax.eval_shape(lambda: RowSampling.of(GREEDY, b)), mesh)
  state = jax.eval_shape(
    lambda *args: slots._blank(*args, config=slot_config),
    target,
    drafter,
    host((b, 1), jnp.int32),
    host((b,), jnp.int32),
    host((b,), jnp.int32),
    host((b,), jnp.int32),
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


# --------------------------------------------------------------------- training


def train_config(kind: str = TRAIN_KIND):
  """The head-training config of `kind`: the repository's `configs/train_<kind>.py`
  where this is a source checkout, else `head_base_config(kind)`."""
  import importlib.util
  import os

  from specjax.training.config import head_base_config

  path = os.path.join(os.path.dirname(__file__), "..", "..", "configs", f"train_{kind}.py")
  if not os.path.exists(path):
    return head_base_config(kind)
  spec = importlib.util.spec_from_file_location(f"_train_{kind}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def _optimizer_state(optimizer, params, mesh: Mesh):
  """`optimizer.init(params)` as shapes, placed as a real run's: each moment where
  its parameter lives (`zeros_like` keeps a parameter's sharding), the rest (step
  counts) replicated. `jax.eval_shape` alone leaves them unplaced."""
  where = {
    jax.tree_util.keystr(path): (leaf.shape, leaf.sharding)
    for path, leaf in jax.tree_util.tree_leaves_with_path(params)
  }

  def one(path, leaf):
    name = jax.tree_util.keystr(path)
    # An optax state's path ends with its parameter's: `[1][0].mu['fc']['kernel'].value`.
    found = [s for p, (shape, s) in where.items() if name.endswith(p) and shape == leaf.shape]
    sharding = found[0] if found else NamedSharding(mesh, PartitionSpec())
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

  return jax.tree_util.tree_map_with_path(one, jax.eval_shape(optimizer.init, params))


def train_step(models: Models, mesh: Mesh, batch: int, context: int, gamma: int = 4, **_):
  """One optimizer step of training the `TRAIN_KIND` head (`trainer.train_step`:
  the objective's gradient and the AdamW update) on `[batch, context]` token
  windows (`context - 1` inputs), the frozen target as its teacher. As
  `trainer.train` places them, the head's parameters and optimizer state
  follow the logical-axis rules (not replicated) and the windows' rows are split
  over `data`; the teacher is the abstract target in its own dtype (a real run
  loads it in float32). `gamma` is unused."""
  from specjax.training import heads as head_training
  from specjax.training import trainer
  from specjax.training.optimizer import make_optimizer

  config = train_config(TRAIN_KIND)
  head = place.place_module(models.head(TRAIN_KIND), mesh)
  graphdef, params = nnx.split(head, nnx.Param)
  optimizer = make_optimizer(config)
  opt_state = _optimizer_state(optimizer, params, mesh)
  head_loss = head_training.HeadLoss.from_config(config)
  keyed = head_loss.feature_noise > 0 or head_loss.num_anchors > 0
  return trainer.train_step.lower(
    params,
    opt_state,
    place.array((batch, context), jnp.int32, mesh),
    models.target,
    place.key(mesh) if keyed else None,
    graphdef=graphdef,
    optimizer=optimizer,
    loss=config.loss,
    ce_weight=config.ce_weight,
    head=head_loss,
  )


def train_target(models: Models, mesh: Mesh, batch: int, context: int, gamma: int = 4, **_):
  """One optimizer step of training the target itself (`trainer.train_step` with
  configs/train_target.py's optimizer: next-token cross-entropy, AdamW) on
  `[batch, context]` token windows: what `experiments.train
  --config=configs/train_target.py` runs per step, its parameters and optimizer
  state placed by the logical-axis rules and the windows' rows split over
  `data`. `gamma` is unused."""
  from specjax.training import trainer
  from specjax.training.optimizer import make_optimizer

  config = train_config("target")
  graphdef, params = nnx.split(models.target, nnx.Param)
  optimizer = make_optimizer(config)
  return trainer.train_step.lower(
    params,
    _optimizer_state(optimizer, params, mesh),
    place.array((batch, context), jnp.int32, mesh),
    graphdef=graphdef,
    optimizer=optimizer,
  )


# ------------------------------------------------------------------ the registry

PROGRAMS: dict[str, Callable[..., jax.stages.Lowered]] = {
  "plain": plain,
  "draft_model": draft_model,
  **{kind: _head_program(kind) for kind in heads.names()},
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
