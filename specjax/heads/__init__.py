"""Draft heads: one file per kind, one registry record per kind.

  from specjax import heads
  cfg = heads.config("medusa", target.cfg, num_heads=3)   # a MedusaConfig
  head = heads.make_head(cfg, rngs=nnx.Rngs(0))          # its module
  drafter = heads.drafter(target, head)                   # its drafter
  heads.kind("dflash").defaults.gamma                     # anything else a kind is
  heads.module_of(drafter)                                # and back to the module

A kind lives in one file of this package, `specjax/heads/<kind>.py` (or, the block
drafters, a package of their own with a file per concept and the record in its
`__init__`: `specjax/heads/dflash/`, `dspark/`): its settings (a
`HeadConfig` subclass with its own checks), module, drafter, hub layout, training
objective and its settings (a `LossSettings` subclass), growth rule and defaults, and
one `HeadKind` record, `KIND`, registered below. Nothing outside this package names a
kind: `models`, `drafting`, `hf`, `training`, `pretrained` and the jobs ask the record
(`kind(name)`, `of(cfg)`). To add a kind, write its file and register its record
(docs/heads.md, "Adding a kind").

The machinery the kinds share stays kind-free: `base` (the settings' and loss settings'
bases, the record, the registry), `files` (specjax's `head_config.json` and weights, for
every kind) and `hub` (what a hub layout is, and hub names <-> parameters). The package
sits below `training` and `hf`, which import it: the kinds import neither
(tests/test_imports.py).
"""

from __future__ import annotations

import dataclasses

from specjax.heads import dflash, dspark, eagle, eagle3, early_exit, medusa
from specjax.heads.base import (
  HeadConfig,
  HeadConfigError,
  HeadKind,
  LossSettings,
  TrainingRules,
  config,
  kind,
  kinds,
  make_head,
  of,
  register,
  unregister,
)
from specjax.heads.files import CONFIG_FILE, WEIGHTS_FILE, read_config, write_config
from specjax.models.config import ModelConfig

# The built-in kinds, in the order tables and reports list them.
register(eagle.KIND)
register(medusa.KIND)
register(early_exit.KIND)
register(eagle3.KIND)
register(dflash.KIND)
register(dspark.KIND)


def names() -> tuple[str, ...]:
  """The registered kinds' names."""
  return tuple(k.name for k in kinds())


def bundled() -> tuple[str, ...]:
  """The kinds of which `specjax/pretrained` bundles a trained head."""
  return tuple(k.name for k in kinds() if k.bundled)


def drafter(target, head):
  """The drafter of head module `head` (its kind's) drafting for `target`."""
  return of(head.cfg).drafter(target, head)


def module_of(head_or_drafter):
  """The head module of `head_or_drafter`: a head module itself, or a head's drafter
  (what `specjax.hf.load_drafter` and `specjax.pretrained.load_drafter` return), so
  savers accept what either kind of loader gives. TypeError for anything else."""
  if isinstance(getattr(head_or_drafter, "cfg", None), HeadConfig):
    return head_or_drafter
  for k in kinds():
    if isinstance(head_or_drafter, k.drafter):
      return getattr(head_or_drafter, k.holds)
  raise TypeError(
    f"expected a head module or a head's drafter, got {type(head_or_drafter).__name__}."
  )


def expand_head(head, new: HeadConfig | ModelConfig):
  """A draft head for an expanded target (`specjax.models.expand`), predicting through
  it what `head` predicts through the old one.

  Args:
    new: the expanded target's `ModelConfig` (the head's layer counts move with their
      layers: `HeadConfig.moved_to`), or the head's config for it (its block may grow
      further: a larger `d_ff`).

  Raises:
    ValueError: no exact expansion (the field named), or a config that changes the
      kind or a setting other than `d_ff`.
  """
  from specjax.models.expand import check_expansion, expanded_layer_count
  from specjax.models.expand import expand_head as grow

  old = head.cfg
  if not isinstance(new, ModelConfig | HeadConfig):
    raise ValueError(f"new must be a HeadConfig or a ModelConfig, got {type(new).__name__}.")
  target = new if isinstance(new, ModelConfig) else new.target
  check_expansion(old.target, target)
  n_old, n_new = old.target.n_layers, target.n_layers
  moved = old.moved_to(target, lambda c: expanded_layer_count(c, n_old, n_new))
  if isinstance(new, ModelConfig):
    new = moved
  if new.kind != old.kind:
    raise ValueError(f"HeadConfig.kind: the expanded head needs {old.kind!r}, got {new.kind!r}.")
  for field in dataclasses.fields(moved):
    want, got = getattr(moved, field.name), getattr(new, field.name)
    if field.name not in ("target", "d_ff") and got != want:
      raise ValueError(f"HeadConfig.{field.name}: the expanded head needs {want!r}, got {got!r}.")
  record = of(old)
  return grow(head, new, record.make, record.expansion_axes)


__all__ = [
  "CONFIG_FILE",
  "WEIGHTS_FILE",
  "HeadConfig",
  "HeadConfigError",
  "HeadKind",
  "LossSettings",
  "TrainingRules",
  "bundled",
  "config",
  "drafter",
  "expand_head",
  "kind",
  "kinds",
  "make_head",
  "module_of",
  "names",
  "of",
  "read_config",
  "register",
  "unregister",
  "write_config",
]
