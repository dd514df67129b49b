"""Count-based drafters: unigram and bigram language models of a corpus.

Leviathan et al.'s (2023, Table 3) weakest drafts. `count_drafter` counts a
corpus's token ids (within documents) into a table of log q:

  order 1: q(x) = (n(x) + k / V) / (N + k)                     `[V]`
  order 2: q(x | y) = (n(y, x) + k q1(x)) / (n(y) + k)          `[V, V]`

(k = `smoothing` pseudo-counts). Drafting samples from the warped row and
reports it as q, so verification stays exact; no model runs (calls = 0).
"""

from __future__ import annotations

from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.coupling import Coupling, chain_draws
from specjax.drafting.base import Commit, DraftConstraint, DrafterBase, Proposal
from specjax.sampling import SamplingParams, sample, warp_probs
from specjax.validation import check_int, is_real


@struct.dataclass
class CountDrafter(DrafterBase):
  """A unigram (order 1) or bigram (order 2) drafter; build it with `count_drafter`.

  Attributes:
    log_q: float32 log probabilities, `[V]` (order 1) or `[V, V]` (order 2, row
      y is q(. | y)).
    vocab_size: V (static).
    order: 1 or 2 (static).
  """

  log_q: jax.Array
  vocab_size: int = struct.field(pytree_node=False)
  order: int = struct.field(pytree_node=False)

  constrained_drafts = True

  def __post_init__(self):
    check_int("vocab_size", self.vocab_size, 1)
    if self.order not in (1, 2):
      raise ValueError(f"order must be 1 (unigram) or 2 (bigram), got {self.order!r}.")
    expected = (self.vocab_size,) * self.order
    # Transformations may rebuild the struct around placeholders without a shape.
    if hasattr(self.log_q, "shape") and tuple(self.log_q.shape) != expected:
      raise ValueError(
        f"log_q must have shape {expected} for order {self.order}, got {tuple(self.log_q.shape)}."
      )

  def init(self, prompts, prompt_lengths, first, capacity, hidden=None):
    del prompts, prompt_lengths, first, capacity, hidden
    return ()  # stateless: a bigram reads s[-1] from `recent`

  def propose(
    self,
    state,
    recent: jax.Array,
    key: jax.Array,
    limit: jax.Array,
    *,
    gamma: int,
    sampling: SamplingParams,
    constraint: DraftConstraint | None = None,
  ) -> tuple[Proposal, tuple]:
    b = recent.shape[0]
    previous = recent[:, 1]
    tokens, probs = [], []
    coupled = chain_draws(key, gamma, b) if isinstance(key, Coupling) else None
    step_keys = [None] * gamma if coupled else jax.random.split(key, gamma)
    for i, step_key in enumerate(step_keys):
      logits = (
        self.log_q[previous]
        if self.order == 2
        else jnp.broadcast_to(self.log_q, (b, self.vocab_size))
      )
      if constraint is not None:
        logits = constraint.logits(logits)
      q = warp_probs(logits, sampling)  # [B, V]: exactly the law the token is drawn from
      previous = coupled(i, q) if coupled else sample(step_key, q)
      if constraint is not None:
        constraint = constraint.after(previous)
      tokens.append(previous)
      probs.append(q)
    lengths = jnp.minimum(limit, gamma).astype(jnp.int32)
    proposal = Proposal(jnp.stack(tokens, 1), jnp.stack(probs, 1), lengths, calls=jnp.int32(0))
    return proposal, state

  def commit(self, state, commit: Commit):
    del commit
    return state


def count_drafter(
  documents: Iterable[np.ndarray], vocab_size: int, order: int, smoothing: float = 1.0
) -> CountDrafter:
  """The unigram (order 1) or bigram (order 2) drafter of `documents`.

  Args:
    documents: 1-D arrays of token ids in [0, vocab_size), one per document
      (bigrams are counted within a document only).
    vocab_size: V, the target's vocabulary size.
    order: 1 or 2.
    smoothing: k > 0 pseudo-counts; every id keeps q > 0.


  Raises:
    ValueError: a bad order, smoothing or vocabulary size, an id outside
      [0, vocab_size), or no tokens at all.
  """
  check_int("vocab_size", vocab_size, 1)
  if order not in (1, 2):
    raise ValueError(f"order must be 1 (unigram) or 2 (bigram), got {order!r}.")
  if not is_real(smoothing) or not smoothing > 0:
    raise ValueError(f"smoothing must be a number > 0, got {smoothing!r}.")
  unigram = np.zeros(vocab_size, np.float64)
  pairs = []  # y * V + x for each bigram (y, x): one bincount at the end
  for doc in documents:
    ids = np.asarray(doc)
    if ids.size == 0:
      continue
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
      raise ValueError(f"documents must be 1-D integer arrays, got shape {ids.shape} {ids.dtype}.")
    if ids.min() < 0 or ids.max() >= vocab_size:
      raise ValueError(
        f"documents hold ids in [{ids.min()}, {ids.max()}], outside [0, {vocab_size})."
      )
    unigram += np.bincount(ids, minlength=vocab_size)
    if order == 2:
      pairs.append(ids[:-1].astype(np.int64) * vocab_size + ids[1:])
  total = unigram.sum()
  if total == 0:
    raise ValueError("documents hold no tokens to count.")
  q1 = (unigram + smoothing / vocab_size) / (total + smoothing)
  if order == 1:
    table = np.log(q1)
  else:
    flat = np.concatenate(pairs) if pairs else np.zeros(0, np.int64)
    bigram = np.bincount(flat, minlength=vocab_size * vocab_size).reshape(vocab_size, vocab_size)
    rows = bigram.sum(axis=1, keepdims=True)
    table = np.log((bigram + smoothing * q1[None, :]) / (rows + smoothing))
  return CountDrafter(jnp.asarray(table, jnp.float32), vocab_size=vocab_size, order=order)
