"""The decoder-only transformer shared by every draft and target.

One Flax NNX module covers Llama-style models (RMSNorm, RoPE, grouped-query
attention, SwiGLU), GPT-2-style ones (LayerNorm, learned positions, GELU,
biases) and Gemma-style ones (sandwich norms, GeGLU, soft-capping, alternating
local and global attention), chosen by `ModelConfig` fields:

  model(tokens)                          -> logits [B, T, V]          (no cache)
  model.forward_cached(tokens, cache)    -> (logits [B, T, V], cache) (T >= 1)

The cached call writes T tokens per row at that row's own cache length (gamma + 1
positions in one verification call). Logits are float32 whatever the compute
dtype: the warps and verification compare probabilities. Parameters carry
logical axis names (`embed`, `heads`, ...) for sharding (`specjax.distributed`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from specjax import compiler_options
from specjax.kernels import matmul
from specjax.models.attention import attend as attend  # re-exported: the reference path
from specjax.models.attention import softcap
from specjax.models.block import MLP as MLP  # re-exported: heads build from these
from specjax.models.block import Attention as Attention
from specjax.models.block import Block
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache
from specjax.models.layers import Linear as Linear
from specjax.models.layers import Norm, attention_mask, normal_init, rope_inv_freq
from specjax.models.layers import apply_rope as apply_rope
from specjax.models.scan import ScannedBlocks
from specjax.trees import Tree, as_tree, tree_attention


def run_blocks(
  blocks,
  x: jax.Array,
  cache: KVCache,
  feature_layers: tuple[int, ...] = (),
  tree: tuple[Tree | tuple[int, ...], int] | None = None,
) -> tuple[jax.Array, KVCache, list[jax.Array]]:
  """Runs `blocks` over `x [B, T, D]` after each row's cached prefix (row b's
  inputs at positions `cache.lengths[b] ..`); also used by draft heads with a
  cache of their own.

  With `tree = (parents, start)` (a `trees.Tree` or static tuple, static start)
  the inputs are tree nodes `start ..` (`specjax.trees`), written at slots
  `lengths + start ..`, each reading the prefix, its ancestors and itself at
  position lengths + depth - 1; `lengths` is not advanced.

  Returns:
    `(x [B, T, D], cache, features)`: lengths + T (not for a tree); features the
    outputs after the layer counts `feature_layers` (1 = after the first).
  """
  if isinstance(blocks, ScannedBlocks):  # runs the cache's first layers (layer skip)
    if cache.num_layers > len(blocks):
      raise ValueError(f"the cache has {cache.num_layers} layers; the model has {len(blocks)}.")
    return _run_scanned(blocks, x, cache, feature_layers, tree)
  if cache.num_layers != len(blocks):
    raise ValueError(f"the cache has {cache.num_layers} layers; this call runs {len(blocks)}.")
  t = x.shape[1]
  windows = {block.attn.window for block in blocks}
  starts, positions, masks = _layout(cache, t, tree, windows)
  new_k, new_v, features = [], [], []
  for depth, (block, k, v) in enumerate(zip(blocks, cache.k, cache.v), 1):
    x, (k, v) = block(x, positions, masks, (k, v), starts, contiguous=tree is None)
    new_k.append(k)
    new_v.append(v)
    if depth in feature_layers:
      features.append(x)
  lengths = cache.lengths if tree is not None else cache.lengths + t
  return x, KVCache(k=tuple(new_k), v=tuple(new_v), lengths=lengths), features


def _run_scanned(blocks: ScannedBlocks, x, cache: KVCache, feature_layers, tree):
  """`run_blocks` for scanned layers: one loop per stretch between feature layers."""
  depth = cache.num_layers
  starts, positions, masks = _layout(cache, x.shape[1], tree, set(blocks.windows[:depth]))
  inv_freqs = _rope_table(blocks)
  kv, features, start = (cache.k, cache.v), [], 0
  for stop in sorted({*feature_layers, depth}):
    x, kv = blocks.run(
      x, positions, masks, kv, starts, inv_freqs, start, stop, contiguous=tree is None
    )
    if stop in feature_layers:
      features.append(x)
    start = stop
  lengths = cache.lengths if tree is not None else cache.lengths + x.shape[1]
  return x, KVCache(k=kv[0], v=kv[1], lengths=lengths), features


def _rope_table(blocks: ScannedBlocks) -> jax.Array | None:
  """`[L, H/2]` RoPE frequencies of each scanned layer (None: learned positions)."""
  cfg = blocks.block.attn.cfg
  if cfg.positions != "rope":
    return None
  return jnp.stack([rope_inv_freq(cfg.resolved_head_dim, *rope) for rope in blocks.ropes])


def _layout(cache: KVCache, t: int, tree, windows=()) -> tuple:
  """`(starts [B], positions [B, T], masks)` of a cached call of T inputs, with
  masks: window -> `[B, T, S]` for each sliding window (None: global) in `windows`."""
  slots = jnp.arange(cache.capacity, dtype=jnp.int32)
  if tree is None:
    positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    masks = {w: attention_mask(positions, slots, w) for w in windows}
    return cache.lengths, positions, masks
  parents, start = tree
  parents = as_tree(parents, "tree")
  n = parents.num_nodes
  if start + t > n:
    raise ValueError(f"tree nodes {start}..{start + t - 1} do not exist in a tree of {n} nodes.")
  masks = {}
  for w in windows or (None,):  # starts and positions are the same for every window
    starts, positions, masks[w] = tree_attention(
      cache.lengths, cache.capacity, parents, start, start + t, w
    )
  return starts, positions, masks


class Transformer(nnx.Module):
  """Decoder-only language model: `Transformer(cfg, rngs=nnx.Rngs(0))(tokens [B, T])`
  -> logits `[B, T, V]`."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = nnx.Embed(
      cfg.vocab_size,
      cfg.d_model,
      dtype=cfg.compute_dtype,
      param_dtype=cfg.weight_dtype,
      embedding_init=normal_init(cfg, ("vocab", "embed")),
      rngs=rngs,
    )
    if cfg.positions == "learned":
      self.pos_embed = nnx.Embed(
        cfg.max_seq_len,
        cfg.d_model,
        dtype=cfg.compute_dtype,
        param_dtype=cfg.weight_dtype,
        embedding_init=normal_init(cfg, (None, "embed")),
        rngs=rngs,
      )
    blocks = [Block(cfg, i, rngs=rngs) for i in range(cfg.n_layers)]
    if cfg.scanned:
      windows = [cfg.layer_window(i) for i in range(cfg.n_layers)]
      ropes = [cfg.layer_rope(i) for i in range(cfg.n_layers)]
      self.layers = ScannedBlocks(blocks, windows, ropes)
    else:
      self.layers = nnx.List(blocks)
    self.final_norm = Norm(cfg)
    if not cfg.tie_embeddings:
      self.lm_head = nnx.Param(
        normal_init(cfg, ("embed", "vocab"))(
          rngs.params(), (cfg.d_model, cfg.vocab_size), cfg.weight_dtype
        )
      )

  def init_cache(self, batch: int, capacity: int, num_layers: int | None = None) -> KVCache:
    """An empty `KVCache` of `capacity` slots per row, in the compute dtype, for
    all layers or the first `num_layers` (layer-skip drafting)."""
    cfg = self.cfg
    if not 1 <= capacity <= cfg.max_seq_len:
      raise ValueError(f"capacity must be in [1, max_seq_len={cfg.max_seq_len}], got {capacity}.")
    return KVCache.zeros(
      n_layers=num_layers or cfg.n_layers,
      batch=batch,
      capacity=capacity,
      n_kv_heads=cfg.n_kv_heads,
      head_dim=cfg.resolved_head_dim,
      dtype=cfg.compute_dtype,
      stacked=isinstance(self.layers, ScannedBlocks),
    )

  def _embed(self, tokens, positions):
    x = self.embed(tokens)
    if self.cfg.scale_embeddings:  # rounded to the weights' dtype first, as Gemma does
      x = x * jnp.asarray(self.cfg.d_model**0.5, self.cfg.weight_dtype).astype(x.dtype)
    if self.cfg.positions == "learned":
      x = x + self.pos_embed(positions)
    return x

  def _logits(self, x: jax.Array) -> jax.Array:
    if self.cfg.norm == "rmsnorm" and compiler_options.current_platform() == "gpu":
      # The final norm folded into the head as in `Block.fold`: no kernel that
      # normalises the features first.
      scaled, rows = self.final_norm.folded(x)
      return self._head(scaled, rows)
    return self._head(self.final_norm(x))

  def _head(self, x: jax.Array, rows: jax.Array | None = None) -> jax.Array:
    """Final hidden states `[..., D]` (after the final norm; or its `Norm.folded`
    scaled features and `rows [..., 1]`) -> logits `[..., V]` float32."""
    tied = self.cfg.tie_embeddings
    w = self.embed.embedding[...] if tied else self.lm_head[...]  # [V, D] or [D, V]
    logits = matmul(x, w, jnp.float32, transposed=tied)
    if rows is not None:
      logits = logits * rows
    return softcap(logits, self.cfg.logit_softcap)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """Full causal forward without a cache: `tokens [B, T]` -> `logits [B, T, V]`."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    scanned = isinstance(self.layers, ScannedBlocks)
    windows = set(self.layers.windows) if scanned else {layer.attn.window for layer in self.layers}
    masks = {w: attention_mask(positions, positions[0], w) for w in windows}
    x = self._embed(tokens, positions)
    if scanned:
      x, _ = self.layers.run(
        x, positions, masks, None, None, _rope_table(self.layers), 0, len(self.layers)
      )
    else:
      for layer in self.layers:
        x, _ = layer(x, positions, masks, None, None)
    return self._logits(x)

  def forward_cached(
    self,
    tokens: jax.Array,
    cache: KVCache,
    logit_indices: jax.Array | None = None,
    num_layers: int | None = None,
    return_hidden: bool | tuple[int, ...] = False,
    tree: tuple[Tree | tuple[int, ...], int] | None = None,
  ) -> tuple[jax.Array, KVCache] | tuple[jax.Array, KVCache, jax.Array]:
    """Feeds T >= 1 new tokens per row after each row's cached prefix.

    Args:
      tokens: `[B, T]` int32; row b's tokens take positions
        `cache.lengths[b] .. cache.lengths[b] + T - 1`.
      cache: a `KVCache` with `lengths + T <= capacity` for every row.
      logit_indices: optional `[B, R]` indices into T; only those get logits.
      num_layers: run only the first `num_layers` blocks (layer skip); `cache`
        must have that many layers. None runs all.
      return_hidden: also return draft-head features at all T positions. True:
        the residual stream before the final norm, `[B, T, D]`; a static tuple
        of layer counts: the stream after each of those blocks, concatenated,
        `[B, T, len * D]` (EAGLE-3). False costs nothing.
      tree: None, or `(parents, start)`: the tokens are nodes `start ..` of a
        token tree over the cached prefix (`run_blocks`).

    Returns:
      `(logits [B, T or R, V] float32, cache)` (lengths + T, not for a tree),
      then the features if `return_hidden`.
    """

    t = tokens.shape[1]
    _, positions, _ = _layout(cache, t, tree)
    x = self._embed(tokens, positions)
    layers = self.layers
    if num_layers is not None and not isinstance(layers, ScannedBlocks):
      layers = layers[:num_layers]  # a scanned model's loop stops at the cache's depth
    depth = num_layers or len(layers)
    if cache.num_layers != depth:
      raise ValueError(f"the cache has {cache.num_layers} layers; this call runs {depth}.")
    feature_layers = self._feature_layers(return_hidden, depth)
    x, cache, features = run_blocks(layers, x, cache, feature_layers, tree)
    if logit_indices is not None:
      x = jnp.take_along_axis(x, logit_indices[:, :, None], axis=1)
    logits = self._logits(x)
    if return_hidden is False:
      return logits, cache
    return logits, cache, jnp.concatenate(features, axis=-1)

  def _feature_layers(self, return_hidden: bool | tuple[int, ...], depth: int) -> tuple[int, ...]:
    """The layer counts whose outputs `forward_cached` returns (checked, static)."""
    if return_hidden is False:
      return ()
    if return_hidden is True:
      return (depth,)
    layers = tuple(return_hidden)
    if not layers or any(not isinstance(i, int) or not 1 <= i <= depth for i in layers):
      raise ValueError(
        f"return_hidden must be a bool or a non-empty tuple of layer counts in [1, {depth}], "
        f"got {return_hidden!r}."
      )
    return layers

  def features_to_logits(
    self, features: jax.Array, vocab_subset: jax.Array | None = None
  ) -> jax.Array:
    """`[..., D]` features (the residual stream before the final norm) -> float32
    logits `[..., V]` through the model's own final norm and head (draft heads).

    With `vocab_subset` (`[K]` distinct int32 ids, FR-Spec) only those K rows of
    the head are multiplied; every other id gets logit -inf (probability 0).
    """

    return self.head_logits(self.final_norm(features), vocab_subset)

  def head_logits(self, x: jax.Array, vocab_subset: jax.Array | None = None) -> jax.Array:
    """Normed hidden states `[..., D]` -> float32 logits `[..., V]` by the model's
    head alone (a block drafter's own norm comes first); `vocab_subset` as in
    `features_to_logits`."""
    if vocab_subset is None:
      return self._head(x)
    if self.cfg.tie_embeddings:
      w = self.embed.embedding[...][vocab_subset].astype(x.dtype)  # [K, D]
    else:
      w = self.lm_head[...][:, vocab_subset].T.astype(x.dtype)
    # Capped before the fill: tanh would turn the -inf of excluded ids finite.
    sub = softcap(
      jnp.einsum("...d,kd->...k", x, w, preferred_element_type=jnp.float32), self.cfg.logit_softcap
    )
    full = jnp.full((*sub.shape[:-1], self.cfg.vocab_size), -jnp.inf, jnp.float32)
    return full.at[..., vocab_subset].set(sub)

  @property
  def num_params(self) -> int:
    """Number of parameter scalars."""
    state = nnx.state(self, nnx.Param)
    return sum(x.size for x in jax.tree.leaves(state))
