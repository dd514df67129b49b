"""The block drafter's settings and module: `DFlashConfig` (and the feature layers it reads
by default, `block_feature_layers`, or by DFlash's rule, `dflash_feature_layers`),
`DFlashLayer` and `DFlashHead`, its training form and its drafting form.

Shapes: B batch, T positions, N block positions in one call, S context slots, D width,
F the target's fused features (`num_features * D`), K kv heads, H head dim, V vocabulary.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.heads.base import HeadConfig, HeadConfigError, linear
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache, write_layer
from specjax.models.transformer import MLP, Norm, Transformer, apply_rope, attend, rope_inv_freq
from specjax.validation import is_int


@dataclasses.dataclass(frozen=True)
class DFlashConfig(HeadConfig):
  """A block drafter's settings (besides `HeadConfig`'s; `d_ff` is its layers' MLP
  width). `feature_layers`' `()` picks `block_feature_layers(L)`: up to five layers,
  from shallow to the last (DFlash's own rule, `dflash_feature_layers`, reads
  `draft_layers` of them and never the last few).

  Attributes:
    block_size: B in `RANGES`: one call drafts the B - 1 tokens after s[-1].
    draft_layers: the drafter's decoder layers, in `RANGES`.
    mask_token_id: the id whose embedding fills the block's B - 1 slots, in
      [0, V) (a tokenizer's spare id, as the hub checkpoints use), or -1: a
      learned embedding of the drafter's own (a tokenizer with no spare id).
  """

  kind = "dflash"
  # Each int setting's inclusive range: the one statement of them (the config, the
  # training run's `config.head` and the hub reader check against it).
  RANGES = {"block_size": (2, 64), "draft_layers": (1, 16)}

  block_size: int = 16
  draft_layers: int = 1
  mask_token_id: int = -1

  def check_settings(self, layers):
    for name, (low, high) in self.RANGES.items():
      value = getattr(self, name)
      if not is_int(value) or not low <= value <= high:
        raise HeadConfigError(f"{name} must be an int in [{low}, {high}], got {value!r}.")
    v = self.target.vocab_size
    if not is_int(self.mask_token_id) or not -1 <= self.mask_token_id < v:
      raise HeadConfigError(
        f"mask_token_id must be an int in [0, {v}) or -1 (a learned mask embedding), "
        f"got {self.mask_token_id!r}."
      )
    return layers or block_feature_layers(self.target.n_layers)


# The most target layers a block drafter reads by default (DSpark's published drafters
# read five, from shallow to the last).
MOST_FEATURE_LAYERS = 5


def block_feature_layers(n_layers: int, most: int = MOST_FEATURE_LAYERS) -> tuple[int, ...]:
  """The layer counts a block drafter reads by default on a target of `n_layers`: as
  many as the target has up to `most`, spread evenly from shallow to the last layer
  (the last included: its features are the ones the target's own next-token law reads).
  The first layer is skipped when there are more layers than reads (DFlash's ids start
  at 1, count 2). (2, 3, 4, 5, 6) on a 6-layer target; (2, 7, 12, 17, 22) on 22."""
  n = n_layers
  k = min(most, n)
  first = 2 if n > k else 1
  if k == 1:
    return (n,)
  return tuple(sorted({int(round(first + i * (n - first) / (k - 1))) for i in range(k)}))


def dflash_feature_layers(n_layers: int, draft_layers: int) -> tuple[int, ...]:
  """The layer counts DFlash's published drafters of `draft_layers` layers read on a
  target of `n_layers` (DFlash's rule, as counts: layer id i is count i + 1): one layer reads
  the middle; several read ids spread evenly from 1 to L - 3, rounded. On targets
  too shallow for that (L < 5), counts spread evenly over [1, L], distinct."""
  n, k = n_layers, draft_layers
  if k == 1:
    return (n // 2 + 1,)
  if n >= 5:
    ids = [int(round(1 + i * (n - 4) / (k - 1))) for i in range(k)]
    return tuple(sorted({i + 1 for i in ids}))
  return tuple(sorted({int(round(1 + i * (n - 1) / (k - 1))) for i in range(k)}))


class DFlashLayer(nnx.Module):
  """One block-drafter layer: the block's queries read the context's keys and values
  (the fused target features, projected by this layer) and the whole block's own,
  bidirectionally; pre-norm attention with per-head q/k norms, then an MLP.

  Context and block keys go through the same `k_proj` and `k_norm` and RoPE at
  their own positions, so a cache of the context's keys (`context_kv`) serves
  every later block (`DFlashHead`)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    d, h = cfg.d_model, cfg.resolved_head_dim
    self.input_layernorm = Norm(cfg)
    self.q_proj = linear(cfg, d, cfg.n_heads * h, rngs=rngs, bias=cfg.qkv_bias)
    self.k_proj = linear(cfg, d, cfg.n_kv_heads * h, rngs=rngs, bias=cfg.qkv_bias)
    self.v_proj = linear(cfg, d, cfg.n_kv_heads * h, rngs=rngs, bias=cfg.qkv_bias)
    self.o_proj = linear(cfg, cfg.n_heads * h, d, rngs=rngs, bias=cfg.out_bias)
    self.q_norm = Norm(cfg, h, "head_dim")
    self.k_norm = Norm(cfg, h, "head_dim")
    self.post_attention_layernorm = Norm(cfg)
    self.mlp = MLP(cfg, rngs=rngs)

  def context_kv(self, x: jax.Array, positions: jax.Array, inv_freq: jax.Array):
    """Keys and values `[B, K, T, H]` of inputs `x [B, T, D]` at `positions [B, T]`."""
    (b, t, _), c = x.shape, self.cfg
    k = self.k_norm(self.k_proj(x).reshape(b, t, c.n_kv_heads, c.resolved_head_dim))
    k = apply_rope(k, positions, inv_freq)
    v = self.v_proj(x).reshape(b, t, c.n_kv_heads, c.resolved_head_dim)
    return jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)

  def __call__(self, x, positions, context_k, context_v, mask, inv_freq):
    """Block `x [B, N, D]` at `positions [B, N]` -> `[B, N, D]`; it reads the context's
    `context_k, context_v [B, K, S, H]` and its own N keys, as `mask [B, N, S + N]`
    allows."""
    (b, n, _), c = x.shape, self.cfg
    normed = self.input_layernorm(x)
    q = self.q_norm(self.q_proj(normed).reshape(b, n, c.n_heads, c.resolved_head_dim))
    q = apply_rope(q, positions, inv_freq)
    k, v = self.context_kv(normed, positions, inv_freq)
    keys = jnp.concatenate([context_k.astype(k.dtype), k], axis=2)
    values = jnp.concatenate([context_v.astype(v.dtype), v], axis=2)
    out = attend(q, keys, values, mask, c.attn_scale)
    x = x + self.o_proj(out.reshape(b, n, c.n_heads * c.resolved_head_dim))
    return x + self.mlp(self.post_attention_layernorm(x))


class DFlashHead(nnx.Module):
  """A block drafter (DFlash): drafts the B - 1 tokens after s[-1] in one call.

  The target's features after `cfg.feature_layers` layers, concatenated `[.., F]`,
  become the context `hidden_norm(fc(f))` `[.., D]`; each layer keeps its own keys
  and values of the context (a `KVCache`, slot p: position p). The block is
  `[s[-1], m, ..., m]` at positions len(s) - 1 .. len(s) + B - 2 (m: the mask
  token's embedding); after the layers, `norm` and the target's own head give
  the law of the token at each of the B - 1 mask positions. Embeddings and head
  are the target's (shared, frozen); only this module trains.
  """

  def __init__(self, cfg: DFlashConfig, *, rngs: nnx.Rngs):
    if not isinstance(cfg, DFlashConfig):
      raise ValueError(f"DFlashHead needs a DFlashConfig, got {type(cfg).__name__}.")
    self.cfg = cfg
    c = self.layer_config
    d = c.d_model
    self.fc = linear(c, cfg.num_features * d, d, rngs=rngs, bias=False)
    self.hidden_norm = Norm(c)
    self.layers = nnx.List([DFlashLayer(c, rngs=rngs) for _ in range(cfg.draft_layers)])
    self.norm = Norm(c)
    if cfg.mask_token_id < 0:  # no spare id in the target's vocabulary: a learned one
      init = nnx.initializers.normal(c.init_std)
      self.mask_embedding = nnx.Param(init(rngs.params(), (d,), c.weight_dtype))

  @property
  def layer_config(self) -> ModelConfig:
    """The layers' config: the target's widths, `cfg.d_ff`, RoPE at the target's
    base (for any target: the block's order comes from RoPE), global attention."""
    t = self.cfg.target
    local = None if t.local_layers is None else ()
    return t.replace(
      n_layers=self.cfg.draft_layers, d_ff=self.cfg.d_ff or t.d_ff, local_layers=local
    )

  @property
  def first_draft_slot(self) -> int:
    """The block slot whose output is the first draft's law: 1 (DFlash: slot j >= 1, a
    mask, gives the law of the token at its own position)."""
    return 1

  @property
  def drafts_per_call(self) -> int:
    """Tokens one block call drafts: the slots from `first_draft_slot` on."""
    return self.cfg.block_size - self.first_draft_slot

  def _inv_freq(self) -> jax.Array:
    c = self.layer_config
    return rope_inv_freq(c.resolved_head_dim, c.rope_theta, c.rope_scaling)

  def init_cache(self, batch: int, capacity: int) -> KVCache:
    """An empty context cache: one layer of keys and values per drafter layer."""
    c = self.layer_config
    return KVCache.zeros(
      n_layers=self.cfg.draft_layers,
      batch=batch,
      capacity=capacity,
      n_kv_heads=c.n_kv_heads,
      head_dim=c.resolved_head_dim,
      dtype=c.compute_dtype,
    )

  def context(self, features: jax.Array) -> jax.Array:
    """The target's features `[..., F]` -> the context `[..., D]`."""
    return self.hidden_norm(self.fc(features.astype(self.fc.kernel.dtype)))

  def write_context(self, features: jax.Array, cache: KVCache, starts: jax.Array) -> KVCache:
    """`cache` with the context of `features [B, T, F]` (positions starts..starts+T-1)
    written at slots `starts [B]` of every layer; lengths unchanged (the caller's)."""
    x, t = self.context(features), features.shape[1]
    positions = starts[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    inv_freq, new_k, new_v = self._inv_freq(), [], []
    for layer, k, v in zip(self.layers, cache.k, cache.v):
      ck, cv = layer.context_kv(x, positions, inv_freq)
      k, v, _ = write_layer((k, v), ck, cv, starts)
      new_k.append(k)
      new_v.append(v)
    return cache.replace(k=tuple(new_k), v=tuple(new_v))

  def block_inputs(self, target: Transformer, last: jax.Array, num_blocks: int = 1):
    """`[B, num_blocks * B_size, D]`: each block `[embed(last[:, j]), m, ..., m]`
    for `last [B, num_blocks]` (or `[B]`)."""
    last = last.reshape(last.shape[0], -1)
    b, a = last.shape
    first = target.embed(last)  # [B, A, D]
    if self.cfg.mask_token_id >= 0:
      mask = target.embed(jnp.asarray(self.cfg.mask_token_id, jnp.int32))
    else:
      mask = self.mask_embedding[...]
    n, d = self.cfg.block_size, first.shape[-1]
    mask = jnp.broadcast_to(mask.astype(first.dtype), (b, a, n - 1, d))
    return jnp.concatenate([first[:, :, None], mask], axis=2).reshape(b, a * n, d)

  def run(self, x, positions, context_kv, mask) -> jax.Array:
    """The layers on blocks `x [B, N, D]` at `positions [B, N]` reading each layer's
    `context_kv` pair as `mask [B, N, S + N]` allows -> normed `[B, N, D]`."""
    inv_freq = self._inv_freq()
    for layer, (k, v) in zip(self.layers, context_kv):
      x = layer(x, positions, k, v, mask, inv_freq)
    return self.norm(x)

  def logits(self, target: Transformer, h: jax.Array, vocab_subset=None) -> jax.Array:
    """Normed outputs `[..., D]` -> float32 logits `[..., V]` by the target's head
    (-inf off `vocab_subset [K]` when given: FR-Spec)."""
    return target.head_logits(h, vocab_subset)

  def draft_logits(
    self, target: Transformer, cache: KVCache, last: jax.Array, vocab_subset=None, count=None
  ) -> jax.Array:
    """Drafting: the block after each row's cached context (`cache.lengths` =
    len(s) - 1) and `last [B]` = s[-1] -> logits `[B, count, V]` of the tokens at
    positions len(s) .. len(s) + count - 1 (static `count`, default B_size - 1:
    the head projects only those)."""
    return self.logits(target, self.draft_hidden(target, cache, last, count), vocab_subset)

  def draft_hidden(
    self, target: Transformer, cache: KVCache, last: jax.Array, count=None
  ) -> jax.Array:
    """`draft_logits`' normed outputs `[B, count, D]`, before the target's head."""
    b, n = last.shape[0], self.cfg.block_size
    positions = cache.lengths[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]
    slots = jnp.arange(cache.capacity, dtype=jnp.int32)
    context = slots[None, None, :] < cache.lengths[:, None, None]
    context = jnp.broadcast_to(context, (b, n, slots.size))
    mask = jnp.concatenate([context, jnp.ones((b, n, n), bool)], axis=2)
    h = self.run(self.block_inputs(target, last), positions, zip(cache.k, cache.v), mask)
    first = self.first_draft_slot
    return h[:, first : first + (count or self.drafts_per_call)]

  def __call__(self, target: Transformer, features, tokens, anchors) -> jax.Array:
    """Training form: `train_hidden`'s outputs through the target's head, `[B, A,
    B_size - 1, V]` logits of the tokens at a_j + 1 .. a_j + B_size - 1."""
    return self.logits(target, self.train_hidden(target, features, tokens, anchors))

  def train_hidden(self, target: Transformer, features, tokens, anchors) -> jax.Array:
    """Training form: A blocks per row in one call, each exactly as drafting sees it.

    Args:
      features: `[B, T, F]` the target's features at positions 0..T-1.
      tokens: `[B, T]` the tokens at those positions.
      anchors: `[B, A]` int32 in [1, T): block j starts with `tokens[:, a_j]` at
        position a_j and reads the context at positions < a_j.

    Returns:
      `[B, A, B_size - 1, D]` normed outputs at the block's mask positions, those
      whose laws are of the tokens at a_j + 1 .. a_j + B_size - 1.
    """
    (b, t), a, n = tokens.shape, anchors.shape[1], self.cfg.block_size
    x = self.context(features)
    inv_freq = self._inv_freq()
    ctx_positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    context_kv = [layer.context_kv(x, ctx_positions, inv_freq) for layer in self.layers]
    last = jnp.take_along_axis(tokens, anchors, axis=1)
    positions = (anchors[:, :, None] + jnp.arange(n, dtype=jnp.int32)).reshape(b, a * n)
    block_of = jnp.repeat(jnp.arange(a), n)
    reads_context = jnp.arange(t)[None, None, :] < jnp.repeat(anchors, n, axis=1)[:, :, None]
    same_block = jnp.broadcast_to(block_of[:, None] == block_of[None, :], (b, a * n, a * n))
    mask = jnp.concatenate([reads_context, same_block], axis=2)
    h = self.run(self.block_inputs(target, last, a), positions, context_kv, mask)
    first = self.first_draft_slot
    return h.reshape(b, a, n, -1)[:, :, first : first + self.drafts_per_call]
