"""The block drafter (DFlash, arXiv 2602.06036), everything it is, a file per concept:

  model.py     settings (`DFlashConfig`) and module (`DFlashHead`, `DFlashLayer`)
  drafter.py   the drafter (`DFlashDrafter`, its state `DFlashState`)
  hub.py       z-lab/dflash's hub layout (`DFlashDraftModel`)
  training.py  training objective (`dflash_objective`), its settings (`DFlashLoss`) and
               the run's checks and warm start
  growth.py    the growth rule with a scaled target (`expansion_axes`)

and here the kind's record, `KIND`, which names pieces of each; every public name is
re-exported here (`from specjax.heads.dflash import DFlashHead`).

Drafting: a whole block of drafts in one call. The head (`DFlashHead`) keeps the
context (the target's fused features at every committed position but the last) as
keys and values in its own static cache, one layer per drafter layer;
`cache.lengths` is len(s) - 1.

  propose: one head call on the block [s[-1], m, ..., m] gives the laws of the
    next B - 1 tokens at once; the first gamma are drafted, each drawn from its
    own position's law (`draft="sample"`: q the warped law) or its argmax
    (`draft="argmax"`, the reference's behaviour: q one-hot). The block's own
    keys are never cached.
  commit:  the verification call's features at s[-1] and the accepted drafts
    (the kept positions) are appended to the context: projections only, no
    attention. Rolling back is bookkeeping, as for every cache.

Each q_i is a law that ignores the drafts before it, which is still a law for
token i given them: token and block verification stay exact at any temperature,
and at temperature 0 (argmax drafts) the output equals the target's greedy
decoding. Under a constraint each position's law is masked by the state its
drafted prefix reaches, as other drafters do.

With a `tree` (a static breadth-first token tree, `specjax.trees`) the same one
call gives every depth's law: a node at depth d has its children drawn from
position d + 1's law, the same whatever the node, as Medusa's heads do (the top-k
at temperature 0, Gumbel-top-k or i.i.d. draws otherwise); `tree_verify` then
accepts the longest path the target agrees with. The commit receives the
accepted path's features in chain order, so it is the chain's.
"""

from __future__ import annotations

from specjax.heads import hub as shared_hub
from specjax.heads.base import HeadKind, TrainingRules
from specjax.heads.dflash.drafter import DRAFT_MODES, DFlashDrafter, DFlashState
from specjax.heads.dflash.growth import expansion_axes
from specjax.heads.dflash.hub import (
  ARCHITECTURE,
  DFLASH_SPELLING,
  HubSpelling,
  derived_layout,
  from_hub,
  hub_config,
  hub_fields,
  hub_tensors,
  read_hub_head,
  recognises,
  tensor_names,
  write,
)
from specjax.heads.dflash.model import (
  MOST_FEATURE_LAYERS,
  DFlashConfig,
  DFlashHead,
  DFlashLayer,
  block_feature_layers,
  dflash_feature_layers,
)
from specjax.heads.dflash.training import (
  LOSS_FIELDS,
  TRAINING_FIELDS,
  DFlashLoss,
  check_training,
  dflash_objective,
  warm_start,
)

KIND = HeadKind(
  name="dflash",
  title="block drafter",
  config=DFlashConfig,
  make=DFlashHead,
  drafter=DFlashDrafter,
  holds="head",
  objective=dflash_objective,
  hub=shared_hub.HubLayout(
    f"{ARCHITECTURE} (z-lab/dflash)", shared_hub.LLAMA_FILES, recognises, from_hub, write
  ),
  read_priority=2,
  training=TrainingRules(
    fields=("feature_layers", "d_ff", "block_size", "draft_layers", "mask_token_id"),
    check=check_training,
    loss=DFlashLoss,
    warm_start=warm_start,
  ),
  expansion_axes=expansion_axes,
)

__all__ = [
  "ARCHITECTURE",
  "DFLASH_SPELLING",
  "DFlashConfig",
  "DFlashDrafter",
  "DFlashHead",
  "DFlashLayer",
  "DFlashLoss",
  "DFlashState",
  "DRAFT_MODES",
  "HubSpelling",
  "KIND",
  "LOSS_FIELDS",
  "MOST_FEATURE_LAYERS",
  "TRAINING_FIELDS",
  "block_feature_layers",
  "check_training",
  "derived_layout",
  "dflash_feature_layers",
  "dflash_objective",
  "expansion_axes",
  "from_hub",
  "hub_config",
  "hub_fields",
  "hub_tensors",
  "read_hub_head",
  "recognises",
  "tensor_names",
  "warm_start",
  "write",
]
