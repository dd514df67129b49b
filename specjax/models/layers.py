"""The transformer's building blocks: linear layers, norms, rotary embeddings, masks.

`Linear` is `nnx.Linear` whose decode products run on specjax's CPU kernel and
which, on GPU, can take a folded norm (`Linear.scaled`); `Norm` is RMSNorm or
LayerNorm (`Norm.folded` hands its scale to the next product); `rope_inv_freq`
/ `apply_rope` rotate queries and keys; `attention_mask` is the causal (or
windowed) mask of query and key positions. `specjax.models.block` builds a
decoder block from them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.kernels import matmul, uses_kernel
from specjax.models.config import ModelConfig, RopeScaling


def logical_init(init, names: tuple[str | None, ...]):
  # Record logical axis names only; placing them on a mesh is the sharding
  # rules' job, so a model built without a mesh stays an ordinary model.
  return nnx.with_partitioning(init, names, eager_sharding=False)


def normal_init(cfg: ModelConfig, names: tuple[str | None, ...]):
  return logical_init(nnx.initializers.normal(cfg.init_std), names)


def zeros_init(names: tuple[str | None, ...]):
  return logical_init(nnx.initializers.zeros, names)


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
    y = self.product(inputs).astype(jnp.float32)
    if rows is not None:
      y = y * rows
    if self.bias is not None:
      y = y + self.bias[...].astype(jnp.float32)
    return y.astype(out_dtype or self.dtype or jnp.result_type(inputs, self.kernel[...]))

  def rounds_product(self, rows: int) -> bool:
    """Whether `product` of `rows` input rows returns the layer's dtype (a GEMM
    on GPU), not float32."""
    return rows * self.kernel[...].size >= _REDUCED_PRODUCT

  def product(self, inputs: jax.Array) -> jax.Array:
    """`inputs @ kernel` without the bias, in float32 where XLA:GPU makes the
    product a reduction, else in the layer's dtype (`scaled`'s first step, which
    `specjax.kernels.append_attention` takes raw)."""
    kernel = self.kernel[...]
    dtype = self.dtype or jnp.result_type(inputs, kernel)
    wide = None if self.rounds_product(inputs.size // inputs.shape[-1]) else jnp.float32
    return jnp.dot(inputs.astype(dtype), kernel.astype(dtype), preferred_element_type=wide)


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
    self.scale = nnx.Param(logical_init(identity, (axis,))(key, (width,), cfg.weight_dtype))
    if cfg.norm == "layernorm":
      self.bias = nnx.Param(zeros_init((axis,))(key, (width,), cfg.weight_dtype))

  def folded(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """RMSNorm split for folding into the next product: `(x * scale [..., D] in
    the compute dtype, 1 / rms [..., 1] float32)`, whose product is `self(x)`
    (to rounding); the factor goes after the product (`Linear.scaled`)."""
    scaled, sums = self.folded_sums(x)
    return scaled, self.factor(sums)

  def folded_sums(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`folded` with the sums of squares `[..., 1]` float32 in place of 1 / rms."""
    x = x.astype(jnp.float32)
    sums = jnp.sum(jnp.square(x), axis=-1, keepdims=True)
    return (x * (self.offset + self.scale[...].astype(jnp.float32))).astype(self.dtype), sums

  def factor(self, sums: jax.Array) -> jax.Array:
    """1 / rms from `folded_sums`' sums of squares over the last axis (float32)."""
    return jax.lax.rsqrt(sums / self.scale.shape[-1] + self.eps)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x.astype(jnp.float32)
    if self.kind == "layernorm":
      x = x - jnp.mean(x, axis=-1, keepdims=True)
    x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.eps)
    x = x * (self.offset + self.scale[...].astype(jnp.float32))
    if self.kind == "layernorm":
      x = x + self.bias[...].astype(jnp.float32)
    return x.astype(self.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None, xp=jnp) -> jax.Array:
  """`[H/2]` inverse frequencies of the rotary embedding (with optional scaling),
  float32; `xp=numpy` makes them a constant of the program being traced."""
  h = head_dim
  inv_freq = 1.0 / (theta ** (xp.arange(0, h, 2, dtype=xp.float32) / h))
  if scaling is None:
    return inv_freq
  if scaling.kind == "linear":
    return xp.asarray(inv_freq / scaling.factor, dtype=xp.float32)
  wavelength = 2 * xp.pi / inv_freq
  long_limit = scaling.original_max_len / scaling.low_freq_factor
  short_limit = scaling.original_max_len / scaling.high_freq_factor
  scaled = xp.where(wavelength > long_limit, inv_freq / scaling.factor, inv_freq)
  # Between the limits, blend the scaled and unscaled frequencies linearly in
  # original_max_len / wavelength.
  blend = (scaling.original_max_len / wavelength - scaling.low_freq_factor) / (
    scaling.high_freq_factor - scaling.low_freq_factor
  )
  smoothed = (1 - blend) * scaled / scaling.factor + blend * scaled
  middle = (wavelength >= short_limit) & (wavelength <= long_limit)
  return xp.where(middle, smoothed, scaled)


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
