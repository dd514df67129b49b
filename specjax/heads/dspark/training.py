"""The sequential block drafter's training: its objective (`dspark_objective`) and its
settings (`DSparkLoss`, `TRAINING_FIELDS`, `LOSS_FIELDS`, `CONFIDENCE_TARGETS`), its
backbone (`backbone`, `frozen_backbone`), the confidence head's reliability data
(`calibration`), the checks of a run's `config.head` (`check_training`) and the warm
start (`warm_start`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.heads import blocks as block_training
from specjax.heads.dflash.model import DFlashConfig, DFlashHead
from specjax.heads.dflash.training import DFlashLoss
from specjax.heads.dflash.training import check_training as check_block_training
from specjax.heads.dspark.model import DSparkConfig, DSparkHead
from specjax.models.transformer import Transformer

CONFIDENCE_TARGETS = ("greedy", "sampled")


def dspark_objective(head, target, batch, key, *, loss, settings):
  """The block drafter's objective (`blocks.block_loss`: the acceptance-shaped mix of
  decayed cross-entropy and L1 from the target's law, plus `distill_weight` times the
  decayed divergence) on the corrected laws, each position's law corrected by the
  text's token before it (teacher forcing: a draft is kept only when it is that token);
  plus `base_weight` times the same loss on the backbone's own laws (so the backbone
  stays a block drafter of its own: the bundled DFlash head is this one's backbone);
  plus `confidence_weight` times the confidence head's binary cross-entropy toward the
  chance that draft k is accepted given the drafts before it were: "sampled"
  (`confidence_target`): 1 - TV(p, q), token verification's chance; "greedy": whether
  the corrected law's argmax is the target's. With `train_backbone` False the block
  drafter's own parameters get no gradient (the two heads train on a frozen backbone)
  but those under the path prefixes `train_only` (e.g. `("layers.1", "norm")`: its last
  layer and final norm), which then differ from the backbone's and are stored beside
  the heads.

  Metrics besides the block drafter's: `confidence_bce`, `confidence_mean` (the mean
  estimate) and `accept_mean` (the mean target), and the backbone's own agreement per
  position (`base_alpha_t0_pos{k}`, `base_alpha_t1_pos{k}`) beside the corrected one's."""
  blocks = block_training.block_batch(head, target, batch, key, settings)
  if not settings.train_backbone:
    head = frozen_backbone(head, settings.train_only)
  h = head.train_hidden(target, blocks.features, blocks.inputs, blocks.anchors)
  base = head.logits(target, h)  # [B, A, n - 1, V]
  embed = head.markov_embed(blocks.previous)
  q_logits = head.corrected(base, embed, first=_first(blocks.previous.shape))
  value, metrics = block_training.block_loss(q_logits, blocks, loss, settings)
  valid, p_logits = blocks.valid, blocks.p_logits
  count = jnp.maximum(valid.sum(), 1)
  if settings.confidence_target == "greedy":
    accept = (q_logits.argmax(-1) == p_logits.argmax(-1)).astype(jnp.float32)
  else:
    p, q = jax.nn.softmax(p_logits), jax.nn.softmax(q_logits)
    accept = 1.0 - 0.5 * jnp.abs(p - q).sum(-1)
  accept = jax.lax.stop_gradient(accept)
  logit = head.confidence_logit(h, embed)
  bce = jnp.sum(optax_bce(logit, accept) * valid) / count
  metrics["confidence_bce"] = bce
  metrics["confidence_mean"] = jnp.sum(jax.nn.sigmoid(logit) * valid) / count
  metrics["accept_mean"] = jnp.sum(accept * valid) / count
  if settings.base_weight:  # the backbone's own laws scored too (a softmax more per step)
    base_value, base = block_training.block_loss(base, blocks, loss, settings)
    metrics["base_loss"] = base_value
    metrics.update({f"base_{k}": v for k, v in base.items() if "_pos" in k})
    value = value + settings.base_weight * base_value
  else:
    same = base.argmax(-1) == p_logits.argmax(-1)
    metrics.update(block_training.position_metrics("base_alpha_t0", same, valid))
  if head.cfg.confidence_head and settings.confidence_weight:
    value = value + settings.confidence_weight * bce
  return value, metrics


def backbone(head: DSparkHead) -> DFlashHead:
  """The block drafter inside `head`: a `DFlashHead` of the same settings holding its
  backbone's parameters (what drafts without the two heads; the bundled block drafter is
  the bundled sequential one's backbone)."""
  fields = {f.name: getattr(head.cfg, f.name) for f in dataclasses.fields(DFlashConfig)}
  cfg = DFlashConfig(**fields)
  return block_training.transfer(DFlashHead(cfg, rngs=nnx.Rngs(0)), head, "the sequential drafter")


OWN_PARAMS = ("markov_w1", "markov_w2", "confidence_hidden", "confidence_markov", "confidence_bias")


def frozen_backbone(head: DSparkHead, train_only: tuple[str, ...] = ()) -> DSparkHead:
  """`head` whose block drafter's parameters are constants to differentiation (its
  Markov and confidence heads', and those under a dotted path prefix of `train_only`,
  stay variables)."""
  graphdef, state = nnx.split(head)
  flat = []
  for path, variable in nnx.to_flat_state(state):
    name = ".".join(map(str, path))
    trains = path[0] in OWN_PARAMS or any(name == p or name.startswith(p + ".") for p in train_only)
    value = variable.get_value()
    flat.append((path, variable.replace(value if trains else jax.lax.stop_gradient(value))))
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _first(shape) -> jax.Array:
  """`[..., m]` bools: True at each block's first draft."""
  return jnp.broadcast_to(jnp.arange(shape[-1]) == 0, shape)


def optax_bce(logit: jax.Array, target: jax.Array) -> jax.Array:
  """Binary cross-entropy of `sigmoid(logit)` toward soft `target` in [0, 1], elementwise."""
  return jnp.maximum(logit, 0) - logit * target + jnp.log1p(jnp.exp(-jnp.abs(logit)))


def calibration(head, target, batch, *, num_anchors: int = 64, bins: int = 10) -> dict:
  """Predicted against measured acceptance, teacher-forced on windows `batch [B, T + 1]`
  (evenly spaced anchors): the reliability diagram's data.

  Per block position k: the mean confidence estimate and the measured rate at which
  the corrected law's argmax is the target's (a greedy draft's chance of being kept
  given the drafts before it were); per bin of the estimate (`bins` equal bins of
  [0, 1]): the count, mean estimate and measured rate; and the expected calibration
  error (the count-weighted mean gap). Survival: per position, the mean running
  product of the estimates beside the measured rate at which all of positions
  1..k are kept.
  """
  settings = DFlashLoss(num_anchors=num_anchors, loss_decay=1.0)
  blocks = block_training.block_batch(head, target, batch, None, settings)
  h = head.train_hidden(target, blocks.features, blocks.inputs, blocks.anchors)
  embed = head.markov_embed(blocks.previous)
  q_logits = head.corrected(head.logits(target, h), embed, first=_first(blocks.previous.shape))
  kept = np.asarray(q_logits.argmax(-1) == blocks.p_logits.argmax(-1), np.float64)
  estimate = np.asarray(jax.nn.sigmoid(head.confidence_logit(h, embed)), np.float64)
  valid = np.asarray(blocks.valid)
  whole = valid.all(-1)  # blocks inside the window: survival counts all their positions
  out = {"positions": [], "bins": [], "survival": []}
  for k in range(valid.shape[-1]):
    ok = valid[..., k]
    out["positions"].append(
      {
        "position": k + 1,
        "count": int(ok.sum()),
        "predicted": float(estimate[..., k][ok].mean()),
        "measured": float(kept[..., k][ok].mean()),
      }
    )
    out["survival"].append(
      {
        "position": k + 1,
        "predicted": float(np.prod(estimate[..., : k + 1], -1)[whole].mean()),
        "measured": float(np.prod(kept[..., : k + 1], -1)[whole].mean()),
      }
    )
  e, m = estimate[valid], kept[valid]
  which = np.minimum((e * bins).astype(int), bins - 1)
  gap = 0.0
  for i in range(bins):
    sel = which == i
    if sel.any():
      out["bins"].append(
        {
          "low": i / bins,
          "high": (i + 1) / bins,
          "count": int(sel.sum()),
          "predicted": float(e[sel].mean()),
          "measured": float(m[sel].mean()),
        }
      )
      gap += sel.sum() * abs(e[sel].mean() - m[sel].mean())
  out["ece"] = float(gap / max(len(e), 1))
  return out


# -- the training run's settings


TRAINING_FIELDS = {
  "confidence_target": "sampled",
  "train_backbone": True,
  "train_only": "",
}
# Real-valued ones, {field: (default, low, high)} (high None: unbounded).
LOSS_FIELDS = {"confidence_weight": (1.0, 0.0, None), "base_weight": (0.5, 0.0, None)}


def check_training(config) -> None:
  """The sequential block drafter's `config.head` fields: the block drafter's, its
  rank, and its loss's (ValueError naming the field and its range)."""
  check_block_training(config)
  head = config.head
  low, high = DSparkConfig.RANGES["markov_rank"]
  rank = head.get("markov_rank", 32)
  if not isinstance(rank, int) or isinstance(rank, bool) or not low <= rank <= high:
    raise ValueError(f"config.head.markov_rank must be an int in [{low}, {high}], got {rank!r}.")
  block_training.check_reals(head, LOSS_FIELDS)
  target = head.get("confidence_target", TRAINING_FIELDS["confidence_target"])
  if target not in CONFIDENCE_TARGETS:
    raise ValueError(
      f"config.head.confidence_target must be one of {CONFIDENCE_TARGETS}, got {target!r}."
    )
  bools = ("confidence_head", "confidence_with_markov", "train_backbone", "anchor_first")
  for name in (*bools, "correct_first"):
    if not isinstance(head.get(name, False), bool):
      raise ValueError(f"config.head.{name} must be a bool, got {head.get(name)!r}.")
  only = head.get("train_only", "")
  if not isinstance(only, str):
    raise ValueError(f"config.head.train_only must be a string of path prefixes, got {only!r}.")
  if only and head.get("train_backbone", True):
    raise ValueError(
      "config.head.train_only names the backbone's parameters that train on a frozen "
      f"backbone; it needs config.head.train_backbone=False, got train_only={only!r}."
    )
  if not head.get("train_backbone", True) and config.weight_decay:
    raise ValueError(
      "config.weight_decay must be 0 with config.head.train_backbone=False (decay would "
      f"move the frozen backbone), got {config.weight_decay}."
    )


@dataclasses.dataclass(frozen=True)
class DSparkLoss(DFlashLoss):
  """The sequential block drafter's objective settings (`config.head`): the block
  drafter's, and its heads'.

  Attributes:
    confidence_weight: weight of the confidence loss.
    base_weight: weight of the same loss on the backbone's own (uncorrected) laws, so
      the backbone stays a block drafter of its own.
    confidence_target: what the confidence head learns: "sampled" (1 - TV, token
      verification's acceptance) or "greedy" (argmax agreement).
    train_backbone: False trains only the two heads, and the backbone's parameters
      under the dotted path prefixes `train_only`.
    train_only: those prefixes (`config.head.train_only`: one comma-separated string).
  """

  confidence_weight: float = LOSS_FIELDS["confidence_weight"][0]
  base_weight: float = LOSS_FIELDS["base_weight"][0]
  confidence_target: str = TRAINING_FIELDS["confidence_target"]
  train_backbone: bool = TRAINING_FIELDS["train_backbone"]
  train_only: tuple[str, ...] = ()

  @classmethod
  def from_config(cls, head) -> DSparkLoss:
    only = str(head.get("train_only", ""))
    return cls(
      **dataclasses.asdict(DFlashLoss.from_config(head)),
      **{name: float(head.get(name, default)) for name, (default, _, _) in LOSS_FIELDS.items()},
      confidence_target=str(head.get("confidence_target", cls.confidence_target)),
      train_backbone=bool(head.get("train_backbone", cls.train_backbone)),
      train_only=tuple(p.strip() for p in only.split(",") if p.strip()),
    )


def warm_start(head: DSparkHead, target: Transformer, settings, load) -> DSparkHead:
  """`head` started from `config.head.backbone`: "bundled" (or "") the bundled sequential
  block drafter, backbone and heads; else a run or export directory, read by `load`
  (`specjax.training.heads.load_head_from`): a sequential drafter's (backbone and heads)
  or a block drafter's (the backbone; the two heads stay fresh, W2 = 0: it drafts what
  the backbone drafts). `fc` grows to more feature layers as `blocks.transfer` says.
  ValueError naming the field for a head of another kind or other settings."""
  where = settings.get("backbone", "") or "bundled"
  source = load(where, "dspark" if where == "bundled" else "dflash", target)
  if not isinstance(source, DFlashHead):
    raise ValueError(
      f"config.head.backbone must be a dflash or dspark head, {where} holds a "
      f"{source.cfg.kind} head."
    )
  if head.cfg.anchor_first != getattr(source.cfg, "anchor_first", False) and not settings.get(
    "train_backbone", True
  ):
    raise ValueError(
      "config.head.anchor_first=True reads a block drafter's anchor slot, which its "
      "training never scored: set config.head.train_backbone=True to train it."
    )
  return block_training.transfer(head, source, where)
