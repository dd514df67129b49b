"""A decode call's attention in one GPU kernel: RoPE, the cache write and attention.

  append_attention(qkv [B, T, K, G + 2, H], lo, hi, starts,
                   k_cache [B, K, S, H], v_cache [B, K, S, H], scale=...)
    -> (out [B, T, K * G, H], k_cache, v_cache)

XLA:GPU compiles a decode layer's attention to six kernels: q's RoPE, k's RoPE
with its cache write, v's cache write, the scores' product, the softmax and the
values' product (docs/accelerators.md). Here one Pallas (Triton) kernel per (row,
kv head) takes the fused projection's raw output, applies the folded norm's
factor, the bias and RoPE, writes the T new keys and values into the caches in
place (aliased: no copy of the cache) and attends to the row's live slots, an
online softmax in float32 over blocks of old slots (the loop's bounds are the
row's first and last live block: the work follows the filled length, not the
capacity) and then the T new keys held in registers. Values are rounded where
`specjax.models.block.Attention`'s XLA path rounds them (q, k and v to the cache
dtype after RoPE), so the outputs agree with it to bfloat16 rounding.

For GPU decode calls (`applies`: T * G <= 64 query rows, a power-of-two head
size); SPECJAX_PALLAS_INTERPRET=1 runs it in interpret mode on any backend (the
tests). Compiled for an H100 on a CPU (specjax.aot); not yet timed on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from specjax.kernels.tiles import pow2_at_least

_NEG_INF = -1e30  # finite: a query reading no slot gets zeros, never NaN
# Query rows (T * G) one program holds: the draft and verify calls of speculative
# decoding (T = gamma + 1 <= 16 with G <= 4) fit, a prompt does not.
MAX_ROWS = 64
# Below 16 rows Triton's dot does not apply: scores and values are broadcast
# products summed in registers, [rows, block, H] elements per block at most this.
_BROADCAST_ELEMENTS = 8192


def applies(t: int, n_heads: int, kv_heads: int, head_dim: int, capacity: int) -> bool:
  """Whether a call of `t` queries per row takes the kernel (static shapes only)."""
  rows = t * (n_heads // kv_heads)
  half = head_dim // 2
  # The padded new slots' addresses wrap around the capacity (`_kernel`).
  return (
    rows <= MAX_ROWS
    and head_dim % 2 == 0
    and half >= 8
    and half & (half - 1) == 0
    and capacity >= max(16, 2 * pow2_at_least(t))
  )


def _block(rows: int, head_dim: int, capacity: int) -> int:
  """Slots per block of the old-slot loop (a power of two; the last block is
  masked), bounded by the registers a program holds on the broadcast path."""
  if rows >= 16:
    block = 64
  else:
    block = max(8, min(64, _BROADCAST_ELEMENTS // (rows * head_dim)))
  return min(block, pow2_at_least(capacity))


def _scores(q1, q2, k1, k2, dot: bool):
  """`[R, C]` q.k of `q1, q2 [R, H/2]` against `k1, k2 [C, H/2]`, float32."""
  if dot:
    from jax.experimental.pallas import triton as plgpu

    return plgpu.dot(q1, k1.T) + plgpu.dot(q2, k2.T)
  return jnp.sum(q1[:, None, :] * k1[None], axis=2) + jnp.sum(q2[:, None, :] * k2[None], axis=2)


def _weighted(p, v, dot: bool):
  """`[R, H]` weights `p [R, C]` times values `v [C, H]`, float32."""
  if dot:
    from jax.experimental.pallas import triton as plgpu

    return plgpu.dot(p.astype(v.dtype), v).astype(jnp.float32)
  return jnp.sum(p.astype(v.dtype).astype(jnp.float32)[:, :, None] * v[None].astype(jnp.float32), 1)


@dataclasses.dataclass(frozen=True)
class _Static:
  """A call's static settings (`append_attention`'s shapes and options)."""

  batch: int  # B
  t: int  # queries per row
  g: int  # query heads per kv head
  kv_heads: int
  h: int  # head size
  capacity: int  # S
  scale: float
  block: int  # old slots per loop step
  rope: bool
  norm: tuple | None  # (width, eps) of a folded RMSNorm, or None
  biased: bool
  scratch: bool  # padded query rows write scratch rows (interpreted)

  @property
  def rows(self) -> int:  # query rows per program, padded
    return pow2_at_least(self.t * self.g)

  @property
  def news(self) -> int:  # new slots per program, padded
    return pow2_at_least(self.t)

  @property
  def dot(self) -> bool:  # Triton's dot applies (16 or more along every axis)
    return self.rows >= 16 and self.block >= 16 and self.h // 2 >= 16


class _Refs(NamedTuple):
  """The kernel's operands (2-D refs: `append_attention` flattens them)."""

  qkv: Any
  lo: Any
  hi: Any
  starts: Any
  k: Any
  v: Any
  sums: Any
  bias: Any
  inv_freq: Any
  out: Any
  k_out: Any
  v_out: Any


def _factor(st: _Static, refs: _Refs, b, query_t, valid):
  """`[R]` the folded RMSNorm's 1 / rms of queries `query_t`, from their sums of squares."""
  from jax.experimental.pallas import triton as plgpu

  width, eps = st.norm
  sums = plgpu.load(refs.sums.at[b * st.t + query_t], mask=valid, other=1)
  # Padded rows get 0, finite: their zeros must not turn NaN in a product.
  return jnp.where(valid, jax.lax.rsqrt(sums / width + eps), 0.0)


def _projection(st: _Static, refs: _Refs, b, j, query_t, part, valid, lanes):
  """`[R, width]` pieces (columns `lanes`: (first, width) pairs) of projection
  `part` of kv head j for queries `query_t [R]`: scaled by the norm, biased and
  rounded to the cache's dtype, as the XLA path's `Linear.scaled`, in float32."""
  from jax.experimental.pallas import triton as plgpu

  flat = ((b * st.t + query_t) * st.kv_heads + j) * (st.g + 2) + part
  pieces = []
  for column, width in lanes:
    y = plgpu.load(_at(refs.qkv, flat, column, width), mask=valid[:, None], other=0)
    y = y.astype(jnp.float32)
    if st.norm:
      y = y * _factor(st, refs, b, query_t, valid)[:, None]
    if st.biased:
      y = y + plgpu.load(_at(refs.bias, j * (st.g + 2) + part, column, width)).astype(jnp.float32)
    pieces.append(y.astype(refs.k.dtype).astype(jnp.float32))
  return pieces


def _rotated(st: _Static, refs: _Refs, b, query_t, valid, halves):
  """RoPE on the float32 halves `[R, H/2]` of queries `query_t`, rounded to the
  cache's dtype (what `apply_rope` rounds)."""
  from jax.experimental.pallas import triton as plgpu

  if st.rope:
    half = st.h // 2
    position = refs.starts[b] + query_t  # a contiguous call's positions are its slots
    inv_freq = plgpu.load(refs.inv_freq.at[jnp.arange(half, dtype=jnp.int32)])
    # RoPE's angles here: XLA computed cos and sin in a kernel each per call.
    angles = position.astype(jnp.float32)[:, None] * inv_freq[None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    a, b_ = halves  # rotate-half
    halves = (a * cos - b_ * sin, b_ * cos + a * sin)
  return [x.astype(refs.k.dtype) for x in halves]


def _append(st: _Static, refs: _Refs, b, j, start):
  """The T new keys (halves, `[T', H/2]` each) and values `[T', H]` of kv head j,
  written to slots `start + t` of the caches (T' = T padded)."""
  from jax.experimental.pallas import triton as plgpu

  half = st.h // 2
  new = jnp.arange(st.news, dtype=jnp.int32)
  fresh = new < st.t
  new_t = jnp.minimum(new, st.t - 1)
  key = jnp.full((st.news,), st.g, jnp.int32)
  halves = _projection(st, refs, b, j, new_t, key, fresh, ((0, half), (half, half)))
  k1, k2 = _rotated(st, refs, b, new_t, fresh, halves)
  (v,) = _projection(st, refs, b, j, new_t, key + 1, fresh, ((0, st.h),))
  v = v.astype(refs.v.dtype)
  slot = start + new
  writes = (fresh & (slot < st.capacity))[:, None]
  # Masked lanes still name an address (the interpreter writes back what it
  # read): one no live lane names, past the new slots modulo the capacity.
  at = (b * st.kv_heads + j) * st.capacity + slot % st.capacity
  plgpu.store(_at(refs.k_out, at, 0, half), k1, mask=writes)
  plgpu.store(_at(refs.k_out, at, half, half), k2, mask=writes)
  plgpu.store(_at(refs.v_out, at, 0, st.h), v, mask=writes)
  return k1, k2, v


def _attend_old(st: _Static, refs: _Refs, base, q1, q2, lo, old_hi, live):
  """The online softmax `(max [R], total [R], acc [R, H])` of the query rows over
  their old slots: blocks of `st.block` from the first any row reads to the last
  (bounds are data: the work follows the filled length, not the capacity)."""
  from jax.experimental.pallas import triton as plgpu

  half, block = st.h // 2, st.block
  f32 = (lambda x: x) if st.dot else (lambda x: x.astype(jnp.float32))
  q1, q2 = f32(q1), f32(q2)

  def step(i, carry):
    m, total, acc = carry
    slots = i * block + jnp.arange(block, dtype=jnp.int32)
    inside = (slots < st.capacity)[:, None]
    at = base + jnp.minimum(slots, st.capacity - 1)
    k1, k2 = (plgpu.load(_at(refs.k, at, c, half), mask=inside, other=0) for c in (0, half))
    s = _scores(q1, q2, f32(k1), f32(k2), st.dot)
    keep = (slots[None, :] >= lo[:, None]) & (slots[None, :] < old_hi[:, None])
    m, total, p, alpha = _softmax_step(m, total, jnp.where(keep, s * st.scale, _NEG_INF), keep)
    values = plgpu.load(_at(refs.v, at, 0, st.h), mask=inside, other=0)
    return m, total, alpha[:, None] * acc + _weighted(p, values, st.dot)

  first = jnp.min(jnp.where(live, lo, st.capacity)) // block
  last = (jnp.max(jnp.where(live, old_hi, 0)) + block - 1) // block
  init = (
    jnp.full((st.rows,), _NEG_INF, jnp.float32),
    jnp.zeros((st.rows,), jnp.float32),
    jnp.zeros((st.rows, st.h), jnp.float32),
  )
  return jax.lax.fori_loop(first, last, step, init)


def _softmax_step(m, total, s, keep):
  """One block of an online softmax: `(max, total, p, alpha)` after scores `s [R, C]`."""
  m_next = jnp.maximum(m, jnp.max(s, axis=1))
  p = jnp.where(keep, jnp.exp(s - m_next[:, None]), 0.0)
  alpha = jnp.exp(m - m_next)
  return m_next, alpha * total + jnp.sum(p, axis=1), p, alpha


def _kernel(st: _Static):
  """The body for one (row b, kv head j) program: its T * G query rows and T new
  keys and values (`append_attention`)."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plgpu

  half = st.h // 2

  def kernel(*operands):
    given = list(operands[6:-3])
    take = lambda present: given.pop(0) if present else None
    sums, bias = take(st.norm), take(st.biased)
    inv_freq = take(st.rope)
    refs = _Refs(*operands[:6], sums, bias, inv_freq, *operands[-3:])
    b, j = pl.program_id(0), pl.program_id(1)
    start = refs.starts[b]
    r = jnp.arange(st.rows, dtype=jnp.int32)
    live = r < st.t * st.g
    query_t = jnp.minimum(r // st.g, st.t - 1)
    halves = _projection(st, refs, b, j, query_t, r % st.g, live, ((0, half), (half, half)))
    q1, q2 = _rotated(st, refs, b, query_t, live, halves)
    k1, k2, v = _append(st, refs, b, j, start)
    lo = plgpu.load(refs.lo.at[b * st.t + query_t])  # [R]: each query row's run of slots
    hi = plgpu.load(refs.hi.at[b * st.t + query_t])
    old_hi = jnp.minimum(hi, start)  # old slots: the new ones are in registers
    base = (b * st.kv_heads + j) * st.capacity
    m, total, acc = _attend_old(st, refs, base, q1, q2, lo, old_hi, live)
    # The T new slots: query t reads new slot t' <= t where it lies in its run.
    new = jnp.arange(st.news, dtype=jnp.int32)
    slot = start + new
    keep = (
      (new[None, :] < st.t)
      & (new[None, :] <= query_t[:, None])
      & (slot[None, :] >= lo[:, None])
      & (slot[None, :] < hi[:, None])
    )
    f32 = lambda x: x.astype(jnp.float32)
    s = jnp.where(keep, _scores(f32(q1), f32(q2), f32(k1), f32(k2), False) * st.scale, _NEG_INF)
    m, total, p, alpha = _softmax_step(m, total, s, keep)
    acc = alpha[:, None] * acc + _weighted(p, v, False)
    out = acc / jnp.where(total > 0, total, 1.0)[:, None]
    at = (b * st.t + query_t) * st.kv_heads * st.g + j * st.g + r % st.g
    if st.scratch:  # padded rows name scratch rows past the real ones (distinct)
      at = jnp.where(live, at, st.batch * st.t * st.kv_heads * st.g + r)
    plgpu.store(_at(refs.out, at, 0, st.h), out.astype(refs.out.dtype), mask=live[:, None])

  return kernel


def _at(ref, rows: jax.Array, column: int, width: int):
  """`ref[rows, column:column + width]` of a 2-D ref, `[len(rows), width]`, as
  index arrays on both axes (what both Triton and the interpreter take)."""
  return ref.at[rows[:, None], column + jnp.arange(width, dtype=jnp.int32)[None, :]]


@functools.partial(jax.jit, static_argnames=("scale", "norm_width", "norm_eps", "interpret"))
def append_attention(
  qkv: jax.Array,
  lo: jax.Array,
  hi: jax.Array,
  starts: jax.Array,
  k_cache: jax.Array,
  v_cache: jax.Array,
  sums: jax.Array | None = None,
  bias: jax.Array | None = None,
  inv_freq: jax.Array | None = None,
  *,
  scale: float,
  norm_width: int = 0,
  norm_eps: float = 0.0,
  interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One decode call's attention for a layer, its new keys and values written.

  Args:
    qkv: `[B, T, K, G + 2, H]`: the fused projection's raw product (kv head k's
      G queries, its key, its value; `specjax.models.fused`), before `rows` and
      `bias`.
    lo, hi: `[B, T]` int32: query t of row b reads slots `lo <= s < hi` (its
      mask's one run; `hi` past its own new slot).
    starts: `[B]` int32: the T new keys and values go to slots `starts + t`.
    k_cache, v_cache: `[B, K, S, H]`, updated in place.
    sums: `[B, T]` float32: a folded RMSNorm's sums of squares over its
      `norm_width` features (or None); every product is scaled by
      `rsqrt(sums / norm_width + norm_eps)` (`specjax.models.layers.Norm.folded`),
      computed here so that no kernel of its own computes it first.
    bias: `[K, G + 2, H]`, the projection's bias (or None).
    inv_freq: `[H / 2]` float32: RoPE's frequencies, or None (no RoPE). Query t
      of row b sits at position `starts[b] + t`, the slot it is written to (a
      contiguous call of `specjax.models.transformer`), so its angles are
      `(starts + t) * inv_freq`, as `apply_rope`'s.
    scale: the factor on q.k.
    interpret: run the kernel in interpret mode (any backend).

  Returns:
    `(out [B, T, K * G, H], k_cache, v_cache)`, out and the caches in the cache's dtype.
  """
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plgpu

  b, t, kv_heads, parts, h = qkv.shape
  g = parts - 2
  capacity = k_cache.shape[2]
  rows_count = pow2_at_least(t * g)
  block = _block(rows_count, h, capacity)
  scratch = interpret and rows_count > t * g
  kernel = _kernel(
    _Static(
      batch=b,
      t=t,
      g=g,
      kv_heads=kv_heads,
      h=h,
      capacity=capacity,
      scale=float(scale),
      block=block,
      rope=inv_freq is not None,
      norm=None if sums is None else (norm_width, norm_eps),
      biased=bias is not None,
      scratch=scratch,
    )
  )
  flat = lambda x: x.reshape(-1, x.shape[-1])
  args = [
    flat(qkv),
    lo.reshape(-1).astype(jnp.int32),
    hi.reshape(-1).astype(jnp.int32),
    starts.astype(jnp.int32),
    flat(k_cache),
    flat(v_cache),
  ]
  if sums is not None:
    args.append(sums.reshape(-1).astype(jnp.float32))
  if bias is not None:
    args.append(flat(bias.reshape(kv_heads * parts, h)))
  if inv_freq is not None:
    args.append(inv_freq.astype(jnp.float32))
  dtype = k_cache.dtype
  out, keys, values = pl.pallas_call(
    kernel,
    grid=(b, kv_heads),
    out_shape=[
      # Interpreted, padded rows write scratch rows past the real ones (masked
      # stores there write back what they read). A GPU's masked stores write nothing.
      jax.ShapeDtypeStruct((b * t * kv_heads * g + (rows_count if scratch else 0), h), dtype),
      jax.ShapeDtypeStruct(args[4].shape, dtype),
      jax.ShapeDtypeStruct(args[5].shape, v_cache.dtype),
    ],
    input_output_aliases={4: 1, 5: 2},
    compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
    interpret=interpret,
    name="specjax_append_attention",
  )(*args)
  if scratch:
    out = out[: b * t * kv_heads * g]
  out = out.reshape(b, t, kv_heads * g, h)
  return out, keys.reshape(k_cache.shape), values.reshape(v_cache.shape)
