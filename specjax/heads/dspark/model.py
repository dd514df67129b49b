"""The sequential block drafter's settings and module: `DSparkConfig` (the block
drafter's settings and its two heads') and `DSparkHead` (a `DFlashHead` with a Markov
head and a confidence head).

Shapes: D width, V vocabulary, r the Markov head's rank (`markov_rank`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.heads.base import linear
from specjax.heads.dflash.model import DFlashConfig, DFlashHead


@dataclasses.dataclass(frozen=True)
class DSparkConfig(DFlashConfig):
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
  RANGES = {**DFlashConfig.RANGES, "markov_rank": (0, 1024)}

  markov_rank: int = 32
  confidence_head: bool = True
  confidence_with_markov: bool = True
  anchor_first: bool = False
  correct_first: bool = True

  def check_settings(self, layers):
    layers = super().check_settings(layers)
    self._check_bools("confidence_head", "confidence_with_markov", "anchor_first", "correct_first")
    return layers


class DSparkHead(DFlashHead):
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
