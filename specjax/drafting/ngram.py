"""Model-free drafting by prompt lookup (n-gram matching).

Each row's committed sequence s sits in a static `[B, S]` buffer. The drafter
finds the most recent earlier occurrence of s's last n tokens (n from
`max_ngram` down to `min_ngram`) and proposes what followed it (at most gamma
tokens); rows without a match propose nothing. The proposal is deterministic
(q one-hot), so verification stays exact under sampling.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specjax.drafting.base import Commit, DrafterBase, Proposal
from specjax.models.kv_cache import write_rows
from specjax.sampling import SamplingParams
from specjax.validation import check_int


@struct.dataclass
class NGramState:
  """history `[B, S]` holds s in its first `lengths[b]` slots."""

  history: jax.Array
  lengths: jax.Array


def lookup(
  history: jax.Array, lengths: jax.Array, max_ngram: int, min_ngram: int
) -> tuple[jax.Array, jax.Array]:
  """Where to copy from: `(start [B], n [B])`, start = index after the most recent
  earlier match of the longest matching suffix n-gram; start = -1 if none.

  An earlier occurrence at j must end before the suffix starts being itself
  (j + n <= length - 1), so at least one continuation token exists.
  """
  b, s = history.shape
  start = jnp.full((b,), -1, jnp.int32)
  size = jnp.zeros((b,), jnp.int32)
  for n in range(max_ngram, min_ngram - 1, -1):  # longest match wins
    tail = lengths[:, None] - n + jnp.arange(n)[None, :]
    suffix = jnp.take_along_axis(history, jnp.clip(tail, 0, s - 1), axis=1)  # [B, n]
    match = jnp.ones((b, s - n), bool)
    for t in range(n):
      match &= history[:, t : s - n + t] == suffix[:, t : t + 1]
    j = jnp.arange(s - n)[None, :]
    valid = match & (j + n <= lengths[:, None] - 1) & (lengths[:, None] > n)
    last = jnp.max(jnp.where(valid, j, -1), axis=1)
    take = (start < 0) & (last >= 0)
    start = jnp.where(take, last + n, start)
    size = jnp.where(take, n, size)
  return start, size


@struct.dataclass
class NGramDrafter(DrafterBase):
  """Prompt-lookup drafter.

  Attributes:
    vocab_size: the target's vocabulary size (proposals are ids in it).
    max_ngram: longest suffix to match (static).
    min_ngram: shortest suffix to match, >= 1.
  """

  vocab_size: int = struct.field(pytree_node=False)
  max_ngram: int = struct.field(pytree_node=False, default=3)
  min_ngram: int = struct.field(pytree_node=False, default=1)

  def __post_init__(self):
    check_int("vocab_size", self.vocab_size, 1)
    check_int("min_ngram", self.min_ngram, 1)
    check_int("max_ngram", self.max_ngram, self.min_ngram)

  def init(self, prompts, prompt_lengths, first, capacity, hidden=None) -> NGramState:
    b, width = prompts.shape
    history = jnp.zeros((b, capacity), jnp.int32).at[:, :width].set(prompts)
    history = write_rows(history, first[:, None], prompt_lengths)
    return NGramState(history, prompt_lengths + 1)

  def propose(
    self,
    state: NGramState,
    recent: jax.Array,
    key: jax.Array,
    limit: jax.Array,
    *,
    gamma: int,
    sampling: SamplingParams,
  ) -> tuple[Proposal, NGramState]:
    # The history already ends with recent; nothing is random, and a
    # deterministic proposal is exact under any warp.
    del recent, key, sampling
    g = gamma
    start, _ = lookup(state.history, state.lengths, self.max_ngram, self.min_ngram)
    index = jnp.clip(start[:, None] + jnp.arange(g)[None, :], 0, state.history.shape[1] - 1)
    tokens = jnp.take_along_axis(state.history, index, axis=1)
    available = state.lengths - start  # continuation tokens already in s
    lengths = jnp.where(start >= 0, jnp.minimum(jnp.minimum(available, g), limit), 0)
    return Proposal(tokens, None, lengths.astype(jnp.int32), calls=jnp.int32(0)), state

  def commit(self, state: NGramState, commit: Commit) -> NGramState:
    history = write_rows(state.history, commit.emitted, commit.old_length)
    return NGramState(history, jnp.where(commit.goes_on, commit.new_length, commit.old_length))
