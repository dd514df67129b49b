"""The sequential block drafter (DSpark: DeepSeek and PKU, 2026), everything it is:
settings (`DSparkConfig`), module (`DSparkHead`), drafter (`DSparkDrafter`), training
objective (`dspark_objective`), calibration (`calibration`), growth rule and record.

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

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from specjax import trees
from specjax.coupling import chain_draws
from specjax.drafting.base import (
  ConfidenceLength,
  DraftConstraint,
  Proposal,
  draw_chain_token,
)
from specjax.drafting.tree import draft_tree
from specjax.heads import dflash
from specjax.heads.base import HeadConfigError, HeadKind, TrainingRules, linear
from specjax.models.transformer import Transformer
from specjax.sampling import RowSampling, SamplingParams
from specjax.validation import is_real
from specjax.vocab import fit_ids

CONFIDENCE_TARGETS = ("greedy", "sampled")


@dataclasses.dataclass(frozen=True)
class DSparkConfig(dflash.DFlashConfig):
  """A sequential block drafter's settings: the block drafter's (`DFlashConfig`)
  and its two heads'.

  Attributes:
    markov_rank: r in `RANGES`, the Markov head's rank (0: none; the drafts are
      the backbone's).
    confidence_head: whether it has a confidence head.
    confidence_with_markov: whether the confidence head also reads W1[prev_i]
      (the reference's `confidence_head_with_markov`), else h_i alone.
  """

  kind = "dspark"
  RANGES = {**dflash.DFlashConfig.RANGES, "markov_rank": (0, 1024)}

  markov_rank: int = 32
  confidence_head: bool = True
  confidence_with_markov: bool = True

  def check_settings(self, layers):
    layers = super().check_settings(layers)
    self._check_bools("confidence_head", "confidence_with_markov")
    return layers


class DSparkHead(dflash.DFlashHead):
  """A block drafter (`DFlashHead`: its parameters, paths and calls) with a Markov
  head (`markov_w1 [V, r]`, `markov_w2 [r, V]`) and a confidence head
  (`confidence_hidden [D, 1]`, `confidence_markov [r, 1]`, `confidence_bias [1]`:
  the reference's one projection of [h, W1[prev]], kept in parts so each part grows
  with its own width)."""

  def __init__(self, cfg: DSparkConfig, *, rngs: nnx.Rngs):
    if not isinstance(cfg, DSparkConfig):
      raise ValueError(f"DSparkHead needs a DSparkConfig, got {type(cfg).__name__}.")
    super().__init__(cfg, rngs=rngs)
    c, r = self.layer_config, cfg.markov_rank
    v, d = cfg.target.vocab_size, c.d_model
    if r:
      init = nnx.initializers.normal(c.init_std)
      self.markov_w1 = nnx.Param(init(rngs.params(), (v, r), c.weight_dtype))
      self.markov_w2 = nnx.Param(jnp.zeros((r, v), c.weight_dtype))
    if cfg.confidence_head:
      self.confidence_hidden = linear(c, d, 1, rngs=rngs, bias=False)
      if r and cfg.confidence_with_markov:
        self.confidence_markov = linear(c, r, 1, rngs=rngs, bias=False)
      self.confidence_bias = nnx.Param(jnp.zeros((1,), c.weight_dtype))

  def markov_embed(self, previous: jax.Array) -> jax.Array | None:
    """W1[previous]: `[...]` token ids -> `[..., r]` (None without a Markov head)."""
    if not self.cfg.markov_rank:
      return None
    return jnp.take(self.markov_w1[...], previous, axis=0)

  def corrected(self, base: jax.Array, embed: jax.Array | None) -> jax.Array:
    """Base logits `[..., V]` corrected by `embed [..., r]` (W1 of the token before):
    float32 `[..., V]`; -inf entries (a vocabulary subset) stay -inf."""
    if embed is None:
      return base
    bias = jnp.einsum("...r,rv->...v", embed.astype(jnp.float32), self.markov_w2[...].astype(jnp.float32))
    return base + bias

  def confidence_logit(self, h: jax.Array, embed: jax.Array | None) -> jax.Array:
    """The confidence head's logit `[...]` from `h [..., D]` and `embed [..., r]`
    (zeros without a confidence head: a survival of 1/2 per position)."""
    if not self.cfg.confidence_head:
      return jnp.zeros(h.shape[:-1], jnp.float32)
    x = self.confidence_hidden(h)[..., 0].astype(jnp.float32)
    if embed is not None and self.cfg.confidence_with_markov:
      x = x + self.confidence_markov(embed)[..., 0].astype(jnp.float32)
    return x + self.confidence_bias[...].astype(jnp.float32)[0]


# -- drafting


@struct.dataclass
class DSparkDrafter(dflash.DFlashDrafter, ConfidenceLength):
  """Drafts a block of up to B - 1 tokens per iteration with one `DSparkHead` call,
  each token drawn from its position's law corrected by the token drafted before it.

  Attributes (besides `DFlashDrafter`'s):
    confidence: adaptive "confidence" threshold (`with_confidence`): a row drafts
      only the leading tokens whose survival (the running product of the
      confidence head's estimates) is at least this; 0 drafts gamma.
  """

  confidence: float = struct.field(pytree_node=False, default=0.0)

  def propose(
    self,
    state: dflash.DFlashState,
    recent: jax.Array,
    key: jax.Array,
    limit: jax.Array,
    *,
    gamma: int,
    sampling: SamplingParams | RowSampling,
    constraint: DraftConstraint | None = None,
  ) -> tuple[Proposal, dflash.DFlashState]:
    last = fit_ids(recent[:, -1], self.vocab_size)
    head = self.head
    if self.tree is not None:
      return self._propose_tree(state, last, key, sampling, constraint), state
    h = head.draft_hidden(self.target, state.cache, last, gamma)  # [B, g, D]
    base = head.logits(self.target, h, self.vocab_subset)  # [B, g, V]
    b = base.shape[0]
    argmax = sampling.greedy or self.draft == "argmax"
    draw = None if argmax else chain_draws(key, gamma, b)
    tokens, probs, confidence, rule, previous = [], [], [], constraint, last
    for i in range(gamma):  # sequential: each law is corrected by the token before it
      embed = head.markov_embed(previous)
      token, q, rule = draw_chain_token(i, head.corrected(base[:, i], embed), rule, sampling, draw)
      confidence.append(jax.nn.sigmoid(head.confidence_logit(h[:, i], embed)))
      tokens.append(token)
      if q is not None:
        probs.append(q)
      previous = token
    confidence = jnp.stack(confidence, axis=1)  # [B, g]
    lengths = jnp.minimum(limit, gamma).astype(jnp.int32)
    if self.confidence > 0:  # at least one draft; then while the survival holds
      survival = jnp.cumprod(confidence, axis=1)
      keep = (survival >= self.confidence).at[:, 0].set(True)
      lengths = jnp.minimum(lengths, jnp.cumprod(keep, axis=1).sum(1).astype(jnp.int32))
    proposal = Proposal(
      jnp.stack(tokens, axis=1),
      jnp.stack(probs, axis=1) if probs else None,
      lengths,
      jnp.int32(1),
      confidence=confidence,
    )
    return proposal, state

  def _propose_tree(self, state, last, key, sampling, constraint) -> Proposal:
    head, parents = self.head, self.tree
    depths = trees.tree_depths(parents)
    h = head.draft_hidden(self.target, state.cache, last, len(trees.levels(parents)))
    base = head.logits(self.target, h, self.vocab_subset)  # [B, depth, V]

    def read(start, stop, tokens):  # a depth's nodes: their children's corrected laws
      d = depths[start]  # the nodes' depth, 1 for the root's children: base row d
      return head.corrected(base[:, d : d + 1], head.markov_embed(tokens))

    root = head.corrected(base[:, 0], head.markov_embed(last))
    tokens, probs = draft_tree(parents, self.tree_mode, sampling, key, root, read, constraint)
    lengths = jnp.full((base.shape[0],), len(parents), jnp.int32)
    return Proposal(tokens, probs, lengths, jnp.int32(1), trees.Tree.static(parents))


# -- training


def dspark_objective(head, target, batch, key, *, loss, settings):
  """The block drafter's objective (`dflash.dflash_objective`: decayed cross-entropy
  on the corpus plus `distill_weight` times the decayed divergence) on the corrected
  laws, each position's law corrected by the corpus token before it (teacher
  forcing: a draft is kept only when it is that token), plus `confidence_weight`
  times the confidence head's binary cross-entropy toward the chance that draft k is
  accepted given the drafts before it were: "greedy" (`confidence_target`): whether
  the corrected law's argmax is the target's; "sampled": 1 - TV(p, q), token
  verification's chance. With `train_backbone` False the block drafter's own
  parameters get no gradient (the two heads train on a frozen backbone).

  Metrics besides the block drafter's: `confidence_bce`, `confidence_mean` (the mean
  estimate) and `accept_mean` (the mean target), and the backbone's own argmax
  agreement per position (`base_alpha_t0_pos{k}`) beside the corrected one's."""
  blocks = dflash.block_batch(head, target, batch, key, settings)
  h = head.train_hidden(target, blocks.features, blocks.inputs, blocks.anchors)
  base = head.logits(target, h)  # [B, A, n - 1, V]
  if not settings.train_backbone:
    h, base = jax.lax.stop_gradient(h), jax.lax.stop_gradient(base)
  embed = head.markov_embed(blocks.previous)
  q_logits = head.corrected(base, embed)
  value, metrics = dflash.block_loss(q_logits, blocks, loss, settings)
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
  same = base.argmax(-1) == p_logits.argmax(-1)
  n = head.cfg.block_size
  for i in sorted({*(2**j for j in range(7) if 2**j < n), n - 1}):
    ok = valid[..., i - 1]
    metrics[f"base_alpha_t0_pos{i}"] = jnp.sum(same[..., i - 1] * ok) / jnp.maximum(ok.sum(), 1)
  if head.cfg.confidence_head and settings.confidence_weight:
    value = value + settings.confidence_weight * bce
  return value, metrics


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
  settings = dflash_settings(num_anchors)
  blocks = dflash.block_batch(head, target, batch, None, settings)
  h = head.train_hidden(target, blocks.features, blocks.inputs, blocks.anchors)
  embed = head.markov_embed(blocks.previous)
  q_logits = head.corrected(head.logits(target, h), embed)
  kept = np.asarray(q_logits.argmax(-1) == blocks.p_logits.argmax(-1), np.float64)
  estimate = np.asarray(jax.nn.sigmoid(head.confidence_logit(h, embed)), np.float64)
  valid = np.asarray(blocks.valid)
  whole = valid.all(-1)  # blocks inside the window: survival counts all their positions
  out = {"positions": [], "bins": [], "survival": []}
  for k in range(valid.shape[-1]):
    ok = valid[..., k]
    out["positions"].append({
      "position": k + 1,
      "count": int(ok.sum()),
      "predicted": float(estimate[..., k][ok].mean()),
      "measured": float(kept[..., k][ok].mean()),
    })
    out["survival"].append({
      "position": k + 1,
      "predicted": float(np.prod(estimate[..., : k + 1], -1)[whole].mean()),
      "measured": float(np.prod(kept[..., : k + 1], -1)[whole].mean()),
    })
  e, m = estimate[valid], kept[valid]
  which = np.minimum((e * bins).astype(int), bins - 1)
  gap = 0.0
  for i in range(bins):
    sel = which == i
    if sel.any():
      out["bins"].append({
        "low": i / bins,
        "high": (i + 1) / bins,
        "count": int(sel.sum()),
        "predicted": float(e[sel].mean()),
        "measured": float(m[sel].mean()),
      })
      gap += sel.sum() * abs(e[sel].mean() - m[sel].mean())
  out["ece"] = float(gap / max(len(e), 1))
  return out


def dflash_settings(num_anchors: int):
  """The block layout's settings for evaluation (no loss weights)."""
  from specjax.training.heads import HeadLoss

  return HeadLoss(num_anchors=num_anchors, loss_decay=1.0)


# -- growth with the target (specjax.models.expand): "=" keeps an axis's size


def _expansion_axes(path: tuple) -> tuple[str, str] | None:
  own = {
    ("markov_w1",): ("target", "V="),
    ("markov_w2",): ("target", "=V"),
    ("confidence_hidden", "kernel"): ("target", "D="),
    ("confidence_markov", "kernel"): ("target", "=="),
    ("confidence_bias",): ("target", "="),
  }
  return own.get(path) or dflash._expansion_axes(path)


# -- the training run's settings


TRAINING_FIELDS = {"confidence_weight": 1.0, "confidence_target": "greedy", "train_backbone": True}


def _check_training(config) -> None:
  """The sequential block drafter's `config.head` fields: the block drafter's, its
  rank, and its loss's (ValueError naming the field and its range)."""
  dflash._check_training(config)
  head = config.head
  low, high = DSparkConfig.RANGES["markov_rank"]
  rank = head.get("markov_rank", 32)
  if not isinstance(rank, int) or isinstance(rank, bool) or not low <= rank <= high:
    raise ValueError(f"config.head.markov_rank must be an int in [{low}, {high}], got {rank!r}.")
  weight = head.get("confidence_weight", 1.0)
  if not is_real(weight) or not 0 <= weight < float("inf"):
    raise ValueError(f"config.head.confidence_weight must be a finite number >= 0, got {weight!r}.")
  target = head.get("confidence_target", "greedy")
  if target not in CONFIDENCE_TARGETS:
    raise ValueError(f"config.head.confidence_target must be one of {CONFIDENCE_TARGETS}, got {target!r}.")
  for name in ("confidence_head", "confidence_with_markov", "train_backbone"):
    if not isinstance(head.get(name, True), bool):
      raise ValueError(f"config.head.{name} must be a bool, got {head.get(name)!r}.")
  if not head.get("train_backbone", True) and config.weight_decay:
    raise ValueError(
      "config.weight_decay must be 0 with config.head.train_backbone=False (decay would "
      f"move the frozen backbone), got {config.weight_decay}."
    )


def _loss_settings(head) -> dict:
  return dict(
    dflash._loss_settings(head),
    confidence_weight=float(head.get("confidence_weight", 1.0)),
    confidence_target=str(head.get("confidence_target", "greedy")),
    train_backbone=bool(head.get("train_backbone", True)),
  )


def warm_start(head: DSparkHead, target: Transformer, settings) -> DSparkHead:
  """`head` with its block drafter's parameters from the block drafter `backbone`
  (`config.head.backbone`: a DFlash head directory, a run, or "bundled"): the same
  settings but the two heads', which stay fresh (W2 = 0: it drafts what the backbone
  drafts). ValueError naming the field for a backbone of other settings."""
  from specjax import pretrained
  from specjax.heads import files

  where = settings.get("backbone", "") or "bundled"
  if where == "bundled":
    backbone = pretrained.load_head("dflash", target)
  else:
    cfg = files.read_config(where)
    if cfg.kind != "dflash":
      raise ValueError(f"config.head.backbone must be a dflash head, {where} holds a {cfg.kind} head.")
    backbone = files.read_head(where, cfg, jnp.float32)
  want = {f.name: getattr(head.cfg, f.name) for f in dataclasses.fields(dflash.DFlashConfig)}
  have = {f.name: getattr(backbone.cfg, f.name) for f in dataclasses.fields(dflash.DFlashConfig)}
  for name in want:
    if name != "target" and want[name] != have[name]:
      raise ValueError(
        f"config.head.{name} is {want[name]!r}, but the backbone {where} has {have[name]!r}."
      )
  head.cfg.check_target(backbone.cfg.target, "backbone's target")
  params = dict(nnx.to_flat_state(nnx.state(head, nnx.Param)))
  for path, variable in nnx.to_flat_state(nnx.state(backbone, nnx.Param)):
    params[path] = params[path].replace(variable.get_value().astype(params[path].get_value().dtype))
  nnx.update(head, nnx.from_flat_state(list(params.items())))
  return head


KIND = HeadKind(
  name="dspark",
  title="sequential block drafter",
  config=DSparkConfig,
  make=DSparkHead,
  drafter=DSparkDrafter,
  holds="head",
  objective=dspark_objective,
  read_priority=1,
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
    ),
    check=_check_training,
    loss=_loss_settings,
    warm_start=warm_start,
  ),
  expansion_axes=_expansion_axes,
  bundled=False,
)
