"""Static-shape KV cache with per-row lengths.

The cache is a plain pytree: one `[B, S, K, H]` key and value array per layer and
`lengths [B]`, the number of valid slots of each row. A model call writes its T
new tokens of row b at slots `lengths[b] .. lengths[b] + T - 1` and attends by
position, so slots at or past a row's length are never read. Rolling a row back
after a rejected draft is therefore bookkeeping: lower `lengths[b]`; the stale
slots are overwritten by the next call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
  """Per-layer keys and values plus per-row lengths.

  Attributes:
    k: tuple of L arrays `[B, S, K, H]`.
    v: tuple of L arrays `[B, S, K, H]`.
    lengths: `[B]` int32, valid slots per row (= position of the next token).
  """

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  lengths: jax.Array

  @classmethod
  def zeros(cls, *, n_layers: int, batch: int, capacity: int, n_kv_heads: int,
            head_dim: int, dtype) -> "KVCache":
    """An empty cache of `capacity` slots per row (all lengths 0)."""
    shape = (batch, capacity, n_kv_heads, head_dim)
    return cls(
        k=tuple(jnp.zeros(shape, dtype) for _ in range(n_layers)),
        v=tuple(jnp.zeros(shape, dtype) for _ in range(n_layers)),
        lengths=jnp.zeros((batch,), jnp.int32),
    )

  @property
  def capacity(self) -> int:
    """S, the static number of slots per row."""
    return self.k[0].shape[1]

  @property
  def batch_size(self) -> int:
    return self.k[0].shape[0]

  def with_lengths(self, lengths: jax.Array) -> "KVCache":
    """The same slots with new per-row lengths (rollback or commit)."""
    return self.replace(lengths=jnp.asarray(lengths, jnp.int32))


def write_rows(buffer: jax.Array, update: jax.Array, starts: jax.Array) -> jax.Array:
  """Writes `update[b]` into `buffer[b]` at row offset `starts[b]` along axis 1.

  Args:
    buffer: `[B, S, ...]`.
    update: `[B, T, ...]` with T <= S.
    starts: `[B]` int32 offsets; callers guarantee `starts + T <= S` (XLA would
      otherwise clamp the offset and overwrite valid slots).

  Returns:
    `[B, S, ...]` with the T slots of each row replaced.
  """
  def one_row(row, new, start):
    index = (start,) + (0,) * (row.ndim - 1)
    return jax.lax.dynamic_update_slice(row, new.astype(row.dtype), index)
  return jax.vmap(one_row)(buffer, update, starts)
