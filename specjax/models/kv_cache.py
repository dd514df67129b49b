"""Static-shape KV cache with per-row lengths.

A call writes row b's T new tokens at slots `lengths[b] ..` and never reads
slots at or past a row's length, so rolling back a rejected draft is
bookkeeping: lower `lengths[b]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specjax.distributed.mesh import constrain

CACHE_AXES = ("batch", "cache_heads", "cache_seq", "head_dim")  # logical names of k and v
STACKED_CACHE_AXES = ("batch", "layers", *CACHE_AXES[1:])  # of a scanned model's stacked k, v


@struct.dataclass
class KVCache:
  """Per-layer keys and values plus per-row lengths.

  Attributes:
    k: tuple of L arrays `[B, K, S, H]` (heads before slots: no transpose for
      attention), or one stacked `[B, L, K, S, H]` array (scanned layers).

    v: like k.
    lengths: `[B]` int32, valid slots per row (= position of the next token).
  """

  k: tuple[jax.Array, ...] | jax.Array
  v: tuple[jax.Array, ...] | jax.Array
  lengths: jax.Array

  @classmethod
  def zeros(
    cls,
    *,
    n_layers: int,
    batch: int,
    capacity: int,
    n_kv_heads: int,
    head_dim: int,
    dtype,
    stacked: bool = False,
  ) -> KVCache:
    """An empty cache of `capacity` slots per row (all lengths 0); `stacked`:
    one `[B, L, K, S, H]` array each for k and v (scanned layers)."""
    lengths = constrain(jnp.zeros((batch,), jnp.int32), ("batch",))
    if stacked:
      shape = (batch, n_layers, n_kv_heads, capacity, head_dim)
      zeros = lambda: constrain(jnp.zeros(shape, dtype), STACKED_CACHE_AXES)
      return cls(k=zeros(), v=zeros(), lengths=lengths)
    shape = (batch, n_kv_heads, capacity, head_dim)
    # Under a mesh: rows over data, kv heads over model (a no-op without one).
    zeros = lambda: constrain(jnp.zeros(shape, dtype), CACHE_AXES)
    return cls(
      k=tuple(zeros() for _ in range(n_layers)),
      v=tuple(zeros() for _ in range(n_layers)),
      lengths=lengths,
    )

  @property
  def stacked(self) -> bool:
    """True for a scanned model's cache (one `[B, L, K, S, H]` array each)."""
    return not isinstance(self.k, (tuple, list))

  @property
  def num_layers(self) -> int:
    """L, the layers the cache holds."""
    return self.k.shape[1] if self.stacked else len(self.k)

  @property
  def capacity(self) -> int:
    """S, the static number of slots per row."""
    return self.k.shape[3] if self.stacked else self.k[0].shape[2]

  def with_lengths(self, lengths: jax.Array) -> KVCache:
    """The same slots with new per-row lengths (rollback or commit)."""
    return self.replace(lengths=jnp.asarray(lengths, jnp.int32))

  def gather_path(self, path: jax.Array, base: jax.Array) -> KVCache:
    """Moves an accepted tree path into consecutive slots (lengths unchanged).

    Node i sits at slot `base[b] + i`; the accepted nodes `path [B, D]` (-1
    padded) move to slots `base[b] + d`: a static gather of D slots per layer.
    """

    d = path.shape[1]
    nodes = jnp.where(path >= 0, path, jnp.arange(d, dtype=path.dtype)[None, :])
    index = base[:, None] + nodes  # [B, D]

    def move(x):  # x [B, ..., S, H]: slots at axis -2
      lead = (1,) * (x.ndim - 3)
      at = index.reshape(index.shape[0], *lead, d, 1)
      return write_rows(x, jnp.take_along_axis(x, at, axis=-2), base, axis=x.ndim - 2)

    if self.stacked:
      return self.replace(k=move(self.k), v=move(self.v))
    return self.replace(k=tuple(map(move, self.k)), v=tuple(map(move, self.v)))


def cache_capacity(prompt_width: int, max_new_tokens: int, gamma: int | None = None) -> int:
  """KV-cache slots per row for one generate call: the one formula for it (the
  prompt, the budget and, unless `gamma` is None, a verification block's slack)."""
  slack = 0 if gamma is None else gamma + 1
  return int(prompt_width) + int(max_new_tokens) + slack


def check_capacity(
  role: str, max_seq_len: int, prompt_width: int, max_new_tokens: int, gamma: int | None = None
) -> int:
  """Returns `cache_capacity(...)`; raises a ValueError naming `role` (e.g. "target")
  when it exceeds that model's `max_seq_len`."""
  needed = cache_capacity(prompt_width, max_new_tokens, gamma)
  if needed > max_seq_len:
    extra = "" if gamma is None else f" + gamma + 1 ({gamma + 1})"
    raise ValueError(
      f"{role}: prompt width ({prompt_width}) + max_new_tokens ({max_new_tokens}){extra} = "
      f"{needed} exceeds max_seq_len={max_seq_len}; shorten the prompt or lower "
      "max_new_tokens."
    )
  return needed


def write_rows(
  buffer: jax.Array, update: jax.Array, starts: jax.Array, axis: int = 1, leading: tuple = ()
) -> jax.Array:
  """Writes `update[b]` into `buffer[b]` at offset `starts[b]` along `axis`.

  Args:
    buffer: `[B, ..., S, ...]` with S at `axis`.
    update: like buffer but T <= S along `axis` (1 along the `leading` axes).
    starts: `[B]` int32; callers guarantee `starts + T <= S` (XLA would clamp).
    leading: offsets shared by all rows along the axes after B (a stacked
      cache's layer).
  """
  b, t = buffer.shape[0], update.shape[axis]
  if b == 1:  # a plain dynamic_update_slice (XLA rewrites a 1-row scatter as one plus a select)
    index = [0, *leading] + [0] * (buffer.ndim - 1 - len(leading))
    index[axis] = starts[0]
    return jax.lax.dynamic_update_slice(buffer, update.astype(buffer.dtype), tuple(index))
  # One scatter with its indices promised in bounds, which XLA runs in place. (A
  # vmapped dynamic_update_slice is a scatter that clamps its indices first.) The
  # rows are the scatter's batching dimension, not an index: on a mesh that splits
  # them over devices, each then writes its own rows, where an explicit row index
  # made XLA gather every row's update and index to every device first.
  n = len(leading)
  slots = starts.astype(jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]
  coords = [jnp.broadcast_to(jnp.asarray(i, jnp.int32), (b, t)) for i in leading]
  indices = jnp.stack([*coords, slots], axis=-1)  # [B, T, n + 1]: (leading..., slot)
  # The update as [B, T, the other axes]: its leading axes (size 1) dropped, T next to B.
  new = update.reshape(update.shape[:1] + update.shape[1 + n :])
  new = jnp.moveaxis(new, axis - n, 1)
  scattered = (*range(1, 1 + n), axis)
  numbers = jax.lax.ScatterDimensionNumbers(
    update_window_dims=tuple(range(2, new.ndim)),
    inserted_window_dims=scattered,
    scatter_dims_to_operand_dims=scattered,
    operand_batching_dims=(0,),
    scatter_indices_batching_dims=(0,),
  )
  return jax.lax.scatter(
    buffer,
    indices,
    new.astype(buffer.dtype),
    numbers,
    indices_are_sorted=True,
    unique_indices=True,
    mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS,
  )


def write_layer(layer_cache: tuple, k: jax.Array, v: jax.Array, starts: jax.Array):
  """Writes one layer's T new keys and values `k, v [B, K, T, H]` at `starts [B]`.

  `layer_cache` is `(k, v)` (`[B, K, S, H]` each) or `(k, v, i)`, a stacked
  pair and a traced layer index. Returns `(keys, values, layer_cache)`: the
  layer's `[B, K, S, H]` keys and values, and the updated cache (same form).
  """

  if len(layer_cache) == 2:
    keys = write_rows(layer_cache[0], k, starts, axis=2)
    values = write_rows(layer_cache[1], v, starts, axis=2)
    return keys, values, (keys, values)
  k_all, v_all, i = layer_cache
  k_all = write_rows(k_all, k[:, None], starts, axis=3, leading=(i,))
  v_all = write_rows(v_all, v[:, None], starts, axis=3, leading=(i,))
  read = lambda x: jax.lax.dynamic_index_in_dim(x, i, axis=1, keepdims=False)
  return read(k_all), read(v_all), (k_all, v_all, i)
