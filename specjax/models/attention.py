"""Attention implementations behind one call, chosen by `ModelConfig.attention`.

  attention(q [B, T, N, H], k [B, K, S, H], v [B, K, S, H], mask [B, T, S],
            scale=..., cap=..., impl=...) -> [B, T, N, H]

Every implementation computes the same function: query t of row b reads the
cache slots s where `mask[b, t, s]` is True (the mask keeps stale slots out).
"einsum" (`attend`) is the reference and the only one with soft-capping;
"dot_product" is `jax.nn.dot_product_attention`; "pallas" sends GPU decode calls
(T == 1, one run of slots per row) to JAX's Pallas decode kernel and everything
else to "dot_product". SPECJAX_PALLAS_INTERPRET=1 (read at trace time) runs the
kernel in interpret mode on any backend. Which to choose: docs/performance.md.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from specjax import compiler_options
from specjax.models.config import ATTENTION_IMPLS

_NEG_INF = -1e30  # finite so fully masked rows give uniform weights, never NaN
_INTERPRET_ENV = "SPECJAX_PALLAS_INTERPRET"
# The kernel's tiles: a block of keys is 16..128 slots, and every tile Triton
# loads must have a power-of-two size.
_MIN_BLOCK = 16
_MAX_SPLITS = 16  # the kernel's default split of the slots across programs
# The smallest live prefix the XLA paths cut the cache to (`_on_live_prefix`);
# the others double up to the capacity.
_MIN_PREFIX = 128


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
  """tanh(x / cap) * cap (Gemma 2's soft-capping); x itself when cap is None."""
  return x if cap is None else jnp.tanh(x / cap) * cap


def attend(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  mask: jax.Array,
  scale: float | None = None,
  cap: float | None = None,
) -> jax.Array:
  """Grouped-query attention: the reference implementation ("einsum").

  Args:
    q: `[B, T, N, H]` queries.
    k, v: `[B, K, S, H]` keys and values (N % K == 0).
    mask: `[B, T, S]` bool, True where query t may read slot s.
    scale: the factor on q.k (None: H ** -0.5).
    cap: soft-capping of the scaled scores, if any.

  Returns:
    `[B, T, N, H]` in q's dtype; scores and softmax run in float32.
  """
  b, t, n, h = q.shape
  kv_heads = k.shape[1]
  scale = h**-0.5 if scale is None else scale
  # [B, K, G, T, H]: batch dims (B, K) lead every matmul, no cache transpose.
  q = q.reshape(b, t, kv_heads, n // kv_heads, h).transpose(0, 2, 3, 1, 4)
  scores = jnp.einsum("bkgth,bksh->bkgts", q, k, preferred_element_type=jnp.float32) * scale
  scores = softcap(scores, cap)
  scores = jnp.where(mask[:, None, None, :, :], scores, _NEG_INF)
  weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = jnp.einsum("bkgts,bksh->bkgth", weights, v, preferred_element_type=jnp.float32)
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(q.dtype)


def dot_product_attend(
  q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float | None = None
) -> jax.Array:
  """`attend` (without soft-capping) through `jax.nn.dot_product_attention`, which
  takes `[B, S, K, H]`: each call transposes the layer's cache (maybe a copy)."""
  k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
  return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale)


def mask_span(mask: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`(start [B], stop [B], contiguous [])` of a decode mask `[B, S]`: row b's first
  and one past its last True; `contiguous` when every row reads exactly that
  (non-empty) run, as a causal or sliding-window mask does.
  """
  s = mask.shape[-1]
  start = jnp.argmax(mask, axis=-1).astype(jnp.int32)
  stop = (s - jnp.argmax(mask[:, ::-1], axis=-1)).astype(jnp.int32)
  count = jnp.sum(mask, axis=-1, dtype=jnp.int32)
  return start, stop, jnp.all((count > 0) & (count == stop - start))


def _kernel_tiling(q: jax.Array, k: jax.Array) -> tuple[int, int, bool] | None:
  """`(k_splits, block_k, interpret)` for the Pallas decode kernel, or None where
  it does not apply (static: shapes and backend only)."""
  t, h, s = q.shape[1], q.shape[3], k.shape[2]
  interpret = os.environ.get(_INTERPRET_ENV, "") == "1"
  if t != 1 or not (interpret or compiler_options.current_platform() == "gpu"):
    return None
  # Triton's dots need 16 or more along every axis, and its tiles power-of-two sizes.
  if h < _MIN_BLOCK or h & (h - 1) or s % _MIN_BLOCK:
    return None
  splits = next(d for d in range(_MAX_SPLITS, 0, -1) if s % (d * _MIN_BLOCK) == 0)
  block_k = next(bk for bk in (128, 64, 32, 16) if (s // splits) % bk == 0)
  return splits, block_k, interpret


def _pallas_decode(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  mask: jax.Array,
  scale: float | None,
  tiling: tuple[int, int, bool],
) -> jax.Array:
  """`attend` of one query per row through the Pallas decode kernel over slots
  `start <= s < stop` (`mask_span`; the caller guarantees that run is the mask)."""

  from jax.experimental.pallas.ops.gpu import decode_attention  # imports Triton bindings

  b, _, n, h = q.shape
  kv_heads, s = k.shape[1], k.shape[2]
  k_splits, block_k, interpret = tiling
  scale = h**-0.5 if scale is None else float(scale)
  start, stop, _ = mask_span(mask[:, 0])

  def kernel(q, k, v):
    # Rows and kv heads merge into one batch axis: [B * K, G, H] queries against
    # [B * K, S, H] keys, reshapes of the [B, K, S, H] cache that copy nothing.
    rows = b * kv_heads
    out = decode_attention.mqa(
      q.reshape(rows, n // kv_heads, h),
      k.reshape(rows, s, h),
      v.reshape(rows, s, h),
      jnp.repeat(start, kv_heads),
      jnp.repeat(stop, kv_heads),
      sm_scale=scale,
      block_k=block_k,
      k_splits=k_splits,
      interpret=interpret,
    )
    # Its last step (dividing by the softmax sums) promotes bfloat16 to float32.
    return out.reshape(b, 1, n, h).astype(q.dtype)

  return kernel(q, k, v)


def prefix_sizes(capacity: int) -> tuple[int, ...]:
  """The live-prefix lengths `_on_live_prefix` chooses among for a cache of
  `capacity` slots: `_MIN_PREFIX` doubling while below it, then the capacity."""
  sizes, size = [], _MIN_PREFIX
  while size < capacity:
    sizes.append(size)
    size *= 2
  return (*sizes, capacity)


def _on_live_prefix(fn, q, k, v, mask, spans: jax.Array) -> jax.Array:
  """`fn(q, k, v, mask)` over the cache's first P slots only, P the smallest of
  `prefix_sizes(S)` covering the batch's largest span, so the work follows the
  filled length rather than the capacity (at most twice the live prefix).

  The slots cut off are masked out in every row (the caller's promise, `spans`),
  so the result is the same function. One branch per size behind `lax.switch`
  (a static slice each: XLA reads the prefix in place or copies only it); a
  loop over blocks of slots with an online softmax measured no faster on CPU
  and would change the rounding.
  """
  sizes = prefix_sizes(k.shape[2])
  if len(sizes) == 1:
    return fn(q, k, v, mask)
  need = jnp.max(spans)
  index = jnp.sum(need > jnp.array(sizes[:-1], jnp.int32))  # the first size >= need

  def branch(size):
    return lambda q, k, v, mask: fn(q, k[:, :, :size], v[:, :, :size], mask[..., :size])

  return jax.lax.switch(index, [branch(size) for size in sizes], q, k, v, mask)


def attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  mask: jax.Array,
  *,
  scale: float | None = None,
  cap: float | None = None,
  impl: str = "einsum",
  contiguous: bool = True,
  spans: jax.Array | None = None,
) -> jax.Array:
  """Grouped-query attention by implementation `impl` (one of `ATTENTION_IMPLS`).

  Args: as `attend`'s (stale slots must be masked out), and
    contiguous: static: each row's mask is one run of slots (False for token
      trees: "pallas" then goes through "dot_product").
    spans: optional `[B]` int32: row b's queries read no slot at or past
      `spans[b]` (its mask is False there; a cached call's write start + T).
      With it the work follows the filled length, not the capacity: on CPU
      (and for "pallas" calls its kernel does not take) the XLA paths read the
      live prefix only (`_on_live_prefix`).

  Returns:
    `[B, T, N, H]` in q's dtype, equal to `attend`'s within rounding.
  """
  if impl not in ATTENTION_IMPLS:
    raise ValueError(f"attention impl must be one of {ATTENTION_IMPLS}, got {impl!r}.")
  if impl != "einsum" and cap is not None:
    raise ValueError(f"attention impl {impl!r} has no soft-capping (cap={cap!r}); use 'einsum'.")
  tiling = _kernel_tiling(q, k) if impl == "pallas" and contiguous else None
  if tiling is not None:
    return _pallas_decode(q, k, v, mask, scale, tiling)
  if impl == "einsum":
    fn = lambda q, k, v, mask: attend(q, k, v, mask, scale, cap)
  else:
    fn = lambda q, k, v, mask: dot_product_attend(q, k, v, mask, scale)
  # Elsewhere than CPU "einsum" and "dot_product" keep one program over the
  # whole capacity (a conditional per layer is launches on a GPU); "pallas"
  # asks for the work to follow the lengths everywhere.
  if spans is not None and (impl == "pallas" or compiler_options.current_platform() == "cpu"):
    return _on_live_prefix(fn, q, k, v, mask, spans)
  return fn(q, k, v, mask)
