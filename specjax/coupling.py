"""Gumbel-max coupling: sampled text that is a function of (key, prompt) alone.

Daliri, Musco and Suresh, "Coupling without Communication and Drafter-Invariant
Speculative Decoding" (arXiv 2408.07978). Every row has its own key; the token
at the row's generated index t is

    y_t = argmax_i (log p~_t(i) + G_t(i)),  G_t = Gumbel noise of fold_in(row key, t)

with p~_t the warped law at t. That is a draw from p~_t (the Gumbel-max trick),
and it is the same draw whoever asks: plain decoding, or verification of any
drafter's block (a drafted token is accepted exactly when it equals y_t). A
drafter that samples with the same noise (argmax of log q~_t + G_t) agrees
whenever q~ and p~ are close. The guide: docs/usage.md, "Same seed, same text".

row_keys     one key per row, from one key or `[B]` keys (`split_keys`)
noise        `[B, S, V]` Gumbel noise at S consecutive generated indices
gumbel_max   argmax(log probs + noise), the coupled draw
Coupling     the noise of one call, handed to drafters and verifiers in place
             of a key (rows it does not cover draw from `Coupling.key`)
chain_draws  a drafter's i-th draw of an iteration, coupled or not
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct

from specjax.sampling import sample_with_uniform


def is_key_batch(key) -> bool:
  """Whether `key` is a batch of typed keys `[B]` (one per row)."""
  return (
    isinstance(key, jax.Array)
    and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    and key.ndim == 1
  )


def row_keys(key: jax.Array, batch: int) -> jax.Array:
  """`[B]` typed keys, one per row: `key` itself when it is `[B]` keys, else row
  b's is `fold_in(key, b)` (so a row's key does not depend on the batch size)."""
  if is_key_batch(key):
    return key
  return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.arange(batch, dtype=jnp.uint32))


def split_keys(key: jax.Array, batch: int, coupled: bool) -> tuple[jax.Array, jax.Array | None]:
  """`(batch_key, row_keys)` of a generation call given one key or `[B]` keys:
  the key its batch-wide draws come from (with `[B]` keys every row is coupled
  and it draws nothing: the first row's), and the rows' keys when `coupled`."""
  keys = row_keys(key, batch) if coupled else None
  return (key[0] if is_key_batch(key) else key), keys


def noise(keys: jax.Array, start: jax.Array, count: int, vocab_size: int) -> jax.Array:
  """`[B, count, vocab_size]` float32 Gumbel noise of row b at generated indices
  start[b], ..., start[b] + count - 1.

  The noise of (row, index) comes from `fold_in(keys[b], index)` alone, so the
  same index gets the same noise in every call, whatever the batch or block.
  `vocab_size` must be the same in every call that should agree (the target's).
  """

  def one(key, index):
    return jax.random.gumbel(jax.random.fold_in(key, index), (vocab_size,), jnp.float32)

  index = start[:, None].astype(jnp.uint32) + jnp.arange(count, dtype=jnp.uint32)[None, :]
  return jax.vmap(jax.vmap(one, in_axes=(None, 0)))(keys, index)


def fit(gumbel: jax.Array, vocab_size: int) -> jax.Array:
  """Noise `[..., V']` over `vocab_size` ids: cut, or padded with 0 (ids past
  the target's vocabulary have p = 0, so their noise never matters)."""
  v = gumbel.shape[-1]
  if v >= vocab_size:
    return gumbel[..., :vocab_size]
  return jnp.pad(gumbel, [(0, 0)] * (gumbel.ndim - 1) + [(0, vocab_size - v)])


def scores(probs: jax.Array, gumbel: jax.Array) -> jax.Array:
  """`[..., V]` log probs + noise, -inf where probs is 0 (those ids are never drawn)."""
  positive = probs > 0
  logp = jnp.log(jnp.where(positive, probs, 1.0))
  return jnp.where(positive, logp + fit(gumbel, probs.shape[-1]), -jnp.inf)


def gumbel_max(probs: jax.Array, gumbel: jax.Array) -> jax.Array:
  """The coupled draw from `probs [..., V]` with `gumbel [..., V']`: int32 `[...]`."""
  return jnp.argmax(scores(probs, gumbel), axis=-1).astype(jnp.int32)


@struct.dataclass
class Coupling:
  """The coupled noise of one call, passed where a key would be.

  Attributes:
    gumbel: `[B, S, V]` noise at S consecutive generated indices: index 0 is the
      first token this call draws (a drafter's first draft; a verifier's first
      block position).
    key: a typed key; rows the coupling does not cover draw from it as they
      would from a plain key.
    rows: `[B]` bool, the rows drawn by Gumbel-max; None: every row.
  """

  gumbel: jax.Array
  key: jax.Array
  rows: jax.Array | None = None

  @classmethod
  def of(
    cls,
    keys: jax.Array,
    start: jax.Array,
    count: int,
    vocab_size: int,
    key: jax.Array,
    rows: jax.Array | None = None,
  ) -> Coupling:
    """The coupling of a call drawing at generated indices start[b] ... + count - 1
    (`noise`), for `rows` (None: all); with rows given, no noise is drawn when
    none is set (a server's batch often has no coupled row)."""

    def draw():
      return noise(keys, start, count, vocab_size)

    if rows is None:
      return cls(draw(), key)
    zeros = lambda: jnp.zeros((start.shape[0], count, vocab_size), jnp.float32)
    return cls(jax.lax.cond(jnp.any(rows), draw, zeros), key, rows)

  def shift(self, depth: int, key: jax.Array | None = None) -> Coupling:
    """The coupling `depth` indices on (a tree's children at that depth), with
    `key` for the uncoupled rows if given."""
    return self.replace(gumbel=self.gumbel[:, depth:], key=self.key if key is None else key)

  def select(self, coupled: jax.Array, plain: jax.Array) -> jax.Array:
    """`coupled` on the covered rows, `plain` on the others (`[B, ...]` each)."""
    if self.rows is None:
      return coupled
    rows = self.rows.reshape(self.rows.shape + (1,) * (coupled.ndim - 1))
    return jnp.where(rows, coupled, plain)


def chain_draws(key: jax.Array | Coupling, count: int, batch: int) -> Callable:
  """`draw(i, q [B, V]) -> [B]`: a drafter's draw of its i-th token (i < count,
  may be traced; a scalar, or `[B]` each row's own index) from its law q. With a
  plain key, inverse CDF with the uniform `uniform(key, (count, batch))[i]`; with
  a `Coupling`, Gumbel-max with its noise at index i for the rows it covers."""
  rows = jnp.arange(batch)

  def at(table, i):  # table [count, batch]: row b's entry at its index
    return table[i] if jnp.ndim(i) == 0 else table[i, rows]

  if not isinstance(key, Coupling):
    uniforms = jax.random.uniform(key, (count, batch), jnp.float32)
    return lambda i, q: sample_with_uniform(at(uniforms, i), q)
  coupling = key
  uniforms = (
    None if coupling.rows is None else jax.random.uniform(coupling.key, (count, batch), jnp.float32)
  )

  def draw(i, q):
    noise = coupling.gumbel[:, i] if jnp.ndim(i) == 0 else coupling.gumbel[rows, i]
    coupled = gumbel_max(q, noise)
    if uniforms is None:
      return coupled
    return coupling.select(coupled, sample_with_uniform(at(uniforms, i), q))

  return draw


def sample_tokens(key: jax.Array | Coupling, probs: jax.Array) -> jax.Array:
  """One draw per row from `probs [B, V]`: Gumbel-max with a coupling's first
  index for the rows it covers, else inverse CDF with `uniform(key, [B])`."""
  if not isinstance(key, Coupling):
    return sample_with_uniform(jax.random.uniform(key, probs.shape[:-1], jnp.float32), probs)
  coupled = gumbel_max(probs, key.gumbel[:, 0])
  if key.rows is None:
    return coupled
  u = jax.random.uniform(key.key, probs.shape[:-1], jnp.float32)
  return key.select(coupled, sample_with_uniform(u, probs))
