"""The sequential block drafter (DSpark: DeepSeek and PKU, 2026), everything it is, a
file per concept:

  model.py     settings (`DSparkConfig`) and module (`DSparkHead`)
  drafter.py   the drafter (`DSparkDrafter`)
  hub.py       DeepSpec's hub layout (`Qwen3DSparkModel`)
  training.py  training objective (`dspark_objective`), its settings (`DSparkLoss`),
               the backbone (`backbone`, `frozen_backbone`), calibration
               (`calibration`) and the run's checks and warm start
  growth.py    the growth rule with a scaled target (`expansion_axes`)

and here the kind's record, `KIND`, which names pieces of each; every public name is
re-exported here (`from specjax.heads.dspark import DSparkHead`).

DSpark is the block drafter (`specjax.heads.dflash`) plus two small heads:

  Markov head   one block call gives every position's hidden state h_i and base
                logits l_i (a law that ignores the drafts before it). The law
                token i is drawn from is corrected by the token before it, through
                a low-rank bigram bias:
                    logits_i = l_i + W2 . W1[prev_i],  W1 [V, r], W2 [r, V]
                prev_0 = s[-1], prev_i = draft i - 1. Drafting walks the block
                left to right, each step a gather and an [r] x [r, V] product, so
                the draft stays about one call. W2 starts at zero: a fresh head
                drafts what its backbone drafts.
  confidence    c_i = sigmoid(w . [h_i, W1[prev_i]] + b), trained toward the chance
  head          that draft i is accepted given the drafts before it were; the
                survival of draft i is c_0 ... c_i. The drafter hands it to the
                iteration (`Proposal.confidence`), which can verify only the prefix
                worth verifying, and with adaptive="confidence" a row stops
                drafting once its survival falls below the threshold.

Exactness: q_i is the law token i was actually drawn from given the drafts before
it (the corrected law, warped; one-hot at its argmax for argmax drafts), which is
all the token, block and coupled verifiers need; at temperature 0 the output is
the target's greedy decoding. Under a constraint each position's corrected law is
masked by the state its drafted prefix reaches, as the other drafters do. How many
tokens a row drafts (and the iteration verifies) may depend on anything the
drafter knows, so the confidence never changes the output's law.

Token trees from one pass: a node at depth d draws its children from position
d + 1's base law corrected by the node's own token (`draft_tree`), so siblings
differ by their parent, as EAGLE's do, while the block stays one call.
"""

from __future__ import annotations

from specjax.heads import hub as shared_hub
from specjax.heads.base import HeadKind, TrainingRules
from specjax.heads.dspark.drafter import DSparkDrafter
from specjax.heads.dspark.growth import expansion_axes
from specjax.heads.dspark.hub import (
  ARCHITECTURES,
  MARKOV_HEAD_TYPES,
  SPELLING,
  from_hub,
  hub_config,
  recognises,
  write,
)
from specjax.heads.dspark.model import DSparkConfig, DSparkHead
from specjax.heads.dspark.training import (
  CONFIDENCE_TARGETS,
  LOSS_FIELDS,
  OWN_PARAMS,
  TRAINING_FIELDS,
  DSparkLoss,
  backbone,
  calibration,
  check_training,
  dspark_objective,
  frozen_backbone,
  optax_bce,
  warm_start,
)

KIND = HeadKind(
  name="dspark",
  title="sequential block drafter",
  config=DSparkConfig,
  make=DSparkHead,
  drafter=DSparkDrafter,
  holds="head",
  objective=dspark_objective,
  hub=shared_hub.HubLayout(
    f"{ARCHITECTURES[0]} (DeepSpec DSpark)", shared_hub.LLAMA_FILES, recognises, from_hub, write
  ),
  read_priority=0,
  training=TrainingRules(
    fields=(
      "feature_layers",
      "d_ff",
      "block_size",
      "draft_layers",
      "mask_token_id",
      "markov_rank",
      "confidence_head",
      "confidence_with_markov",
      "anchor_first",
      "correct_first",
    ),
    check=check_training,
    loss=DSparkLoss,
    warm_start=warm_start,
  ),
  expansion_axes=expansion_axes,
)

__all__ = [
  "ARCHITECTURES",
  "CONFIDENCE_TARGETS",
  "DSparkConfig",
  "DSparkDrafter",
  "DSparkHead",
  "DSparkLoss",
  "KIND",
  "LOSS_FIELDS",
  "MARKOV_HEAD_TYPES",
  "OWN_PARAMS",
  "SPELLING",
  "TRAINING_FIELDS",
  "backbone",
  "calibration",
  "check_training",
  "dspark_objective",
  "expansion_axes",
  "from_hub",
  "frozen_backbone",
  "hub_config",
  "optax_bce",
  "recognises",
  "warm_start",
  "write",
]
