"""The block drafter's training: its objective (`dflash_objective`), its settings
(`DFlashLoss`, `TRAINING_FIELDS`, `LOSS_FIELDS`), the checks of a run's `config.head`
(`check_training`) and the warm start from a trained block drafter (`warm_start`)."""

from __future__ import annotations

import dataclasses

from specjax.heads.base import LossSettings
from specjax.heads.blocks import block_batch, block_loss, check_reals, transfer
from specjax.heads.dflash.model import DFlashConfig, DFlashHead
from specjax.models.transformer import Transformer
from specjax.validation import is_int


def dflash_objective(head, target, batch, key, *, loss, settings):
  """The block drafter (DFlash's recipe): up to `num_anchors` anchors a per window,
  distinct, drawn from the key in [1, T - 1] (evenly spaced without a key: evaluation);
  block a reads the context before a and its output k (k = 1..B-1) is scored by its
  cross-entropy on the corpus token at a + k, weighted by exp(-(k - 1) / loss_decay)
  and normalised by the weights of the positions inside the window (a + k <= T). On
  target-generated data (experiments.generate_data) the corpus tokens are the target's
  own draws, as in the reference.

  The loss (`block_loss`) mixes that decayed cross-entropy (`block_ce`) with the
  decayed L1 distance from the target's law (`block_l1`, 2 TV: acceptance-shaped),
  `l1_mix` of the latter (DSpark's published recipe: 0.9; 0 is DFlash's), plus
  `distill_weight` times `distill`, `loss`'s divergence decayed alike; `ce` is the
  plain mean cross-entropy, the alphas are over every scored position and per block
  position (`alpha_t0_pos1`, `alpha_t1_pos1`, ...), and `block_accept` is the mean
  leading run of positions whose argmax is the target's (the drafts a greedy block
  keeps on the target's greedy text)."""
  blocks = block_batch(head, target, batch, key, settings)
  q_logits = head(target, blocks.features, blocks.inputs, blocks.anchors)  # [B, A, n-1, V]
  return block_loss(q_logits, blocks, loss, settings)


# The training run's own settings (`config.head`), {field: (default, low, high)}.
TRAINING_FIELDS = {"num_anchors": (32, 1, 1024)}
# ... and its real-valued ones, {field: (default, low, high)} (high None: unbounded).
LOSS_FIELDS = {
  "loss_decay": (7.0, 0.0, None),
  "l1_mix": (0.9, 0.0, 1.0),
  "distill_weight": (0.0, 0.0, None),
}


def check_training(config) -> None:
  """The block drafter's `config.head` fields: ValueError naming the field and its range."""
  head = config.head
  defaults = {f.name: f.default for f in dataclasses.fields(DFlashConfig)}
  ranges = {name: (defaults[name], *r) for name, r in DFlashConfig.RANGES.items()}
  ranges["mask_token_id"] = (-1, -1, None)  # the upper bound: the target's vocabulary
  for name, (default, low, high) in {**ranges, **TRAINING_FIELDS}.items():
    value = head.get(name, default)
    if not is_int(value) or value < low or (high is not None and value > high):
      allowed = f"in [{low}, {high}]" if high is not None else f">= {low}"
      raise ValueError(f"config.head.{name} must be an int {allowed}, got {value!r}.")
  block = head.get("block_size", defaults["block_size"])
  if not config.seq_len > block:
    raise ValueError(
      f"config.seq_len must be > config.head.block_size={block} (a block needs its context "
      f"and targets in the window), got {config.seq_len}."
    )
  check_reals(head, LOSS_FIELDS)
  decay = head.get("loss_decay", 7.0)
  if decay == 0:  # position weights exp(-(k - 1) / loss_decay)
    raise ValueError(f"config.head.loss_decay must be a finite number > 0, got {decay!r}.")
  if not isinstance(head.get("backbone", ""), str):
    raise ValueError(
      f"config.head.backbone must be a path or 'bundled', got {head.get('backbone')!r}."
    )


@dataclasses.dataclass(frozen=True)
class DFlashLoss(LossSettings):
  """The block drafter's objective settings (`config.head`; `dflash_objective`).

  Attributes:
    num_anchors: anchors per window (at most T - 1 are drawn from the key).
    loss_decay: gamma of the position weights exp(-(k - 1) / gamma).
    l1_mix: the L1 term's share (2 TV from the target's law: acceptance-shaped), the
      rest the decayed cross-entropy on the text (0: DFlash's own loss).
    distill_weight: weight of the decayed divergence `config.loss`, added.
  """

  num_anchors: int = TRAINING_FIELDS["num_anchors"][0]
  loss_decay: float = LOSS_FIELDS["loss_decay"][0]
  l1_mix: float = LOSS_FIELDS["l1_mix"][0]
  distill_weight: float = LOSS_FIELDS["distill_weight"][0]

  @property
  def keyed(self) -> bool:
    return True  # the anchors are drawn in training

  @classmethod
  def from_config(cls, head) -> DFlashLoss:
    return cls(
      num_anchors=int(head.get("num_anchors", cls.num_anchors)),
      **{name: float(head.get(name, default)) for name, (default, _, _) in LOSS_FIELDS.items()},
    )


def warm_start(head: DFlashHead, target: Transformer, settings, load) -> DFlashHead:
  """`head` started from the block drafter `config.head.backbone` ("bundled" or "": the
  bundled one; else a run or export directory), read by `load`
  (`specjax.training.heads.load_head_from`), through `transfer`."""
  where = settings.get("backbone", "") or "bundled"
  source = load(where, "dflash", target)
  if not isinstance(source, DFlashHead):
    raise ValueError(
      f"config.head.backbone must be a block drafter, {where} holds a {source.cfg.kind} head."
    )
  return transfer(head, source, where)
