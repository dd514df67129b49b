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
from collections.abc import Collection

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
from specjax.heads import blocks as block_training
from specjax.heads import dflash, hub
from specjax.heads.base import HeadKind, TrainingRules, linear
from specjax.models import hub_names
from specjax.models.transformer import Transformer
from specjax.sampling import RowSampling, SamplingParams
from specjax.validation import is_int
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
    anchor_first: False: the block drafter's alignment (slot j >= 1 gives the law of
      the token at its own position: B - 1 drafts per block; the bundled backbone's);
      True: DeepSpec's (slot j gives the law of the token after it, the anchor's slot
      too: B drafts per block; the published checkpoints').
    correct_first: whether the first draft's law is corrected by s[-1] too (the
      reference's); False leaves it the block's own (s[-1] is already the block's
      first input), the Markov head correcting the drafts after it.
  """

  kind = "dspark"
  RANGES = {**dflash.DFlashConfig.RANGES, "markov_rank": (0, 1024)}

  markov_rank: int = 32
  confidence_head: bool = True
  confidence_with_markov: bool = True
  anchor_first: bool = False
  correct_first: bool = True

  def check_settings(self, layers):
    layers = super().check_settings(layers)
    self._check_bools("confidence_head", "confidence_with_markov", "anchor_first", "correct_first")
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

  @property
  def first_draft_slot(self) -> int:
    """0 for an anchor-first block (DeepSpec's), else the block drafter's 1."""
    return 0 if self.cfg.anchor_first else 1

  def markov_embed(self, previous: jax.Array) -> jax.Array | None:
    """W1[previous]: `[...]` token ids -> `[..., r]` (None without a Markov head)."""
    if not self.cfg.markov_rank:
      return None
    return jnp.take(self.markov_w1[...], previous, axis=0)

  def corrected(self, base: jax.Array, embed: jax.Array | None, first=False) -> jax.Array:
    """Base logits `[..., V]` corrected by `embed [..., r]` (W1 of the token before):
    float32 `[..., V]`; -inf entries (a vocabulary subset) stay -inf. `first`: a bool
    or a bool array broadcasting to `[...]`, where the law is the first draft's, left
    uncorrected unless `correct_first`."""
    if embed is None:
      return base
    bias = jnp.einsum(
      "...r,rv->...v", embed.astype(jnp.float32), self.markov_w2[...].astype(jnp.float32)
    )
    if not self.cfg.correct_first:
      bias = jnp.where(jnp.asarray(first)[..., None], 0.0, bias)
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
  gives_confidence = True  # its chains carry the confidence head's estimates

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
      law = head.corrected(base[:, i], embed, first=i == 0)
      token, q, rule = draw_chain_token(i, law, rule, sampling, draw)
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

    root = head.corrected(base[:, 0], head.markov_embed(last), first=True)
    tokens, probs = draft_tree(parents, self.tree_mode, sampling, key, root, read, constraint)
    lengths = jnp.full((base.shape[0],), len(parents), jnp.int32)
    return Proposal(tokens, probs, lengths, jnp.int32(1), trees.Tree.static(parents))


# -- training


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
  p, q = jax.nn.softmax(p_logits), jax.nn.softmax(q_logits)
  if settings.confidence_target == "greedy":
    accept = (q_logits.argmax(-1) == p_logits.argmax(-1)).astype(jnp.float32)
  else:
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


def backbone(head: DSparkHead) -> dflash.DFlashHead:
  """The block drafter inside `head`: a `DFlashHead` of the same settings holding its
  backbone's parameters (what drafts without the two heads; the bundled block drafter is
  the bundled sequential one's backbone)."""
  fields = {f.name: getattr(head.cfg, f.name) for f in dataclasses.fields(dflash.DFlashConfig)}
  cfg = dflash.DFlashConfig(**fields)
  return block_training.transfer(
    dflash.DFlashHead(cfg, rngs=nnx.Rngs(0)), head, "the sequential drafter"
  )


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
  settings = dflash.DFlashLoss(num_anchors=num_anchors, loss_decay=1.0)
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


# -- growth with the target (specjax.models.expand): "=" keeps an axis's size


def _expansion_axes(path: tuple) -> tuple[str, str] | None:
  own = {
    ("markov_w1",): ("target", "V="),
    ("markov_w2",): ("target", "=V"),
    ("confidence_hidden", "kernel"): ("target", "D="),
    ("confidence_markov", "kernel"): ("target", "=="),
    ("confidence_bias",): ("target", "="),
  }
  return own.get(path) or dflash.expansion_axes(path)


# -- the training run's settings


TRAINING_FIELDS = {
  "confidence_target": "sampled",
  "train_backbone": True,
  "train_only": "",
}
# Real-valued ones, {field: (default, low, high)} (high None: unbounded).
LOSS_FIELDS = {"confidence_weight": (1.0, 0.0, None), "base_weight": (0.5, 0.0, None)}


def _check_training(config) -> None:
  """The sequential block drafter's `config.head` fields: the block drafter's, its
  rank, and its loss's (ValueError naming the field and its range)."""
  dflash.check_training(config)
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
class DSparkLoss(dflash.DFlashLoss):
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
      **dataclasses.asdict(dflash.DFlashLoss.from_config(head)),
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
  if not isinstance(source, dflash.DFlashHead):
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


# -- the hub layout: DeepSpec's DSpark drafter (`Qwen3DSparkModel`)
#
# DSpark's published checkpoints (DeepSeek's DeepSpec, e.g. deepseek-ai/dspark_qwen3_8b_block7;
# served by vLLM's `qwen3_dspark.py`, SGLang's `dspark.py`, llama.cpp's `dspark` arch,
# TensorRT-LLM's `modeling_dspark.py`, vllm-project/speculators' `models/dspark`) are a
# DFlash drafter (`dflash`'s `DFlashDraftModel` layout: its tensors and Qwen3 fields, read
# and written by `dflash.hub_fields` / `dflash.hub_tensors`) plus, torch `[out, in]`:
#   markov_head.markov_w1.weight  [V, r]     an embedding of the token before (W1)
#   markov_head.markov_w2.weight  [V, r]     a Linear r -> V (W2, specjax's [r, V] transposed)
#   confidence_head.proj.weight   [1, D + r] over concat(h, W1[prev]), or [1, D] without
#                                            the Markov input (`confidence_head_with_markov`)
#   confidence_head.proj.bias     [1]        optional (DeepSeek-V4's has none): absent is 0
#   embed_tokens.weight, lm_head.weight      optional: the reference keeps frozen copies of
#                                            the target's; read only if equal to the
#                                            target's, written when saving a drafter
# logits' = logits + W2 . W1[prev] (prev_0 = the anchor s[-1], prev_i = draft i - 1), the
# confidence sigmoid(proj(...)): `DSparkHead` exactly. config.json: architectures
# `Qwen3DSparkModel` (written) or `DSparkDraftModel`; the DSpark fields `markov_rank`,
# `markov_head_type` ("vanilla" only: the bias from the previous token alone; "gated" and
# "rnn" are refused naming the field), `enable_confidence_head`,
# `confidence_head_with_markov`, and DFlash's `mask_token_id`, `target_layer_ids`,
# `block_size`, each looked up in `dspark_config`, then `dflash_config`, then the top level
# (the runtimes' lookups; DeepSpec's own configs are flat). Written in all three places that
# runtimes read: the top level, `dspark_config`, and `dflash_config` as `dflash` writes it.
# Writing never drops a parameter: the confidence head's parts (`confidence_hidden`,
# `confidence_markov`, `confidence_bias`) are concatenated into `proj.weight` / `proj.bias`;
# a head of markov_rank 0 writes no Markov tensors and `markov_rank: 0`.
#
# The block's alignment: DeepSpec's DSpark blocks are anchor-first (every slot, the
# anchor's included, gives the law of the token after it: B drafts per block), specjax's
# block drafter's are not (slot k >= 1 gives its own position's: B - 1). `anchor_first`
# says which; a file without the field (DeepSpec's) reads as anchor-first, and `write`
# writes the field, so a head trained on the block drafter's alignment (the bundled one)
# reads back as it is; DeepSpec's runtimes ignore the field and would misalign such a file.
#
# What is not settled: no published checkpoint is reachable offline here, so the names and
# fields follow the runtimes' public descriptions, not a downloaded file.

ARCHITECTURES = ("Qwen3DSparkModel", "DSparkDraftModel")
SPELLING = dflash.HubSpelling(ARCHITECTURES, ("dspark_config", "dflash_config"))
MARKOV_HEAD_TYPES = ("vanilla",)
_PROJ = "confidence_head.proj"


def recognises(config: dict, file: str, keys: Collection[str]) -> bool:
  """Whether a head directory is a DSpark drafter's: a `dspark_config`, a DSpark
  architecture, or Markov / confidence tensors (`from_hub` names what it does not read)."""
  del file
  return dflash.derived_layout(config, keys)


def _names(cfg: DSparkConfig) -> dict[str, list[hub_names.Target]]:
  """Hub name -> `[(path, transform, part)]` of the two heads (reading: `proj.weight`'s
  columns split into the hidden part [D, 1] and the Markov part [r, 1])."""
  same, d, r = hub_names.same, cfg.target.d_model, cfg.markov_rank
  names = {}
  if r:
    names["markov_head.markov_w1.weight"] = [(("markov_w1",), same, None)]
    names["markov_head.markov_w2.weight"] = [(("markov_w2",), hub_names.transpose, None)]
  if cfg.confidence_head:
    parts = [(("confidence_hidden", "kernel"), lambda w: w[:, :d].T, None)]
    if r and cfg.confidence_with_markov:
      parts.append((("confidence_markov", "kernel"), lambda w: w[:, d:].T, None))
    names[f"{_PROJ}.weight"] = parts
    names[f"{_PROJ}.bias"] = [(("confidence_bias",), same, None)]
  return names


def _target_tensors(target: Transformer) -> dict[str, np.ndarray]:
  """The target's embedding and output head as the reference's files copy them,
  `embed_tokens.weight` and `lm_head.weight`, both `[V, D]`, in the target's dtype."""
  embed = np.asarray(target.embed.embedding[...])
  head = embed if target.cfg.tie_embeddings else np.asarray(target.lm_head[...]).T
  return {"embed_tokens.weight": embed, "lm_head.weight": head}


def _heads_fields(config: dict, t, keys: Collection[str]) -> dict:
  """`DSparkConfig`'s own fields from a DSpark config.json; ValueError naming the field."""
  rank, where = SPELLING.lookup(config, "markov_rank", 0)
  low, high = DSparkConfig.RANGES["markov_rank"]
  if not is_int(rank) or not low <= rank <= high:
    raise ValueError(f"config {where} is {rank!r}; specjax reads an int in [{low}, {high}].")
  markov = [k for k in keys if k.startswith("markov_head.")]
  if not rank and markov:
    raise ValueError(f"config {where} is 0, but the file holds tensor {sorted(markov)[0]}.")
  kind, where = SPELLING.lookup(config, "markov_head_type", "vanilla")
  if rank and kind not in MARKOV_HEAD_TYPES:
    raise ValueError(
      f"config {where} is {kind!r}; specjax reads {MARKOV_HEAD_TYPES[0]!r} only (the bias "
      "from the token before alone, not gated by the hidden state nor carried over the block)."
    )
  flags = {}
  for key in ("enable_confidence_head", "confidence_head_with_markov"):
    flags[key], where = SPELLING.lookup(config, key, False)
    if not isinstance(flags[key], bool):
      raise ValueError(f"config {where} is {flags[key]!r}; specjax reads a bool.")
  confidence, with_markov = flags["enable_confidence_head"], flags["confidence_head_with_markov"]
  if confidence and with_markov and not rank:
    raise ValueError(
      f"config {where} is true, but markov_rank is 0: there is no Markov embedding to read."
    )
  vocab, where = SPELLING.lookup(config, "draft_vocab_size", t.vocab_size)
  if vocab != t.vocab_size:
    raise ValueError(
      f"config {where} is {vocab!r}; specjax's drafter drafts over the target's "
      f"{t.vocab_size} ids (no reduced draft vocabulary)."
    )
  # specjax's own fields (absent: the reference's anchor-first blocks, first law corrected)
  own = {}
  for key in ("anchor_first", "correct_first"):
    own[key], where = SPELLING.lookup(config, key, True)
    if not isinstance(own[key], bool):
      raise ValueError(f"config {where} is {own[key]!r}; specjax reads a bool.")
  return dict(
    markov_rank=int(rank),
    **own,
    confidence_head=confidence,
    # a flag without effect (no confidence head or no Markov head) reads as the default
    confidence_with_markov=(
      with_markov if confidence and rank else DSparkConfig.confidence_with_markov
    ),
  )


def from_hub(
  config: dict, tensors: dict[str, np.ndarray], target: Transformer, dtype
) -> DSparkHead:
  """A `DSparkHead` for `target` from a DSpark config.json and its tensors (`write`'s);
  ValueError naming the field or tensor that does not fit `target`, or that specjax does
  not compute (a "gated" or "rnn" Markov head, a copy of the embedding or output head
  other than the target's)."""
  t = target.cfg
  fields, tensors = dflash.hub_fields(config, tensors, t, dtype, SPELLING)
  cfg = DSparkConfig(**fields, **_heads_fields(config, t, tensors.keys()))
  for name, want in _target_tensors(target).items():
    if name in tensors:
      got = np.asarray(tensors.pop(name))
      same = got.shape == want.shape and np.array_equal(
        got.astype(np.float32), want.astype(got.dtype).astype(np.float32)
      )
      if not same:
        raise ValueError(
          f"tensor {name} is not this target's: specjax's drafter reads the target's own "
          "embedding and output head (the reference's file keeps frozen copies of them)."
        )
  r, d = cfg.markov_rank, t.d_model
  if cfg.confidence_head and f"{_PROJ}.weight" in tensors:
    width = d + (r if cfg.confidence_with_markov else 0)
    shape = np.shape(tensors[f"{_PROJ}.weight"])
    if shape != (1, width):
      _, where = SPELLING.lookup(config, "confidence_head_with_markov")
      raise ValueError(
        f"tensor {_PROJ}.weight has shape {shape}; this target needs (1, {width}): the hidden "
        f"state's {d}" + (f" and the Markov embedding's {r} ({where} true)." if width > d else ".")
      )
  names = dflash.tensor_names(cfg, cfg.d_ff or t.d_ff, bias=True) | _names(cfg)
  return dflash.read_hub_head(cfg, names, tensors, dtype)


def hub_config(head: DSparkHead) -> dict:
  """The drafter's config.json: `dflash.hub_config`'s, a DSpark architecture, and the
  DSpark fields at the top level (DeepSpec's flat configs) and in `dspark_config`."""
  cfg, config = head.cfg, dflash.hub_config(head)
  r = cfg.markov_rank
  own = {
    "mask_token_id": cfg.mask_token_id,
    "target_layer_ids": config["dflash_config"]["target_layer_ids"],
    "block_size": cfg.block_size,
    "markov_rank": r,
    "markov_head_type": MARKOV_HEAD_TYPES[0],
    "enable_confidence_head": cfg.confidence_head,
    "confidence_head_with_markov": bool(cfg.confidence_head and r and cfg.confidence_with_markov),
    "anchor_first": cfg.anchor_first,
    "correct_first": cfg.correct_first,
  }
  # The reference's class also requires `num_anchors`, a training setting specjax's head
  # does not record: the block drafter's default.
  anchors = dflash.TRAINING_FIELDS["num_anchors"][0]
  config = {**config, "architectures": [ARCHITECTURES[0]], **own, "num_anchors": anchors}
  return {**config, "dspark_config": own}


def write(head: DSparkHead, target: Transformer | None = None) -> tuple[dict, dict]:
  """`(config.json, {name: tensor})` of the drafter in the DSpark layout: the block
  drafter's tensors (`dflash.hub_tensors`), the Markov head's, the confidence head's parts
  in one `proj.weight` [1, D + r] (or [1, D]) and `proj.bias`; and, given the drafter's
  `target`, its embedding and output head as the reference's files copy them. ValueError
  naming what the layout cannot hold (nothing is dropped)."""
  cfg = head.cfg
  params = hub.flat_params(head)
  names = _names(cfg)
  proj = names.pop(f"{_PROJ}.weight", [])  # its columns are two parameters': joined here
  own, held = hub.named_tensors(params, names)
  if proj:
    own[f"{_PROJ}.weight"] = np.concatenate([params[path] for path, _, _ in proj], axis=0).T
    held |= {path for path, _, _ in proj}
  if target is not None:
    own |= _target_tensors(target)
  return hub_config(head), dflash.hub_tensors(head, own, held, ARCHITECTURES[0])


KIND = HeadKind(
  name="dspark",
  title="sequential block drafter",
  config=DSparkConfig,
  make=DSparkHead,
  drafter=DSparkDrafter,
  holds="head",
  objective=dspark_objective,
  hub=hub.HubLayout(
    f"{ARCHITECTURES[0]} (DeepSpec DSpark)", hub.LLAMA_FILES, recognises, from_hub, write
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
    check=_check_training,
    loss=DSparkLoss,
    warm_start=warm_start,
  ),
  expansion_axes=_expansion_axes,
)
