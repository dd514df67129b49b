"""Draft heads, one record per kind: what each kind is and which code serves it.

  from specjax import heads
  heads.kind("medusa").drafter        # MedusaDrafter
  [k.name for k in heads.KINDS]       # eagle, medusa, early_exit, eagle3, dflash
  heads.drafter(target, head)         # the drafter of any head module
  heads.module_of(drafter)            # and back: the head module it drafts with

`KINDS` is the one list of kinds; launchers, the bundled loaders (`specjax.pretrained`),
the path loaders (`specjax.hf.heads`), training's config checks and the reproduction look
kinds up here instead of branching on their names. The record refers to code that lives
below this package (modules and their config checks in `specjax.models.heads`, drafters
in `specjax.drafting`), so the imports point down: `models` and `drafting` never import
this package. A head's files in specjax's layout are `CONFIG_FILE` and `WEIGHTS_FILE`,
written and read by `specjax.heads.files` for every kind; its hub layout is
`specjax.hf.heads.HUB_LAYOUTS[name]`, its objective `specjax.training.heads.OBJECTIVES[name]`
(both above this package, tables whose keys are checked against `NAMES`).
"""

from __future__ import annotations

import dataclasses

from specjax.drafting.dflash import DFlashDrafter
from specjax.drafting.eagle import EagleDrafter
from specjax.drafting.early_exit import EarlyExitDrafter
from specjax.drafting.medusa import MedusaDrafter
from specjax.heads.files import CONFIG_FILE, WEIGHTS_FILE
from specjax.models.heads import HEAD_MODULES, HUB_MODULES, HeadConfig, make_head


@dataclasses.dataclass(frozen=True)
class HeadKind:
  """One kind of draft head.

  Attributes:
    name: the kind's name (`HeadConfig.kind`, config and flag values).
    title: how tables and reports name it ("EAGLE head").
    module: the head's module class (`make_head` builds it from a `HeadConfig`,
      whose `__post_init__` checks the kind's settings).
    hub_module: the module with the published layout's own norm and lm_head
      (`HeadConfig.normed_features`), or None where the kind has none.
    drafter: the drafter class, called as `drafter(target, head)`.
    holds: the drafter's attribute that holds the module (`module_of`).
    drafts_as: the launchers' `config.drafter` value that drafts with it.
    bundled: whether `specjax/pretrained/stdlib_pair/heads/<name>/` holds one.
  """

  name: str
  title: str
  module: type
  hub_module: type | None
  drafter: type
  holds: str
  drafts_as: str
  bundled: bool


def _kind(name, title, drafter, holds, *, drafts_as: str = "", bundled: bool = True) -> HeadKind:
  module, hub = HEAD_MODULES[name], HUB_MODULES.get(name)
  return HeadKind(name, title, module, hub, drafter, holds, drafts_as or name, bundled)


KINDS: tuple[HeadKind, ...] = (
  _kind("eagle", "EAGLE head", EagleDrafter, "head"),
  _kind("medusa", "Medusa heads", MedusaDrafter, "heads"),
  _kind("early_exit", "early exit", EarlyExitDrafter, "adapter"),
  # EAGLE-3 drafts through `EagleDrafter` (its own `logits`); none is bundled.
  _kind("eagle3", "EAGLE-3 head", EagleDrafter, "head", drafts_as="eagle", bundled=False),
  _kind("dflash", "block drafter", DFlashDrafter, "head"),
)
NAMES: tuple[str, ...] = tuple(k.name for k in KINDS)
BUNDLED: tuple[str, ...] = tuple(k.name for k in KINDS if k.bundled)
_BY_NAME = {k.name: k for k in KINDS}
if tuple(HEAD_MODULES) != NAMES:  # the modules' table and this list name the same kinds
  raise ImportError(f"specjax.heads.KINDS {NAMES} and HEAD_MODULES {tuple(HEAD_MODULES)} differ.")


def kind(name: str) -> HeadKind:
  """The record of head kind `name`; ValueError naming the kinds for another."""
  if name not in _BY_NAME:
    raise ValueError(f"head kind must be one of {NAMES}, got {name!r}.")
  return _BY_NAME[name]


def drafter(target, head):
  """The drafter of head module `head` (its `cfg.kind`'s) drafting for `target`."""
  return kind(head.cfg.kind).drafter(target, head)


def module_of(head_or_drafter):
  """The head module of `head_or_drafter`: a head module itself, or a head's drafter
  (what `specjax.hf.load_drafter` and `specjax.pretrained.load_drafter` return), so
  savers accept what either kind of loader gives. TypeError for anything else."""
  cfg = getattr(head_or_drafter, "cfg", None)
  if isinstance(cfg, HeadConfig):
    return head_or_drafter
  for k in KINDS:
    if isinstance(head_or_drafter, k.drafter):
      return getattr(head_or_drafter, k.holds)
  raise TypeError(
    f"expected a head module or a head's drafter, got {type(head_or_drafter).__name__}."
  )


__all__ = [
  "BUNDLED",
  "CONFIG_FILE",
  "KINDS",
  "NAMES",
  "WEIGHTS_FILE",
  "HeadConfig",
  "HeadKind",
  "drafter",
  "kind",
  "make_head",
  "module_of",
]
