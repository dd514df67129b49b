"""What every draft-head kind shares: its settings' base class, its loss settings'
base class, its registry record, and the small layers the kinds build from.

A kind is one file in this package (`eagle.py`, `medusa.py`, ...) that defines a
`HeadConfig` subclass (its own settings and checks), its module, its drafter, its
hub layout, its training objective and that objective's settings (a `LossSettings`
subclass), its growth rule, and one `HeadKind` record;
`specjax/heads/__init__.py` registers each record with `register`. Everything
outside this package looks a kind up here (`kind(name)`, `of(cfg)`), never by
comparing names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.models.config import ModelConfig, RopeScaling
from specjax.models.kv_cache import KVCache
from specjax.models.transformer import Linear
from specjax.validation import is_int

# The target fields a head depends on: a head trained for one target works with
# another only when all of them agree.
TARGET_SHAPE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff")


class HeadConfigError(ValueError):
  """A head's settings are invalid, or a `head_config.json` cannot be read as one."""


@dataclasses.dataclass(frozen=True)
class HeadConfig:
  """What a draft head is, and the target shape it reads: the fields every kind has.

  Each kind subclasses this with its own fields (`MedusaConfig.num_heads`, ...) and
  checks them in `check_settings`; `kind` is the subclass's registered name.

  Attributes:
    target: the `ModelConfig` of the target the head was built for.
    feature_layers: the target layer counts whose features the head reads
      (ascending once checked); `()` means the kind's default.
    d_ff: MLP width of the head's decoder layer(s); 0 means the target's.
  """

  kind: ClassVar[str] = ""

  target: ModelConfig
  feature_layers: tuple[int, ...] = ()
  d_ff: int = 0

  def __post_init__(self):
    n = self.target.n_layers
    layers = self.check_settings(tuple(self.feature_layers))
    if any(not is_int(i) or not 1 <= i <= n for i in layers) or len(set(layers)) != len(layers):
      raise HeadConfigError(
        f"feature_layers must be distinct layer counts in [1, {n}], got {self.feature_layers!r}."
      )
    # Ascending: `forward_cached` returns the layers' features in depth order, whatever
    # order they are asked in, so the config (and every layout written from it) says so.
    object.__setattr__(self, "feature_layers", tuple(sorted(layers)))
    if not is_int(self.d_ff) or self.d_ff < 0:
      raise HeadConfigError(f"d_ff must be an int >= 0 (0: the target's), got {self.d_ff!r}.")

  def check_settings(self, layers: tuple[int, ...]) -> tuple[int, ...]:
    """The kind's own settings checked (HeadConfigError naming the field); returns its
    feature layers, defaulted. Kinds override it."""
    return layers

  def _check_bools(self, *names: str) -> None:
    values = {n: getattr(self, n) for n in names}
    if not all(isinstance(v, bool) for v in values.values()):
      raise HeadConfigError(f"{', '.join(names)} must be bools: {values}.")

  @property
  def block_config(self) -> ModelConfig:
    """The config of the head's own decoder layer: the target's, one layer
    (global attention when the target alternates local and global layers)."""
    local = None if self.target.local_layers is None else ()
    return self.target.replace(n_layers=1, d_ff=self.d_ff or self.target.d_ff, local_layers=local)

  @property
  def target_features(self) -> bool | tuple[int, ...]:
    """What the head reads from the target's calls (`forward_cached`'s `return_hidden`):
    its feature layers, or True for the last layer's."""
    return self.feature_layers or True

  @property
  def num_features(self) -> int:
    """How many D-wide features the head reads per position."""
    return len(self.feature_layers) or 1

  def check_target(self, target: ModelConfig, name: str = "target") -> None:
    """ValueError naming every shape field where `target` differs from the trained one."""
    diffs = [
      f"{field} {getattr(target, field)} (head trained for {getattr(self.target, field)})"
      for field in TARGET_SHAPE_FIELDS
      if getattr(target, field) != getattr(self.target, field)
    ]
    if diffs:
      raise ValueError(f"this {self.kind} head was trained for another {name}: {'; '.join(diffs)}.")

  def moved_to(self, target: ModelConfig, move: Callable[[int], int]) -> HeadConfig:
    """This config for an expanded `target` whose layer count c is now `move(c)`:
    the feature layers move with their layers (kinds with more layer counts extend it)."""
    return dataclasses.replace(
      self, target=target, feature_layers=tuple(move(c) for c in self.feature_layers)
    )

  def to_dict(self) -> dict[str, Any]:
    """The `head_config.json` fields: `kind`, the target's fields, the kind's settings."""
    out = {"kind": self.kind, **dataclasses.asdict(self)}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}

  @staticmethod
  def from_dict(fields: dict[str, Any]) -> HeadConfig:
    """The config `to_dict` wrote (any registered kind), or one a release before the
    per-kind configs wrote (every kind's fields in one record: the other kinds' are
    left out). HeadConfigError naming what does not fit."""
    if not isinstance(fields, dict) or not isinstance(fields.get("kind"), str):
      raise HeadConfigError("a head config needs a string field 'kind'.")
    fields = dict(fields)
    cls = kind(fields.pop("kind")).config
    target = fields.pop("target", None)
    if not isinstance(target, dict):
      raise HeadConfigError("a head config needs a 'target' object (the target's ModelConfig).")
    target = dict(target)
    if target.get("rope_scaling"):
      target["rope_scaling"] = RopeScaling(**target["rope_scaling"])
    own = {f.name for f in dataclasses.fields(cls)}
    settings = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
    settings = {k: v for k, v in settings.items() if k in own or k not in LEGACY_FIELDS}
    try:
      target = ModelConfig(**target)
    except TypeError as e:
      raise HeadConfigError(f"not a {cls.kind} head config: {e}") from e
    return config(cls.kind, target, **settings)


# The fields of the one record every kind shared before the per-kind configs (2026-12):
# such files still load, each kind taking its own.
LEGACY_FIELDS = frozenset({
  "num_heads", "exit_layer", "feature_layers", "d_ff", "draft_vocab_size", "draft_ids",
  "normed_features", "embed_first", "input_norm", "medusa_layers", "block_size",
  "draft_layers", "mask_token_id",
})  # fmt: skip


@dataclasses.dataclass(frozen=True)
class LossSettings:
  """A kind's training-objective settings beyond the divergence (`config.head`'s loss
  weights, EAGLE's feature noise, ...), its objective's `settings`. Frozen and hashable:
  the trainer's jitted step takes them as a static argument.

  This base holds none: it is the settings of a kind without any (Medusa's). A kind with
  some subclasses it in its own file (`EagleLoss`, `DFlashLoss`, ...), with its fields,
  its defaults and `from_config`, and names the subclass in `TrainingRules.loss`.
  """

  @property
  def keyed(self) -> bool:
    """Whether the objective draws from a PRNG key in training (EAGLE's feature noise,
    the block drafters' anchors): the trainer makes one per step only then."""
    return False

  @classmethod
  def from_config(cls, head) -> LossSettings:
    """The settings `head` (a run's `config.head`) gives, the defaults for the fields it
    lacks; the run's checks (`TrainingRules.check`) have already passed."""
    del head  # the base has no fields
    return cls()


@dataclasses.dataclass(frozen=True)
class TrainingRules:
  """How `config.head` of a head-training run becomes a kind's config and loss.

  Attributes:
    fields: the kind's config fields read from `config.head` (when present).
    check: `(config) -> None`: the kind's checks of the run's config that need no
      target; ValueError naming `config.head.<field>`.
    loss: the kind's `LossSettings` subclass (the base for a kind without settings):
      `loss.from_config(config.head)` gives a run's, `loss()` the defaults.
    prepare: `(cfg, saved, tokens) -> cfg`: fills what the data decides (EAGLE-3's
      draft ids) from `saved`, the head config a resumed run saved (None for a fresh
      run), or from the training split's `tokens` (None: not read yet); None leaves
      the config as it is.
    warm_start: `(head, target, config.head, load) -> head` when `config.head.warm_start`
      asks for one; `load(where, kind, target)` reads a head it starts from
      (`specjax.training.heads.load_head_from`).
  """

  fields: tuple[str, ...] = ()
  check: Callable | None = None
  loss: type[LossSettings] = LossSettings
  prepare: Callable | None = None
  warm_start: Callable | None = None


@dataclasses.dataclass(frozen=True)
class HeadKind:
  """One kind of draft head, everything the rest of specjax asks of it.

  Attributes:
    name: the kind's name (config and flag values, `head_config.json`'s `kind`).
    title: how tables and reports name it ("EAGLE head").
    config: its `HeadConfig` subclass.
    make: `(cfg, rngs) -> module`: a fresh head of `cfg`.
    drafter: the drafter class, called as `drafter(target, head)`.
    holds: the drafter's attribute that holds the module (`module_of`).
    objective: `(head, target, batch, key, *, loss, settings) -> (loss, metrics)`,
      its training objective (`specjax.training.heads.objective`); `settings` is an
      instance of `training.loss`; `key` a PRNG key in training where `settings.keyed`,
      else None (and always None in evaluation).
    hub: its published layout (`specjax.heads.hub.HubLayout`), or None.
    read_priority: the order `specjax.hf.load_head` tries hub layouts (lower first:
      the most specific layouts first).
    training: `TrainingRules` of its config section (`config.head`).
    expansion_axes: `path -> (plan, letters) | None`: how each of its parameters
      outside `block` grows with the target (plan "target" or "block": the widths it
      follows; `specjax.models.expand.expand_head`); None: the default rules of fc,
      fuse and residual heads.
    dynamic_trees: what its drafter's per-row dynamic trees (`trees.DynamicTree`) are
      called in tables ("EAGLE-2"), or "" where it drafts none. Its other defaults
      (draft length, block size, tree depth) are its drafter's (`Drafter`).
    drafts_as: the launchers' `config.drafter` value that drafts with it.
    bundled: whether `specjax/pretrained/stdlib_pair/heads/<name>/` holds one.
  """

  name: str
  title: str
  config: type
  make: Callable
  drafter: type
  holds: str
  objective: Callable
  hub: Any = None  # a `specjax.heads.hub.HubLayout`
  read_priority: int = 0
  training: TrainingRules = TrainingRules()
  expansion_axes: Callable | None = None
  dynamic_trees: str = ""
  drafts_as: str = ""
  bundled: bool = True

  def __post_init__(self):
    if self.config.kind != self.name:
      raise ValueError(f"kind {self.name!r}: its config class says kind {self.config.kind!r}.")
    object.__setattr__(self, "drafts_as", self.drafts_as or self.name)


_REGISTRY: dict[str, HeadKind] = {}


def register(record: HeadKind) -> HeadKind:
  """Adds `record` to the kinds (`specjax/heads/__init__.py` registers the built-in
  ones; a user's kind registers itself the same way). ValueError for a taken name."""
  if record.name in _REGISTRY and _REGISTRY[record.name] is not record:
    raise ValueError(f"a head kind named {record.name!r} is already registered.")
  _REGISTRY[record.name] = record
  return record


def unregister(name: str) -> None:
  """Removes kind `name` (a test's toy kind)."""
  _REGISTRY.pop(name, None)


def kinds() -> tuple[HeadKind, ...]:
  """Every registered kind, in registration order."""
  return tuple(_REGISTRY.values())


def kind(name: str) -> HeadKind:
  """The record of head kind `name`; HeadConfigError naming the kinds for another."""
  if name not in _REGISTRY:
    raise HeadConfigError(f"head kind must be one of {tuple(_REGISTRY)}, got {name!r}.")
  return _REGISTRY[name]


_record = kind


def of(cfg: HeadConfig) -> HeadKind:
  """The record of `cfg`'s kind."""
  return kind(cfg.kind)


def config(kind: str, target: ModelConfig, **settings) -> HeadConfig:
  """The settings of a head of `kind` on `target` (its `HeadConfig` subclass);
  HeadConfigError naming a setting the kind lacks or a value out of its range."""
  cls = _record(kind).config  # `kind` names the kind here, not the lookup
  own = {f.name for f in dataclasses.fields(cls)}
  extra = sorted(set(settings) - own)
  if extra:
    raise HeadConfigError(f"a {kind} head has no settings {extra}; its settings: {sorted(own)}.")
  return cls(target=target, **settings)


def make_head(cfg: HeadConfig, *, rngs: nnx.Rngs) -> nnx.Module:
  """A fresh head of `cfg`'s kind."""
  return of(cfg).make(cfg, rngs=rngs)


def abstract_head(cfg: HeadConfig, name: str = "float32"):
  """`(graphdef, abstract state)` of the head of `cfg` in dtype `name`, with no
  parameters made (the readers fill them)."""
  cfg = dataclasses.replace(cfg, target=cfg.target.replace(dtype=name, param_dtype=name))
  return nnx.split(nnx.eval_shape(lambda: make_head(cfg, rngs=nnx.Rngs(0))))


def linear(cfg: ModelConfig, d_in: int, d_out: int, *, rngs: nnx.Rngs, zero=False, bias=True):
  """A head's `Linear` in `cfg`'s dtypes (zero-initialised with `zero`)."""
  init = nnx.initializers.zeros if zero else nnx.initializers.normal(cfg.init_std)
  return Linear(
    d_in,
    d_out,
    use_bias=bias,
    kernel_init=nnx.with_partitioning(init, (None, "embed"), eager_sharding=False),
    dtype=cfg.compute_dtype,
    param_dtype=cfg.weight_dtype,
    rngs=rngs,
  )


def one_layer_cache(cfg: HeadConfig, batch: int, capacity: int) -> KVCache:
  """An empty KV cache `[B, K, S, H]` for a head's one decoder layer (`cfg.block_config`)."""
  c = cfg.block_config
  return KVCache.zeros(
    n_layers=1,
    batch=batch,
    capacity=capacity,
    n_kv_heads=c.n_kv_heads,
    head_dim=c.resolved_head_dim,
    dtype=c.compute_dtype,
  )


class Identity(nnx.Module):
  def __call__(self, x):
    return x


def own_logits(x: jax.Array, vocab_subset: jax.Array | None) -> jax.Array:
  """Logits `x [..., V]` as float32, -inf off `vocab_subset` (FR-Spec) when given."""
  x = x.astype(jnp.float32)
  if vocab_subset is None:
    return x
  return jnp.where(jnp.zeros(x.shape[-1], bool).at[vocab_subset].set(True), x, -jnp.inf)
