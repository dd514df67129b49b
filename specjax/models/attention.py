"""Attention implementations behind one call, chosen by `ModelConfig.attention`.

  attention(q [B, T, N, H], k [B, K, S, H], v [B, K, S, H], mask [B, T, S],
            scale=..., cap=..., impl=...) -> [B, T, N, H]

Every implementation computes the same function: query t of row b reads the
cache slots s where `mask[b, t, s]` is True (the mask keeps stale slots out).
"einsum" (`attend`) is the reference and the only one with soft-capping;
"dot_product" is `jax.nn.dot_product_attention`; "pallas" sends GPU decode calls
(T == 1, one run of slots per row) to JAX's Pallas (Triton) decode kernel, TPU
calls with one run of slots per query to a Pallas (Mosaic) kernel of its own
(`_tpu_attend`), and everything else to "einsum" over the live prefix. "auto"
and "pallas" GPU decode calls of up to 64 query rows per kv head never reach
here: `specjax.models.block.Attention` sends them, projections' RoPE and cache
write included, to `specjax.kernels.append_attention`; what reaches here as
"auto" runs as "einsum".
SPECJAX_PALLAS_INTERPRET=1 (read at trace time) runs the GPU kernel in interpret
mode on any backend.

With per-row `spans` (a cached call's write start + T) the work follows the
filled length, not the cache's capacity: the kernels stop at each row's last
slot, and the XLA paths (every impl on CPU; "pallas" where no kernel applies)
read only a power-of-two prefix of the cache covering the batch's longest row
(`_on_live_prefix`). Which to choose: docs/performance.md.
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


def query_runs(mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`(lo, hi)`, each `[B, T]` int32: the run of slots `lo <= s < hi` each query
  of a contiguous mask `[B, T, S]` reads (empty, lo >= hi, for one reading none)."""
  s = mask.shape[-1]
  slots = jnp.arange(s, dtype=jnp.int32)
  # One variadic reduction (one kernel on a GPU; XLA left a min and a max apart).
  # A query reading no slot gets lo = S > hi = 0, a run the kernels read none of.
  return jax.lax.reduce(
    (jnp.where(mask, slots, s), jnp.where(mask, slots + 1, 0)),
    (jnp.int32(s), jnp.int32(0)),
    lambda a, b: (jnp.minimum(a[0], b[0]), jnp.maximum(a[1], b[1])),
    (mask.ndim - 1,),
  )


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


def interpret_kernels() -> bool:
  """Whether the GPU kernels run in interpret mode (SPECJAX_PALLAS_INTERPRET=1, read
  at trace time): on any backend, for tests."""
  return os.environ.get(_INTERPRET_ENV, "") == "1"


def _kernel_tiling(q: jax.Array, k: jax.Array) -> tuple[int, int, bool] | None:
  """`(k_splits, block_k, interpret)` for the Pallas decode kernel, or None where
  it does not apply (static: shapes and backend only)."""
  t, h, s = q.shape[1], q.shape[3], k.shape[2]
  interpret = interpret_kernels()
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


_TPU_BLOCK = 128  # slots per copy into VMEM: the lane width, so every tile is whole


def tpu_tiling(q: jax.Array, k: jax.Array) -> int | None:
  """Slots per block of the TPU kernel (`_tpu_attend`), or None where it does not
  apply (static: the capacity must be whole blocks)."""
  s = k.shape[2]
  block = min(_TPU_BLOCK, s)
  return block if s % block == 0 and block % 8 == 0 else None


def _ragged_kernel(*, t: int, g: int, h: int, block: int, scale: float, slots_minor: bool):
  """The body of `_tpu_attend`'s Pallas kernel for one (row, kv head): its `T * G`
  query rows against the live blocks of `block` slots, an online softmax in
  float32 carried through a loop whose bounds are the row's scalar-prefetched
  first and last block (`slots_minor`: the cache is `[H, S]` in memory)."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import tpu as pltpu

  rows = t * g
  k_head_axis, v_slot_axis = (0, 1) if slots_minor else (1, 0)  # in a block of k, of v

  def kernel(lo_ref, hi_ref, first_ref, stop_ref, q_ref, k_hbm, v_hbm, o_ref, k_buf, v_buf, sems):
    row, head = pl.program_id(0), pl.program_id(1)
    query = q_ref[...]  # [T * G, H]
    index = jax.lax.broadcasted_iota(jnp.int32, (rows, block), 0)
    lo_rows = jnp.zeros((rows, block), jnp.int32)
    hi_rows = jnp.zeros((rows, block), jnp.int32)
    for i in range(t):  # static: each query's bounds onto its G rows
      mine = (index >= i * g) & (index < (i + 1) * g)
      lo_rows = jnp.where(mine, lo_ref[row * t + i], lo_rows)
      hi_rows = jnp.where(mine, hi_ref[row * t + i], hi_rows)

    def step(j, carry):
      m, total, acc = carry
      slots = pl.ds(pl.multiple_of(j * block, block), block)
      at = (row, head, slice(None), slots) if slots_minor else (row, head, slots)
      copy_k = pltpu.make_async_copy(k_hbm.at[at], k_buf, sems.at[0])
      copy_v = pltpu.make_async_copy(v_hbm.at[at], v_buf, sems.at[1])
      copy_k.start()
      copy_v.start()
      copy_k.wait()
      scores = jax.lax.dot_general(
        query, k_buf[...], (((1,), (k_head_axis,)), ((), ())), preferred_element_type=jnp.float32
      )
      slot = j * block + jax.lax.broadcasted_iota(jnp.int32, (rows, block), 1)
      keep = (slot >= lo_rows) & (slot < hi_rows)
      scores = jnp.where(keep, scores * scale, _NEG_INF)
      m_next = jnp.maximum(m, jnp.max(scores, axis=1, keepdims=True))
      p = jnp.where(keep, jnp.exp(scores - m_next), 0.0)
      alpha = jnp.exp(m - m_next)
      copy_v.wait()
      pv = jax.lax.dot_general(
        p.astype(v_buf.dtype),
        v_buf[...],
        (((1,), (v_slot_axis,)), ((), ())),
        preferred_element_type=jnp.float32,
      )
      return m_next, alpha * total + jnp.sum(p, axis=1, keepdims=True), alpha * acc + pv

    init = (
      jnp.full((rows, 1), _NEG_INF, jnp.float32),
      jnp.zeros((rows, 1), jnp.float32),
      jnp.zeros((rows, h), jnp.float32),
    )
    # The loop's bounds are data: the blocks past a row's length are never copied.
    _, total, acc = jax.lax.fori_loop(first_ref[row], stop_ref[row], step, init)
    o_ref[...] = (acc / jnp.where(total > 0, total, 1.0)).astype(o_ref.dtype)

  return kernel


def _tpu_attend(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  mask: jax.Array,
  scale: float | None,
  block: int,
  interpret: bool = False,
) -> jax.Array:
  """`attend` through a Pallas (Mosaic) kernel whose loop reads only each row's
  live slots: copies of `block` slots from HBM, from the first block any query
  of row b reads to the last, so its bytes and work follow the lengths, not
  the capacity. Each query row's mask must be one run of slots (`mask_span`:
  causal or windowed, T >= 1). A query reading no slot gets zeros.

  One program per (row, kv head): the G * T queries `[T * G, H]` of that head
  against blocks of `block` slots of its keys and values, an online softmax in
  float32 carried through the loop. XLA:TPU stores an array whose last axis is
  under 128 wide with its last two axes swapped (a `[B, K, S, 64]` cache is
  `[B, K, 64, S]` in memory, slots along the lanes); the kernel reads the cache
  that way (blocks `[H, block]`), so XLA passes it as it is and copies nothing.
  Each block's two copies are waited for before its products (no double
  buffering yet: not timed on a TPU).
  """
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import tpu as pltpu

  b, t, n, h = q.shape
  kv_heads = k.shape[1]
  g = n // kv_heads
  rows = t * g
  scale = h**-0.5 if scale is None else float(scale)
  # Per query: the run of slots it reads (`query_runs`: lo >= hi for a query that
  # reads none, which then bounds no block), [B * T] each (1-D: SMEM pads 2-D arrays).
  lo, hi = query_runs(mask)
  first = jnp.min(lo, axis=1) // block  # [B]: the row's first block
  stop = (jnp.max(hi, axis=1) + block - 1) // block  # one past its last
  lo, hi = lo.reshape(b * t), hi.reshape(b * t)
  # [B, K, T * G, H]: query row r = t * G + g reads with query t's bounds.
  q_rows = q.reshape(b, t, kv_heads, g, h).transpose(0, 2, 1, 3, 4).reshape(b, kv_heads, rows, h)
  slots_minor = h % 128 != 0  # the cache's layout in TPU memory (above)
  if slots_minor:
    k, v = jnp.swapaxes(k, 2, 3), jnp.swapaxes(v, 2, 3)  # [B, K, H, S]: a bitcast there

  kernel = _ragged_kernel(t=t, g=g, h=h, block=block, scale=scale, slots_minor=slots_minor)

  head_block = pl.BlockSpec((None, None, rows, h), lambda i, j, *_: (i, j, 0, 0))
  # Left where XLA keeps it (in place, no copy); the kernel copies in only the blocks it reads.
  any_space = pl.BlockSpec(memory_space=pl.ANY)
  out = pl.pallas_call(
    kernel,
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=4,
      grid=(b, kv_heads),
      in_specs=[head_block, any_space, any_space],
      out_specs=head_block,
      scratch_shapes=[
        pltpu.VMEM((h, block) if slots_minor else (block, h), k.dtype),
        pltpu.VMEM((h, block) if slots_minor else (block, h), v.dtype),
        pltpu.SemaphoreType.DMA((2,)),
      ],
    ),
    out_shape=jax.ShapeDtypeStruct(q_rows.shape, q.dtype),
    compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
    interpret=pltpu.InterpretParams() if interpret else False,
    name="specjax_ragged_attention",
  )(lo, hi, first.astype(jnp.int32), stop.astype(jnp.int32), q_rows, k, v)
  return out.reshape(b, kv_heads, t, g, h).transpose(0, 2, 1, 3, 4).reshape(b, t, n, h)


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
  (a static slice each: XLA reads the prefix in place or copies only it). A
  loop over blocks with an online softmax, the other way, was not tried: its
  sums would round differently from the reference's.
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
  if impl == "auto":  # what the block did not send to its one-kernel path
    impl = "einsum"
  if impl != "einsum" and cap is not None:
    raise ValueError(f"attention impl {impl!r} has no soft-capping (cap={cap!r}); use 'einsum'.")
  tiling = _kernel_tiling(q, k) if impl == "pallas" and contiguous else None
  if tiling is not None:
    return _pallas_decode(q, k, v, mask, scale, tiling)
  if impl == "pallas" and contiguous and compiler_options.current_platform() == "tpu":
    block = tpu_tiling(q, k)
    if block is not None:
      return _tpu_attend(q, k, v, mask, scale, block)
  if impl == "dot_product":
    fn = lambda q, k, v, mask: dot_product_attend(q, k, v, mask, scale)
  else:
    # "pallas" where its kernels do not apply: the einsums read the cache in its
    # own layout. (Through "dot_product" XLA:GPU moved the live prefix's slice
    # after the `[B, S, K, H]` transpose: a transpose of the whole capacity.)
    fn = lambda q, k, v, mask: attend(q, k, v, mask, scale, cap)
  # Elsewhere than CPU "einsum" and "dot_product" keep one program over the
  # whole capacity (a conditional per layer is launches on a GPU); "pallas"
  # asks for the work to follow the lengths everywhere.
  if spans is not None and (impl == "pallas" or compiler_options.current_platform() == "cpu"):
    return _on_live_prefix(fn, q, k, v, mask, spans)
  return fn(q, k, v, mask)
