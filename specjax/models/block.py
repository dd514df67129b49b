"""A decoder block: grouped-query attention with its cache write, the MLP, the norms.

`Attention` (fused q/k/v, RoPE, the cache write, `specjax.models.attention`),
`MLP` (SwiGLU, GeGLU or GELU, gate and up fused) and `Block` (pre-norm, or
sandwich norms; on GPU each RMSNorm folded into the next product) for
`specjax.models.transformer`, which stacks them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import compiler_options
from specjax.distributed.mesh import constrain
from specjax.kernels import append_attention as appended
from specjax.kernels import gated_down as gated
from specjax.models.attention import attention, interpret_kernels, query_runs
from specjax.models.config import ModelConfig
from specjax.models.fused import gate_up_parts, qkv_parts
from specjax.models.kv_cache import write_layer
from specjax.models.layers import Linear, Norm, apply_rope, normal_init, rope_inv_freq, zeros_init


def one_gpu_kernels() -> bool:
  """Whether the program being traced takes specjax's GPU kernels
  (`specjax.kernels.append_attention`, `gated_down`): compiled for a GPU (or
  the kernels interpreted, SPECJAX_PALLAS_INTERPRET=1) and not over a mesh of
  several devices, for which they have no partitioning rule yet."""
  if not (interpret_kernels() or compiler_options.current_platform() == "gpu"):
    return False
  mesh = jax.sharding.get_abstract_mesh()
  return mesh.empty or mesh.size == 1


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
        kernel_init=normal_init(cfg, names),
        bias_init=zeros_init(names[1:]),
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
    sums: jax.Array | None = None,
  ):
    """x `[B, T, D]`, positions `[B, T]`, masks: window -> `[B, T, T or S]`
    (this layer reads `masks[self.window]`), or this layer's mask itself.

    With `layer_cache = (k [B, K, S, H], v [B, K, S, H])` (or a scanned model's
    stacked pair and layer index) the new keys/values are written at `starts
    [B]`; returns `(out [B, T, D], layer_cache)`. `inv_freq [H/2]` overrides the
    layer's RoPE frequencies. `contiguous` (static): one run of slots per row.
    `rows [B, T, 1]`: x is a folded norm's `x * scale` and this its factor
    (`Norm.folded`); then the output is in `out_dtype` (float32 for the
    residual add), its products accumulated in float32; `sums [B, T, 1]`, where
    given, the folded norm's sums of squares behind `rows` (`Norm.folded_sums`),
    which the one-kernel path turns into the factor itself.
    """
    cfg = self.cfg
    b, t, _ = x.shape
    h = cfg.resolved_head_dim
    mask = masks[self.window] if isinstance(masks, dict) else masks
    if self._appends(t, layer_cache, starts, contiguous) and (rows is None or sums is not None):
      norm = None if rows is None else (sums, x.shape[-1], cfg.norm_eps)
      out, layer_cache = self._append_attend(
        x, positions, mask, layer_cache, starts, inv_freq, norm
      )
      return self._output(out.reshape(b, t, cfg.n_heads * h), rows, out_dtype), layer_cache
    q, k, v = self._project(x, positions, inv_freq, rows)
    if layer_cache is not None:
      k, v, layer_cache = write_layer(layer_cache, k, v, starts)
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
    return self._output(out.reshape(b, t, cfg.n_heads * h), rows, out_dtype), layer_cache

  def _output(self, out: jax.Array, rows: jax.Array | None, out_dtype) -> jax.Array:
    """o_proj of the heads' outputs `[B, T, N * H]` (a folded block's in `out_dtype`)."""
    b, t, _ = out.shape
    if rows is None:
      return self.o_proj(out)
    if b * t == 1:
      # One row: XLA:GPU rewrites this product as a multiply and a reduction; when
      # `out` is a slice of a library call's padded output (cuBLAS attention), the
      # multiply was not fused and wrote a whole [N * H, D] float32 array. The
      # barrier makes `out` an array of its own, read by one reduction.
      out = jax.lax.optimization_barrier(out)
    return self.o_proj.scaled(out, None, out_dtype)

  def _appends(self, t: int, layer_cache, starts, contiguous: bool) -> bool:
    """Whether this call runs as one kernel (`specjax.kernels.append_attention`,
    static): "auto" or "pallas" compiled for one GPU (`one_gpu_kernels`), a
    cached call on one run of slots per row with an unstacked cache, RoPE or
    learned positions, no q/k norm and no soft-capping, and shapes the kernel
    takes."""
    cfg = self.cfg
    if cfg.attention not in ("auto", "pallas") or cfg.qk_norm or cfg.attn_softcap is not None:
      return False
    if layer_cache is None or len(layer_cache) != 2 or starts is None or not contiguous:
      return False
    if not one_gpu_kernels():
      return False
    capacity = layer_cache[0].shape[2]
    return appended.applies(t, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim, capacity)

  def _append_attend(self, x, positions, mask, layer_cache, starts, inv_freq, norm):
    """`(out [B, T, N, H], layer_cache)` of `_appends` calls: the fused
    projection's raw product handed to the kernel with the folded norm (`norm`:
    None, or `(sums [B, T, 1], width, eps)` whose 1 / rms it computes), the
    bias and RoPE (positions and frequencies), which it applies itself."""
    cfg = self.cfg
    b, t, _ = x.shape
    h, kv_heads = cfg.resolved_head_dim, cfg.n_kv_heads
    if norm is None:
      qkv, bias, sums, width, eps = self.qkv_proj(x), None, None, 0, 0.0
    else:
      qkv, (sums, width, eps) = self.qkv_proj.product(x), norm
      sums = sums[..., 0]
      bias = None if self.qkv_proj.bias is None else self.qkv_proj.bias[...]
    # A contiguous cached call (`transformer._layout`) puts query t at position
    # starts + t, its slot: the kernel computes the angles from `starts` (passing
    # `positions` cost XLA a kernel to materialise them).
    del positions
    if cfg.positions != "rope":
      inv_freq = None
    elif inv_freq is None:  # a constant in the program, not a kernel every call
      inv_freq = rope_inv_freq(h, *self.rope, xp=np)
    lo, hi = query_runs(mask)
    parts = cfg.n_heads // kv_heads + 2
    out, keys, values = appended.append_attention(
      qkv.reshape(b, t, kv_heads, parts, h),
      lo,
      hi,
      starts,
      *layer_cache,
      sums,
      None if bias is None else bias.reshape(kv_heads, parts, h),
      inv_freq,
      scale=h**-0.5 if cfg.attn_scale is None else cfg.attn_scale,
      norm_width=width,
      norm_eps=float(eps),
      interpret=interpret_kernels(),
    )
    return out, (keys, values)

  def _project(self, x, positions, inv_freq, rows):
    """`(q [B, T, N, H], k [B, K, T, H], v [B, K, T, H])`: the fused projection of
    `x [B, T, D]` (a folded norm's, with `rows`), q/k norms and RoPE applied."""
    cfg = self.cfg
    b, t, _ = x.shape
    h = cfg.resolved_head_dim
    qkv = self.qkv_proj(x) if rows is None else self.qkv_proj.scaled(x, rows)
    q, k, v = (part.take(qkv) for part in qkv_parts(cfg))  # from [B, T, K * (G + 2) * H]
    q = q.reshape(b, t, cfg.n_heads, h)
    k = k.reshape(b, t, cfg.n_kv_heads, h)
    v = v.reshape(b, t, cfg.n_kv_heads, h)
    if cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    if cfg.positions == "rope":
      inv_freq = rope_inv_freq(h, *self.rope) if inv_freq is None else inv_freq
      q = apply_rope(q, positions, inv_freq)
      k = apply_rope(k, positions, inv_freq)
    return q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)


class MLP(nnx.Module):
  """SwiGLU (`down(silu(gate(x)) * up(x))`), GeGLU (the same with tanh-GELU) or
  GELU (`down(gelu(up(x)))`); gate and up come from one product (`gate_up_proj`)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.kind = cfg.mlp
    kw = dict(
      use_bias=cfg.mlp_bias, dtype=cfg.compute_dtype, param_dtype=cfg.weight_dtype, rngs=rngs
    )

    def linear(d_in, d_out, names):
      return Linear(
        d_in, d_out, kernel_init=normal_init(cfg, names), bias_init=zeros_init(names[1:]), **kw
      )

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

  def adds_in_one_kernel(self, x: jax.Array) -> bool:
    """Whether a folded block's MLP tail on `x [B, T, D]` runs as one kernel
    (`add_to`, static): a gated MLP compiled for one GPU (`one_gpu_kernels`) on
    a decode call's few rows, whatever `ModelConfig.attention` says."""
    if not one_gpu_kernels():
      return False
    rows = x.size // x.shape[-1]
    return gated.applies(rows, self.d_ff, x.shape[-1], self.kind)

  def add_to(self, residual: jax.Array, x: jax.Array, sums: jax.Array, eps: float) -> jax.Array:
    """`residual + self(x, rows)` `[B, T, D]` for a folded norm's `x * scale` and
    its sums of squares `sums [B, T, 1]` (`Norm.folded_sums`): the gate/up
    product, then the activation, `down` and the add in one kernel
    (`specjax.kernels.gated_down`), rounded where the XLA path rounds."""
    b, t, d = residual.shape
    gate_up = self.gate_up_proj.product(x)
    bias = lambda layer: None if layer.bias is None else layer.bias[...]
    out = gated.gated_down(
      gate_up.reshape(b * t, 2 * self.d_ff),
      self.down_proj.kernel[...],
      residual.reshape(b * t, d),
      sums.reshape(b * t),
      bias(self.gate_up_proj),
      bias(self.down_proj),
      kind=self.kind,
      dtype=self.down_proj.dtype or x.dtype,
      norm_width=d,
      norm_eps=float(eps),
      round_product=self.down_proj.rounds_product(b * t),
      interpret=interpret_kernels(),
    )
    return out.reshape(b, t, d)


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
    # A head may replace a norm (EAGLE's first block reads its input unnormalised).
    norms = (self.attn_norm, self.mlp_norm)
    return (
      all(isinstance(norm, Norm) and norm.kind == "rmsnorm" for norm in norms)
      and not self.sandwich
      and compiler_options.current_platform() == "gpu"
    )

  def _folded(self, x, positions, masks, layer_cache, starts, inv_freq, contiguous):
    """`__call__` with the norms folded (`fold`): same results to rounding."""
    scaled, sums = self.attn_norm.folded_sums(x)
    rows = self.attn_norm.factor(sums)
    attn_out, layer_cache = self.attn(
      scaled, positions, masks, layer_cache, starts, inv_freq, contiguous, rows, jnp.float32, sums
    )
    x = constrain((x.astype(jnp.float32) + attn_out).astype(x.dtype), RESIDUAL_AXES)
    scaled, sums = self.mlp_norm.folded_sums(x)
    if self.mlp.adds_in_one_kernel(x):
      x = self.mlp.add_to(x, scaled, sums, self.mlp_norm.eps)
    else:
      mlp_out = self.mlp(scaled, self.mlp_norm.factor(sums), jnp.float32)
      x = (x.astype(jnp.float32) + mlp_out).astype(x.dtype)
    return constrain(x, RESIDUAL_AXES), layer_cache
