"""The block drafter (DFlash, arXiv 2602.06036), everything it is: settings
(`DFlashConfig`), module (`DFlashHead`, `DFlashLayer`), drafter (`DFlashDrafter`),
z-lab/dflash's hub layout (`DFlashDraftModel`), training objective (`dflash_objective`),
growth rule and record.

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

import dataclasses
from collections.abc import Collection

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from specjax import trees
from specjax.coupling import chain_draws
from specjax.drafting.base import (
  Commit,
  DraftConstraint,
  DrafterBase,
  Proposal,
  VocabSubset,
  draw_chain_token,
)
from specjax.drafting.tree import (
  check_tree_depth,
  check_tree_gamma,
  check_tree_mode,
  draft_depth_tree,
)
from specjax.heads import hub
from specjax.heads.base import (
  HeadConfig,
  HeadConfigError,
  HeadKind,
  LossSettings,
  TrainingRules,
  linear,
)
from specjax.heads.blocks import block_batch, block_loss, check_reals, transfer
from specjax.models import hub_names
from specjax.models.config import ModelConfig
from specjax.models.expand import BLOCK_AXES
from specjax.models.fused import gate_up_parts
from specjax.models.hub_config import rope
from specjax.models.kv_cache import KVCache, check_capacity, write_layer
from specjax.models.transformer import MLP, Norm, Transformer, apply_rope, attend, rope_inv_freq
from specjax.sampling import RowSampling, SamplingParams
from specjax.validation import is_int
from specjax.vocab import fit_ids

DRAFT_MODES = ("sample", "argmax")


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


# -- drafting


@struct.dataclass
class DFlashState:
  """The head's context cache: keys and values of s[:-1] (lengths len(s) - 1)."""

  cache: KVCache


@struct.dataclass
class DFlashDrafter(DrafterBase, VocabSubset):
  """Drafts a block of up to B - 1 tokens per iteration with one `DFlashHead` call.

  Attributes:
    target: the target (its embedding and head are shared).
    head: the trained `DFlashHead` for this target's shape.
    draft: "sample" (each token drawn from its position's warped law, q that law)
      or "argmax" (each position's most likely token, q one-hot). At temperature
      0 both draft the argmax.
    vocab_subset: None, or `[K]` ids to draft among (FR-Spec; `with_vocab_subset`).
    tree: None (a chain of gamma tokens), or a static breadth-first token tree
      of depth <= block_size - 1 (`specjax.trees`); then gamma is its number of
      nodes and `draft` does not apply (siblings follow `tree_mode`).
    tree_mode: how a tree's siblings are drawn, "without_replacement" or "iid".
  """

  target: Transformer
  head: DFlashHead
  draft: str = struct.field(pytree_node=False, default="sample")
  vocab_subset: jax.Array | None = None
  tree: tuple[int, ...] | None = struct.field(pytree_node=False, default=None)
  tree_mode: str = struct.field(pytree_node=False, default="without_replacement")

  prefill_calls = 1
  constrained_drafts = True
  takes_tree = True

  def __post_init__(self):
    self.head.cfg.check_target(self.target.cfg)
    if self.draft not in DRAFT_MODES:
      raise ValueError(f"draft must be one of {DRAFT_MODES}, got {self.draft!r}.")
    check_tree_mode(self.tree_mode)
    if self.tree is not None:
      object.__setattr__(self, "tree", trees.check_drafting_tree(self.tree))
      check_tree_depth(self.tree, self.max_tree_depth, "block_size - 1: one block position")

  @property
  def vocab_size(self) -> int:
    return self.target.cfg.vocab_size

  @property
  def target_features(self) -> tuple[int, ...]:
    return self.head.cfg.target_features

  @property
  def block_size(self) -> int:
    """In the `Drafter` protocol's terms (one call drafts block_size - 1 tokens): the
    head's block size B, or B + 1 for a head whose block of B drafts B (anchor-first)."""
    return self.head.drafts_per_call + 1

  @property
  def max_tree_depth(self) -> int:
    """The deepest tree it drafts: one block position per depth."""
    return self.head.drafts_per_call

  def check_capacity(self, prompt_width: int, max_new_tokens: int, gamma: int) -> None:
    most = self.head.drafts_per_call
    if self.tree is not None:
      check_tree_gamma(self.tree, gamma)
    elif not 1 <= gamma <= most:
      raise ValueError(
        f"gamma must be in [1, {most}] for a block drafter of block_size "
        f"{self.head.cfg.block_size} (one call drafts {most} tokens), got {gamma}."
      )
    check_capacity("dflash head", self.target.cfg.max_seq_len, prompt_width, max_new_tokens, gamma)

  def init(self, prompts, prompt_lengths, first, capacity, hidden=None) -> DFlashState:
    del first  # s[-1] enters each block; the context is s[:-1] = the prompt
    if hidden is None:
      raise ValueError("DFlashDrafter.init needs the target's features at the prompt (hidden).")
    b = prompts.shape[0]
    cache = self.head.init_cache(b, capacity)
    cache = self.head.write_context(hidden, cache, jnp.zeros((b,), jnp.int32))
    return DFlashState(cache.with_lengths(prompt_lengths))

  def propose(
    self,
    state: DFlashState,
    recent: jax.Array,
    key: jax.Array,
    limit: jax.Array,
    *,
    gamma: int,
    sampling: SamplingParams | RowSampling,
    constraint: DraftConstraint | None = None,
  ) -> tuple[Proposal, DFlashState]:
    last = fit_ids(recent[:, -1], self.vocab_size)
    if self.tree is not None:
      return self._propose_tree(state, last, key, sampling, constraint), state
    logits = self.head.draft_logits(self.target, state.cache, last, self.vocab_subset, gamma)
    b = logits.shape[0]
    argmax = sampling.greedy or self.draft == "argmax"
    draw = None if argmax else chain_draws(key, gamma, b)
    tokens, probs, rule = [], [], constraint
    for i in range(gamma):  # a static loop over positions: the masks advance in order
      token, q, rule = draw_chain_token(i, logits[:, i], rule, sampling, draw)
      tokens.append(token)
      if q is not None:
        probs.append(q)
    proposal = Proposal(
      jnp.stack(tokens, axis=1),
      jnp.stack(probs, axis=1) if probs else None,
      jnp.minimum(limit, gamma).astype(jnp.int32),
      jnp.int32(1),
    )
    return proposal, state

  def _propose_tree(self, state, last, key, sampling, constraint) -> Proposal:
    depth = len(trees.levels(self.tree))
    # [B, depth, V]: block position d + 1's law gives every depth-d node's children
    logits = self.head.draft_logits(self.target, state.cache, last, self.vocab_subset, depth)
    return draft_depth_tree(self.tree, self.tree_mode, sampling, key, logits, constraint)

  def commit(self, state: DFlashState, commit: Commit) -> DFlashState:
    start = commit.old_length - 1  # the slot of s[-1], the first scored position
    cache = self.head.write_context(commit.hidden, state.cache, start)
    kept = commit.new_length - commit.old_length
    return DFlashState(cache.with_lengths(jnp.where(commit.goes_on, start + kept, start)))


# -- the hub layout: z-lab/dflash's DFlashDraftModel
#
# DFlash's hub layout, `DFlashDraftModel` as z-lab/dflash publishes it (a Qwen3 config;
# `model/dflash.py`, `dflash/model.py`): `write` writes it, `from_hub` reads it and
# `recognises` tells it apart. The module is `DFlashHead` above.
# DSpark's layout (`specjax.heads.dspark`) is built on this one: it reads the drafter's
# fields and tensors through `hub_fields` and `read_hub_head` (its own `HubSpelling`:
# architectures and config objects) and writes them through `hub_tensors`.
#
# The file holds the drafter's own layers: `fc.weight`, `hidden_norm.weight`,
# `layers.{i}.self_attn.{q,k,v,o}_proj.weight` (`.bias` with `attention_bias`),
# `layers.{i}.self_attn.{q,k}_norm.weight`, `layers.{i}.mlp.{gate,up,down}_proj.weight`,
# `layers.{i}.{input,post_attention}_layernorm.weight` and `norm.weight`, torch `[out, in]`.
# The block's embeddings and the logits are the target's (`embed_tokens`, `lm_head`),
# as in `DFlashHead`. config.json: Qwen3Config's fields for the layers (`num_hidden_layers`
# is the drafter's), `num_target_layers`, `block_size`, and `dflash_config`'s
# `mask_token_id` and `target_layer_ids`: 0-based ids of the target layers whose outputs
# are read (transformers' `hidden_states[id + 1]`), concatenated in that order for `fc`,
# where specjax's `feature_layers` are counts of layers (count = id + 1) and the target
# hands a head its features in depth order: ids are written ascending, and a file's
# ids in another order are read with `fc`'s input blocks put in depth order.
#
# Writing never drops a parameter: what the layout cannot hold is refused, naming it.
#   - a learned mask embedding (`mask_token_id=-1`): the layout fills the block with the
#     target's embedding of `mask_token_id`, an id; there is no tensor for one;
#   - MLP biases that are not zero: Qwen3's MLP has none;
#   - layers the Qwen3 ones do not compute: LayerNorm, `norm_offset`, GeGLU or GELU
#     MLPs, an attention scale other than head_dim ** -0.5.
# The layout says q/k/v/o biases with one flag (`attention_bias`): a head whose target
# has some of them gets zeros for the others, which compute nothing; reading, a bias the
# target's layers lack must be zero. A target's `logit_softcap` is written as
# `dflash_config.final_logit_softcapping`, which the reference applies to its logits.


ARCHITECTURE = "DFlashDraftModel"
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
# Qwen3Config's values for fields a config.json leaves out (transformers' defaults).
_QWEN3_DEFAULTS = dict(num_key_value_heads=32, head_dim=128, rms_norm_eps=1e-6, hidden_act="silu")


@dataclasses.dataclass(frozen=True)
class HubSpelling:
  """Where a layout built on `DFlashDraftModel`'s keeps its drafter's names: the
  `architectures` it reads (the first is written) and the config.json objects its
  drafter fields (`mask_token_id`, `target_layer_ids`, `block_size`, ...) are looked
  up in, in order, before the top level (the reference runtimes' lookups)."""

  architectures: tuple[str, ...]
  sections: tuple[str, ...]

  def lookup(self, config: dict, key: str, default=None) -> tuple:
    """`(value, where)`: the first section's `key`, else the top level's, else
    `default`; `where` names it as messages do ("dflash_config.mask_token_id")."""
    for section in self.sections:
      if key in (config.get(section) or {}):
        return config[section][key], f"{section}.{key}"
    if key in config:
      return config[key], key
    return default, f"{self.sections[0]}.{key}"


DFLASH_SPELLING = HubSpelling((ARCHITECTURE,), ("dflash_config",))


def recognises(config: dict, file: str, keys: Collection[str]) -> bool:
  """Whether a head directory's config.json is a DFlash drafter's (any of them:
  `from_hub` names the architectures it does not read), and not a DSpark one
  (`specjax.heads.dspark`: DFlash's fields and tensors plus a Markov and a confidence
  head, which a DFlash head would drop)."""
  if derived_layout(config, keys):
    return False
  architectures = config.get("architectures") or []  # tensors: EAGLE-1's names too (fc.weight)
  return "dflash_config" in config or any(str(a).startswith("DFlash") for a in architectures)


def _names(cfg: DFlashConfig, d_ff: int, bias: bool) -> dict[str, list[hub_names.Target]]:
  """Hub name -> `[(path, transform, part)]` of a drafter of `cfg` whose layers'
  MLPs are `d_ff` wide; with `bias`, the q/k/v/o biases too."""
  tr, same = hub_names.transpose, hub_names.same
  names = {"fc.weight": [(("fc", "kernel"), tr, None)]}
  names |= {f"{n}.weight": [((n, "scale"), same, None)] for n in ("hidden_norm", "norm")}
  for i in range(cfg.draft_layers):
    hub, at = f"layers.{i}.", ("layers", i)
    for p in _PROJECTIONS:
      names[f"{hub}self_attn.{p}.weight"] = [((*at, p, "kernel"), tr, None)]
      if bias:
        names[f"{hub}self_attn.{p}.bias"] = [((*at, p, "bias"), same, None)]
    for n in ("q_norm", "k_norm"):
      names[f"{hub}self_attn.{n}.weight"] = [((*at, n, "scale"), same, None)]
    for n in ("input_layernorm", "post_attention_layernorm"):
      names[f"{hub}{n}.weight"] = [((*at, n, "scale"), same, None)]
    for part in gate_up_parts(d_ff):
      names[f"{hub}mlp.{part.name}.weight"] = [((*at, "mlp", "gate_up_proj", "kernel"), tr, part)]
    names[f"{hub}mlp.down_proj.weight"] = [((*at, "mlp", "down_proj", "kernel"), tr, None)]
  return names


def _beyond_qwen3(c: ModelConfig) -> str | None:
  """What of layers of config `c` Qwen3's layers do not compute, or None."""
  if c.norm != "rmsnorm":
    return f"norm={c.norm!r} (Qwen3's norms are RMSNorm)"
  if c.norm_offset:
    return f"norm_offset={c.norm_offset!r} (Qwen3's norms multiply by their weight alone)"
  if c.mlp != "swiglu":
    return f"mlp={c.mlp!r} (Qwen3's MLP is SwiGLU)"
  if c.attn_scale is not None and c.attn_scale != c.resolved_head_dim**-0.5:
    return f"attn_scale={c.attn_scale!r} (Qwen3's is head_dim ** -0.5)"
  return None


def _rope_scaling(c: ModelConfig) -> dict | None:
  s = c.rope_scaling
  if s is None:
    return None
  if s.kind == "linear":
    return {"rope_type": "linear", "factor": s.factor}
  return {
    "rope_type": "llama3",
    "factor": s.factor,
    "low_freq_factor": s.low_freq_factor,
    "high_freq_factor": s.high_freq_factor,
    "original_max_position_embeddings": s.original_max_len,
  }


def hub_config(head: DFlashHead) -> dict:
  """The drafter's `config.json` in the `DFlashDraftModel` layout (`write` checks
  that the layout holds the head)."""
  cfg, c = head.cfg, head.layer_config
  t = cfg.target
  bias = c.qkv_bias or c.out_bias  # q/k/v/o biases in one flag
  # Layer counts -> the reference's ids, in the order the head's fc reads them:
  # the target hands a head its feature layers in depth order (`run_blocks`).
  ids = [i - 1 for i in sorted(cfg.feature_layers)]
  dflash = {"mask_token_id": cfg.mask_token_id, "target_layer_ids": ids}
  if t.logit_softcap:  # the target's head caps its logits; the reference caps by this
    dflash["final_logit_softcapping"] = t.logit_softcap
  return {
    "architectures": [ARCHITECTURE],
    "model_type": "qwen3",
    "hidden_size": c.d_model,
    "intermediate_size": c.d_ff,
    "num_hidden_layers": cfg.draft_layers,
    "num_attention_heads": c.n_heads,
    "num_key_value_heads": c.n_kv_heads,
    "head_dim": c.resolved_head_dim,
    "hidden_act": "silu",
    "rms_norm_eps": c.norm_eps,
    "rope_theta": c.rope_theta,
    "rope_scaling": _rope_scaling(c),
    "max_position_embeddings": c.max_seq_len,
    "vocab_size": c.vocab_size,
    "attention_bias": bias,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "layer_types": ["full_attention"] * cfg.draft_layers,
    "tie_word_embeddings": False,
    "initializer_range": c.init_std,
    "torch_dtype": str(jnp.dtype(c.param_dtype)),
    "num_target_layers": t.n_layers,
    "block_size": cfg.block_size,
    "dflash_config": dflash,
  }


def write(head: DFlashHead, target: Transformer | None = None) -> tuple[dict, dict]:
  """`(config.json, {name: tensor})` of the drafter in the `DFlashDraftModel` layout,
  torch `[out, in]` weights; ValueError naming the parameter or setting the layout
  cannot hold (nothing is dropped). `target` is unused: the file copies nothing of it."""
  del target
  return hub_config(head), hub_tensors(head)


def hub_tensors(
  head: DFlashHead, own: dict | None = None, held: Collection = (), layout: str = ARCHITECTURE
) -> dict[str, np.ndarray]:
  """`{name: tensor}` of the drafter's layers in the `DFlashDraftModel` layout, and
  `own` beside them: the tensors of a `layout` built on it, which hold the
  parameter paths `held`. ValueError naming the parameter or setting that neither
  holds (nothing is dropped)."""
  cfg, c = head.cfg, head.layer_config
  if cfg.mask_token_id < 0:
    raise ValueError(
      f"mask_embedding: the {layout} layout has no tensor for a learned mask "
      "embedding (it fills the block with the target's embedding of "
      "dflash_config.mask_token_id); train the head with mask_token_id set to a spare id "
      "of the tokenizer, or write it with layout='specjax'."
    )
  beyond = _beyond_qwen3(c)
  if beyond:
    raise ValueError(
      f"the {layout} layout's layers are Qwen3's; this head's target has {beyond}: "
      "write it with layout='specjax'."
    )
  params = hub.flat_params(head)
  bias = c.qkv_bias or c.out_bias
  tensors, written = hub.named_tensors(params, _names(cfg, c.d_ff, bias))
  if bias:  # the reference reads q/k/v/o biases together: zeros for those the head lacks
    dtype = params[("fc", "kernel")].dtype
    for i in range(cfg.draft_layers):
      layer = head.layers[i]
      for p in _PROJECTIONS:
        name = f"layers.{i}.self_attn.{p}.bias"
        tensors.setdefault(name, np.zeros(getattr(layer, p).kernel.shape[-1], dtype))
  written = written | set(held)
  for path, value in params.items():
    if path not in written and np.any(value):
      raise ValueError(
        f"{'.'.join(map(str, path))}: the {layout} layout has no tensor for it "
        "(its MLPs have no biases) and it is not zero; write the head with layout='specjax'."
      )
  tensors |= own or {}
  return {k: np.ascontiguousarray(v) for k, v in tensors.items()}


def _check_config(config: dict, t: ModelConfig, spelling: HubSpelling = DFLASH_SPELLING) -> None:
  """ValueError naming the first config.json field that does not fit target `t`."""
  architectures = config.get("architectures") or []
  if not set(spelling.architectures) & set(map(str, architectures)):
    names = " or ".join(spelling.architectures)
    raise ValueError(
      f"config architectures is {architectures!r}; specjax reads {names} here (no other variant)."
    )
  required = ("hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads")
  for key in (*required, "intermediate_size"):
    if key not in config:
      raise ValueError(f"config lacks the field {key}.")
  want = dict(hidden_size=t.d_model, vocab_size=t.vocab_size, num_attention_heads=t.n_heads)
  want |= dict(num_key_value_heads=t.n_kv_heads, head_dim=t.resolved_head_dim)
  want |= dict(rms_norm_eps=t.norm_eps, hidden_act="silu")
  want["num_target_layers"] = t.n_layers if "num_target_layers" in config else None  # optional
  for key, value in want.items():
    got = config.get(key, _QWEN3_DEFAULTS.get(key))
    if value is not None and got != value:
      raise ValueError(f"config {key} is {got!r}; the target needs {value!r}.")
  theta, scaling = rope(config, "config", theta=10_000.0)
  if (theta, scaling) != (t.rope_theta, t.rope_scaling):
    raise ValueError(
      f"config rope (theta {theta}, scaling {scaling}) is not the target's "
      f"(theta {t.rope_theta}, scaling {t.rope_scaling}): the drafter's RoPE is its target's."
    )
  types = config.get("layer_types") or []
  if "sliding_attention" in types or (not types and config.get("use_sliding_window")):
    raise ValueError("config asks for sliding-window layers; specjax's drafter attends globally.")
  if config.get("is_causal"):
    raise ValueError("config is_causal is true; specjax's drafter reads its block both ways.")
  for key in ("input_embedding_scale", "output_multiplier"):
    value = spelling.lookup(config, key, 1.0)[0]
    if float(value) != 1.0:
      raise ValueError(f"config {key} is {value!r}; specjax reads 1.0 only.")
  cap = spelling.lookup(config, "final_logit_softcapping")[0] or None
  if cap != t.logit_softcap:
    raise ValueError(
      f"config final_logit_softcapping is {cap!r}; the drafter's logits are its target's "
      f"(logit_softcap {t.logit_softcap!r})."
    )


def from_hub(
  config: dict, tensors: dict[str, np.ndarray], target: Transformer, dtype
) -> DFlashHead:
  """A `DFlashHead` for `target` from a `DFlashDraftModel` config and its tensors
  (`write`'s); ValueError naming the field or tensor that does not fit `target`.
  An absent bias is zero; a bias this target's layers lack must be zero."""
  fields, tensors = hub_fields(config, tensors, target.cfg, dtype)
  cfg = DFlashConfig(**fields)
  return read_hub_head(cfg, _names(cfg, cfg.d_ff or target.cfg.d_ff, bias=True), tensors, dtype)


def hub_fields(
  config: dict, tensors: dict, t: ModelConfig, dtype, spelling: HubSpelling = DFLASH_SPELLING
) -> tuple[dict, dict]:
  """`(DFlashConfig's fields, tensors)` of a config.json in the `DFlashDraftModel`
  layout, or a layout built on it (`spelling`: where its drafter fields are), for
  target `t` in `dtype`: the tensors with `fc`'s input blocks in depth order.
  ValueError naming the field that does not fit `t`."""
  name = str(jnp.dtype(dtype))
  _check_config(config, t, spelling)
  beyond = _beyond_qwen3(t)
  if beyond:
    raise ValueError(
      f"this target's layers have {beyond}; {spelling.architectures[0]}'s are Qwen3's."
    )
  n, v = t.n_layers, t.vocab_size
  layers = config["num_hidden_layers"]
  low, high = DFlashConfig.RANGES["draft_layers"]
  if not is_int(layers) or not low <= layers <= high:
    raise ValueError(
      f"config num_hidden_layers is {layers!r}; specjax reads {low} to {high} layers."
    )
  ids, where = spelling.lookup(config, "target_layer_ids")
  if ids is None:  # the first reference's rule (its build_target_layer_ids)
    ids = (
      [n // 2]
      if layers == 1
      else [int(round(1 + i * (n - 4) / (layers - 1))) for i in range(layers)]
    )
    if len(set(ids)) != len(ids) or not 0 <= min(ids) <= max(ids) < n:
      raise ValueError(
        f"config {where} is absent, and the reference's rule gives "
        f"{ids} for {layers} layers on this target's {n}: name distinct ids in [0, {n})."
      )
  if (
    not isinstance(ids, list)
    or not ids
    or any(not is_int(i) or not 0 <= i < n for i in ids)
    or len(set(ids)) != len(ids)
  ):
    raise ValueError(
      f"config {where} is {ids!r}; this target needs distinct layer ids in [0, {n})."
    )
  mask, where = spelling.lookup(config, "mask_token_id")
  if not is_int(mask) or not 0 <= mask < v:
    raise ValueError(f"config {where} is {mask!r}; this target needs an id in [0, {v}).")
  block, where = spelling.lookup(config, "block_size", 16)  # the reference's default
  low, high = DFlashConfig.RANGES["block_size"]
  if not is_int(block) or not low <= block <= high:
    raise ValueError(f"config {where} is {block!r}; specjax reads {low} to {high}.")
  ff = config["intermediate_size"]
  if not is_int(ff) or ff < 1:
    raise ValueError(f"config intermediate_size is {ff!r}; specjax reads a positive int.")
  tensors = dict(tensors)
  if ids != sorted(ids) and "fc.weight" in tensors:  # fc's input blocks into depth order
    fc = np.asarray(tensors["fc.weight"])
    if fc.ndim == 2 and fc.shape[1] == len(ids) * t.d_model:
      blocks = np.split(fc, len(ids), axis=1)
      tensors["fc.weight"] = np.concatenate([blocks[j] for j in np.argsort(ids)], axis=1)
  fields = dict(
    target=t.replace(dtype=name, param_dtype=name),
    feature_layers=tuple(sorted(int(i) + 1 for i in ids)),
    d_ff=ff * (ff != t.d_ff),  # 0: the target's
    block_size=int(block),
    draft_layers=layers,
    mask_token_id=int(mask),
  )
  return fields, tensors


def read_hub_head(cfg: DFlashConfig, names: dict, tensors: dict, dtype) -> nnx.Module:
  """The head of `cfg` (a block drafter's or a kind's built on it) in `dtype` from hub
  `tensors` by `names` (`hub.build_head`); a bias of `names` that the target's layers
  lack is read as nothing, and must be zero."""
  name, t, names = str(jnp.dtype(dtype)), cfg.target, dict(names)
  held = {tuple(p) for p, _ in nnx.to_flat_state(hub.abstract_head(cfg, name)[1])}
  for name_ in [k for k, targets in names.items() if targets[0][0] not in held]:
    del names[name_]  # a bias the target's layers lack: computes nothing only if zero
    if name_ in tensors and np.any(np.asarray(tensors.pop(name_), np.float32)):
      raise ValueError(
        f"tensor {name_} is not zero, and this target's layers have no such bias "
        f"(qkv_bias {t.qkv_bias}, out_bias {t.out_bias})."
      )
  return hub.build_head(cfg, name, names, tensors, {})


# -- training


def derived_layout(config: dict, keys: Collection[str]) -> bool:
  """Whether a DFlash-shaped head directory is DSpark's (`specjax.heads.dspark`, which
  extends this layout with a Markov and a confidence head a DFlash head would drop): a
  `dspark_config`, a DSpark architecture, or Markov / confidence tensors."""
  architectures = [str(a) for a in config.get("architectures") or []]
  return (
    "dspark_config" in config
    or any("DSpark" in a for a in architectures)
    or any(k.startswith(("markov_head.", "confidence_head.")) for k in keys)
  )


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


# -- growth with the target (specjax.models.expand)

# ... in a block drafter (DFlash) besides its layers: fc reads its nf * D features.
_DFLASH_AXES = {
  ("fc", "kernel"): "XD",
  ("hidden_norm", "scale"): "D",
  ("hidden_norm", "bias"): "D",
  ("norm", "scale"): "D",
  ("norm", "bias"): "D",
  ("mask_embedding",): "D",
}
# ... in a block drafter's layer (`DFlashLayer`: separate projections, query heads
# grouped by kv head as the fused ones are), by its path inside the layer.
_DFLASH_LAYER_AXES = {
  ("q_proj", "kernel"): "DKGH",
  ("q_proj", "bias"): "KGH",
  ("k_proj", "kernel"): "DKH",
  ("k_proj", "bias"): "KH",
  ("v_proj", "kernel"): "DKH",
  ("v_proj", "bias"): "KH",
  ("o_proj", "kernel"): "KGHD",
  ("o_proj", "bias"): "D",
  ("q_norm", "scale"): "H",
  ("k_norm", "scale"): "H",
  **{k: v for k, v in BLOCK_AXES.items() if k[0] == "mlp"},
}
for _norm in ("input_layernorm", "post_attention_layernorm"):
  _DFLASH_LAYER_AXES[(_norm, "scale")] = _DFLASH_LAYER_AXES[(_norm, "bias")] = "D"


def _expansion_axes(path: tuple) -> tuple[str, str] | None:
  """How a block drafter's parameter grows with the target: (its plan: "block" for its
  layers', "target" for the rest, their letters), or None for a path it lacks."""
  if path[0] == "layers":  # ("layers", i, ...)
    axes = _DFLASH_LAYER_AXES.get(path[2:])
    return None if axes is None else ("block", axes)
  axes = _DFLASH_AXES.get(path)
  return None if axes is None else ("target", axes)


# The training run's own settings (`config.head`), {field: (default, low, high)}.
TRAINING_FIELDS = {"num_anchors": (32, 1, 1024)}
# ... and its real-valued ones, {field: (default, low, high)} (high None: unbounded).
LOSS_FIELDS = {
  "loss_decay": (7.0, 0.0, None),
  "l1_mix": (0.9, 0.0, 1.0),
  "distill_weight": (0.0, 0.0, None),
}


def _check_training(config) -> None:
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


KIND = HeadKind(
  name="dflash",
  title="block drafter",
  config=DFlashConfig,
  make=DFlashHead,
  drafter=DFlashDrafter,
  holds="head",
  objective=dflash_objective,
  hub=hub.HubLayout(f"{ARCHITECTURE} (z-lab/dflash)", hub.LLAMA_FILES, recognises, from_hub, write),
  read_priority=2,
  training=TrainingRules(
    fields=("feature_layers", "d_ff", "block_size", "draft_layers", "mask_token_id"),
    check=_check_training,
    loss=DFlashLoss,
    warm_start=warm_start,
  ),
  expansion_axes=_expansion_axes,
)
