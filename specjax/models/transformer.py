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
from specjax.distributed.mesh import constrain
from specjax.kernels import matmul, uses_kernel
from specjax.models.attention import attend as attend  # re-exported: the reference path
from specjax.models.attention import attention, softcap
from specjax.models.config import ModelConfig, RopeScaling
from specjax.models.fused import gate_up_parts, qkv_parts
from specjax.models.kv_cache import KVCache, write_layer
from specjax.models.scan import ScannedBlocks
from specjax.trees import Tree, as_tree, tree_attention


def _logical(init, names: tuple[str | None, ...]):
  # Record logical axis names only; placing them on a mesh is the sharding
  # rules' job, so a model built without a mesh stays an ordinary model.
  return nnx.with_partitioning(init, names, eager_sharding=False)


def _normal(cfg: ModelConfig, names: tuple[str | None, ...]):
  return _logical(nnx.initializers.normal(cfg.init_std), names)


def _zeros(names: tuple[str | None, ...]):
  return _logical(nnx.initializers.zeros, names)


# XLA:GPU's bound below which a product is a reduction, not a GEMM (its
# `IsMatrixMultiplicationTooSmallForRewriting` threshold, jax 0.10.2).
_REDUCED_PRODUCT = 10_000_000


class Linear(nnx.Linear):
  """`nnx.Linear` whose product of a decode step's few rows runs on specjax's CPU
  kernel (`specjax.kernels.matmul`); same parameters, same result."""

  def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
    kernel = self.kernel[...]
    dtype = self.dtype or jnp.result_type(inputs, kernel)
    rows = inputs.size // inputs.shape[-1]
    plain = out_sharding is None and self.precision is None and self.preferred_element_type is None
    k, n = kernel.shape
    if not (plain and uses_kernel(rows, dtype, kernel.dtype, k, n)):
      return super().__call__(inputs, out_sharding)
    # The weights stay in their stored dtype: the kernel converts as it reads.
    y = matmul(inputs, kernel, dtype)
    if self.bias is not None:
      y = y + self.bias[...].astype(dtype)
    return y

  def scaled(self, inputs: jax.Array, rows: jax.Array | None, out_dtype=None) -> jax.Array:
    """`self(inputs)` times `rows [..., 1]` (a folded norm's per-row factor; None:
    1), scaled in float32, then cast to `out_dtype` (default the layer's dtype).
    On GPU the factor lands in the product's consumer fusion instead of a
    kernel of its own that normalises the inputs first.

    XLA:GPU rewrites a product of fewer than `_REDUCED_PRODUCT` multiply-adds
    (a decode step's small projections) as a multiply and a reduction: asked
    for a float32 result, the multiply fuses into the reduction; asked for the
    layer's dtype, it was written out whole ([D_in, D_out]). A larger product
    goes to a GEMM, where a float32 result from bfloat16 operands makes the
    cuBLAS path convert the whole weight first: there the product stays in the
    layer's dtype, as `__call__`'s."""
    kernel = self.kernel[...]
    dtype = self.dtype or jnp.result_type(inputs, kernel)
    reduced = inputs.size // inputs.shape[-1] * kernel.size < _REDUCED_PRODUCT
    wide = jnp.float32 if reduced else None
    y = jnp.dot(inputs.astype(dtype), kernel.astype(dtype), preferred_element_type=wide)
    y = y.astype(jnp.float32)
    if rows is not None:
      y = y * rows
    if self.bias is not None:
      y = y + self.bias[...].astype(jnp.float32)
    return y.astype(out_dtype or dtype)


class Norm(nnx.Module):
  """RMSNorm or LayerNorm over the last axis in float32, times `cfg.norm_offset +
  scale` (Gemma stores w - 1: offset 1); the scale starts at the identity."""

  def __init__(self, cfg: ModelConfig, width: int | None = None, axis: str = "embed"):
    """Over `width` features (default d_model), logical axis `axis`."""
    self.kind = cfg.norm
    self.eps = cfg.norm_eps
    self.offset = float(cfg.norm_offset)
    self.dtype = cfg.compute_dtype
    width = width or cfg.d_model
    key = jax.random.key(0)  # unused by the constant initialisers
    identity = nnx.initializers.constant(1.0 - self.offset)
    self.scale = nnx.Param(_logical(identity, (axis,))(key, (width,), cfg.weight_dtype))
    if cfg.norm == "layernorm":
      self.bias = nnx.Param(_zeros((axis,))(key, (width,), cfg.weight_dtype))

  def folded(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """RMSNorm split for folding into the next product: `(x * scale [..., D] in
    the compute dtype, 1 / rms [..., 1] float32)`, whose product is `self(x)`
    (to rounding); the factor goes after the product (`Linear.scaled`)."""
    x = x.astype(jnp.float32)
    rows = jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.eps)
    return (x * (self.offset + self.scale[...].astype(jnp.float32))).astype(self.dtype), rows

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x.astype(jnp.float32)
    if self.kind == "layernorm":
      x = x - jnp.mean(x, axis=-1, keepdims=True)
    x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.eps)
    x = x * (self.offset + self.scale[...].astype(jnp.float32))
    if self.kind == "layernorm":
      x = x + self.bias[...].astype(jnp.float32)
    return x.astype(self.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> jax.Array:
  """`[H/2]` inverse frequencies of the rotary embedding (with optional scaling)."""
  h = head_dim
  inv_freq = 1.0 / (theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
  if scaling is None:
    return inv_freq
  if scaling.kind == "linear":
    return inv_freq / scaling.factor
  wavelength = 2 * jnp.pi / inv_freq
  long_limit = scaling.original_max_len / scaling.low_freq_factor
  short_limit = scaling.original_max_len / scaling.high_freq_factor
  scaled = jnp.where(wavelength > long_limit, inv_freq / scaling.factor, inv_freq)
  # Between the limits, blend the scaled and unscaled frequencies linearly in
  # original_max_len / wavelength.
  blend = (scaling.original_max_len / wavelength - scaling.low_freq_factor) / (
    scaling.high_freq_factor - scaling.low_freq_factor
  )
  smoothed = (1 - blend) * scaled / scaling.factor + blend * scaled
  middle = (wavelength >= short_limit) & (wavelength <= long_limit)
  return jnp.where(middle, smoothed, scaled)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
  """Rotates `x [B, T, heads, H]` by `positions [B, T]` (rotate-half convention)."""
  angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, H/2]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def attention_mask(
  q_positions: jax.Array, k_positions: jax.Array, window: int | None = None
) -> jax.Array:
  """`[B, T, S]` bool: query at `q_positions [B, T]` may read key at `k_positions
  [S]` (causal, within `window` if set)."""
  q = q_positions[:, :, None]
  k = k_positions[None, None, :]
  mask = k <= q
  if window is not None:
    mask &= k > q - window
  return mask


class Attention(nnx.Module):
  """Multi-head attention with K <= N key/value heads and an optional cache; layer
  `layer`'s sliding window and RoPE base come from the config."""

  def __init__(self, cfg: ModelConfig, layer: int = 0, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.window = cfg.layer_window(layer)
    self.rope = cfg.layer_rope(layer)
    h = cfg.resolved_head_dim
    kw = dict(dtype=cfg.compute_dtype, param_dtype=cfg.weight_dtype, rngs=rngs)

    def linear(d_in, d_out, names, bias):
      return Linear(
        d_in,
        d_out,
        use_bias=bias,
        kernel_init=_normal(cfg, names),
        bias_init=_zeros(names[1:]),
        **kw,
      )

    # Queries, keys and values in one product, columns grouped by kv head
    # (`specjax.models.fused`): a column sharding is a sharding by kv head.
    qkv = cfg.n_kv_heads * (cfg.n_heads // cfg.n_kv_heads + 2) * h
    self.qkv_proj = linear(cfg.d_model, qkv, ("embed", "kv_heads"), cfg.qkv_bias)
    self.o_proj = linear(cfg.n_heads * h, cfg.d_model, ("heads", "embed"), cfg.out_bias)
    if cfg.qk_norm:  # Qwen3: each head's query and key normalised before RoPE
      self.q_norm = Norm(cfg, h, "head_dim")
      self.k_norm = Norm(cfg, h, "head_dim")

  def __call__(
    self,
    x: jax.Array,
    positions: jax.Array,
    masks: dict[int | None, jax.Array] | jax.Array,
    layer_cache: tuple | None,
    starts: jax.Array | None,
    inv_freq: jax.Array | None = None,
    contiguous: bool = True,
    rows: jax.Array | None = None,
    out_dtype=None,
  ):
    """x `[B, T, D]`, positions `[B, T]`, masks: window -> `[B, T, T or S]`
    (this layer reads `masks[self.window]`), or this layer's mask itself.

    With `layer_cache = (k [B, K, S, H], v [B, K, S, H])` (or a scanned model's
    stacked pair and layer index) the new keys/values are written at `starts
    [B]`; returns `(out [B, T, D], layer_cache)`. `inv_freq [H/2]` overrides the
    layer's RoPE frequencies. `contiguous` (static): one run of slots per row.
    `rows [B, T, 1]`: x is a folded norm's `x * scale` and this its factor
    (`Norm.folded`); then the output is in `out_dtype` (float32 for the
    residual add), its products accumulated in float32.
    """
    cfg = self.cfg
    b, t, _ = x.shape
    h = cfg.resolved_head_dim
    if rows is None:
      qkv = self.qkv_proj(x)  # [B, T, K * (G + 2) * H]
    else:
      qkv = self.qkv_proj.scaled(x, rows)
    q, k, v = (part.take(qkv) for part in qkv_parts(cfg))
    q = q.reshape(b, t, cfg.n_heads, h)
    k = k.reshape(b, t, cfg.n_kv_heads, h)
    v = v.reshape(b, t, cfg.n_kv_heads, h)
    if cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    if cfg.positions == "rope":
      inv_freq = rope_inv_freq(h, *self.rope) if inv_freq is None else inv_freq
      q = apply_rope(q, positions, inv_freq)
      k = apply_rope(k, positions, inv_freq)
    k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, K, T, H]
    if layer_cache is not None:
      k, v, layer_cache = write_layer(layer_cache, k, v, starts)
    mask = masks[self.window] if isinstance(masks, dict) else masks
    out = attention(
      q,
      k,
      v,
      mask,
      scale=cfg.attn_scale,
      cap=cfg.attn_softcap,
      impl=cfg.attention,
      contiguous=contiguous,
      # A cached call's queries read no slot at or past the last one it writes.
      spans=None if starts is None else starts + t,
    )
    out = out.reshape(b, t, cfg.n_heads * h)
    if rows is None:
      return self.o_proj(out), layer_cache
    if b * t == 1:
      # One row: XLA:GPU rewrites this product as a multiply and a reduction; when
      # `out` is a slice of a library call's padded output (cuBLAS attention), the
      # multiply was not fused and wrote a whole [N * H, D] float32 array. The
      # barrier makes `out` an array of its own, read by one reduction.
      out = jax.lax.optimization_barrier(out)
    return self.o_proj.scaled(out, None, out_dtype), layer_cache


class MLP(nnx.Module):
  """SwiGLU (`down(silu(gate(x)) * up(x))`), GeGLU (the same with tanh-GELU) or
  GELU (`down(gelu(up(x)))`); gate and up come from one product (`gate_up_proj`)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.kind = cfg.mlp
    kw = dict(
      use_bias=cfg.mlp_bias, dtype=cfg.compute_dtype, param_dtype=cfg.weight_dtype, rngs=rngs
    )

    def linear(d_in, d_out, names):
      return Linear(d_in, d_out, kernel_init=_normal(cfg, names), bias_init=_zeros(names[1:]), **kw)

    self.d_ff = cfg.d_ff
    if cfg.mlp == "gelu":
      self.up_proj = linear(cfg.d_model, cfg.d_ff, ("embed", "mlp"))
    else:  # gate and up in one product, interleaved per hidden unit (`specjax.models.fused`)
      self.gate_up_proj = linear(cfg.d_model, 2 * cfg.d_ff, ("embed", "mlp"))
    self.down_proj = linear(cfg.d_ff, cfg.d_model, ("mlp", "embed"))

  def __call__(self, x: jax.Array, rows: jax.Array | None = None, out_dtype=None) -> jax.Array:
    """`rows`, `out_dtype`: a folded norm's factor and the output's dtype, as for
    `Attention`."""
    if rows is not None:
      up_proj = self.up_proj if self.kind == "gelu" else self.gate_up_proj
      gate_up = up_proj.scaled(x, rows)
    elif self.kind == "gelu":
      return self.down_proj(jax.nn.gelu(self.up_proj(x), approximate=True))
    else:
      gate_up = self.gate_up_proj(x)  # [..., 2F]
    if self.kind == "gelu":
      hidden = jax.nn.gelu(gate_up, approximate=True)
    else:
      gate, up = (part.take(gate_up) for part in gate_up_parts(self.d_ff))
      if self.kind == "swiglu":
        hidden = jax.nn.silu(gate) * up
      else:
        hidden = jax.nn.gelu(gate, approximate=True) * up
    if rows is None:
      return self.down_proj(hidden)
    return self.down_proj.scaled(hidden, None, out_dtype)


# Logical axes of the residual stream `[B, T, D]` (rows over `data`, whole over `model`).
RESIDUAL_AXES = ("batch", None, "embed")


class Block(nnx.Module):
  """Pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x)); with
  `sandwich_norms` each sublayer's output is normalised too (Gemma)."""

  def __init__(self, cfg: ModelConfig, layer: int = 0, *, rngs: nnx.Rngs):
    self.attn_norm = Norm(cfg)
    self.attn = Attention(cfg, layer, rngs=rngs)
    self.mlp_norm = Norm(cfg)
    self.mlp = MLP(cfg, rngs=rngs)
    self.sandwich = cfg.sandwich_norms
    if cfg.sandwich_norms:
      self.post_attn_norm = Norm(cfg)
      self.post_mlp_norm = Norm(cfg)

  def __call__(self, x, positions, masks, layer_cache, starts, inv_freq=None, contiguous=True):
    # The residual stream [B, T, D] stays whole on every `model` device (Megatron's
    # layout: each sublayer ends in one all-reduce); left to itself, XLA may split
    # it along T and gather it back before the next projection.
    x = constrain(x, RESIDUAL_AXES)
    if self.fold:
      return self._folded(x, positions, masks, layer_cache, starts, inv_freq, contiguous)
    attn_out, layer_cache = self.attn(
      self.attn_norm(x), positions, masks, layer_cache, starts, inv_freq, contiguous
    )
    if self.sandwich:
      attn_out = self.post_attn_norm(attn_out)
    x = constrain(x + attn_out, RESIDUAL_AXES)
    mlp_out = self.mlp(self.mlp_norm(x))
    if self.sandwich:
      mlp_out = self.post_mlp_norm(mlp_out)
    return constrain(x + mlp_out, RESIDUAL_AXES), layer_cache

  @property
  def fold(self) -> bool:
    """Whether the block folds its norms into its products (static): RMSNorm
    without sandwich norms, compiled for a GPU. There each norm's scale goes
    into the product's operand and its 1 / rms into the product's consumer, and
    the residual adds take the float32 products, so a sublayer launches no
    normalising kernel and no separate add (decode: docs/performance.md). The CPU
    keeps the plain form, which its matmul kernel (`Linear`) takes."""
    return (
      self.attn_norm.kind == "rmsnorm"
      and not self.sandwich
      and compiler_options.current_platform() == "gpu"
    )

  def _folded(self, x, positions, masks, layer_cache, starts, inv_freq, contiguous):
    """`__call__` with the norms folded (`fold`): same results to rounding."""
    scaled, rows = self.attn_norm.folded(x)
    attn_out, layer_cache = self.attn(
      scaled, positions, masks, layer_cache, starts, inv_freq, contiguous, rows, jnp.float32
    )
    x = constrain((x.astype(jnp.float32) + attn_out).astype(x.dtype), RESIDUAL_AXES)
    scaled, rows = self.mlp_norm.folded(x)
    mlp_out = self.mlp(scaled, rows, jnp.float32)
    return constrain((x.astype(jnp.float32) + mlp_out).astype(x.dtype), RESIDUAL_AXES), layer_cache


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
      embedding_init=_normal(cfg, ("vocab", "embed")),
      rngs=rngs,
    )
    if cfg.positions == "learned":
      self.pos_embed = nnx.Embed(
        cfg.max_seq_len,
        cfg.d_model,
        dtype=cfg.compute_dtype,
        param_dtype=cfg.weight_dtype,
        embedding_init=_normal(cfg, (None, "embed")),
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
        _normal(cfg, ("embed", "vocab"))(
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
