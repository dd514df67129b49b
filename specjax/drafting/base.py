"""The drafter protocol: what `speculative_step` needs from any way of drafting.

A drafter is a pytree (a `flax.struct` dataclass: arrays and modules as
children, settings static) with three pure methods:

  init(prompts [B, P], prompt_lengths [B], first [B], capacity) -> state
      Prepare for the committed sequence s = prompt + first token.
  propose(state, recent [B, 2], key, limit [B], config) -> (Proposal, state)
      Propose up to `config.gamma` tokens per row continuing s, at most
      `limit[b]` for row b. `recent = [s[-2], s[-1]]`.
  commit(state, emitted [B, gamma+1], old_length [B], new_length [B], goes_on [B]) -> state
      The iteration kept `emitted[:, :new_length - old_length]`; s grew from
      `old_length` to `new_length` tokens for rows that go on.

and a static `vocab_size`. The state is any pytree the drafter likes (a KV
cache, a token history). One `speculative_step` serves every drafter.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from specjax.sampling import pad_vocab


class Proposal(NamedTuple):
  """What a drafter proposes for one iteration.

  Attributes:
    tokens: `[B, g]` int32; entries at or past `lengths[b]` are ignored.
    probs: `[B, g, V]` float32, the distribution each token was drawn from, or
      None for a deterministic proposal (then q is one-hot at the token).
    lengths: `[B]` int32 in [0, g], how many leading tokens are proposed.
      Verification sees q = 0 past them, which every verifier treats as a
      rejection there, so a row with lengths k is verified as a block of k.
    calls: scalar int32, model forward calls spent (for statistics).
  """

  tokens: jax.Array
  probs: jax.Array | None
  lengths: jax.Array
  calls: jax.Array


class Drafter(Protocol):
  vocab_size: int

  def init(self, prompts: jax.Array, prompt_lengths: jax.Array, first: jax.Array,
           capacity: int) -> Any:
    ...

  def propose(self, state: Any, recent: jax.Array, key: jax.Array, limit: jax.Array,
              config) -> tuple[Proposal, Any]:
    ...

  def commit(self, state: Any, emitted: jax.Array, old_length: jax.Array,
             new_length: jax.Array, goes_on: jax.Array) -> Any:
    ...


def proposal_probs(proposal: Proposal, vocab_size: int) -> jax.Array:
  """`[B, g, vocab_size]` q for verification: one-hot for deterministic proposals,
  zero past each row's `lengths` (the "not proposed" convention)."""
  g = proposal.tokens.shape[1]
  if proposal.probs is None:
    probs = jax.nn.one_hot(proposal.tokens, vocab_size, dtype=jnp.float32)
  else:
    # A draft with a smaller vocabulary: its q is 0 on the ids it lacks.
    probs = pad_vocab(proposal.probs.astype(jnp.float32), vocab_size)
  valid = jnp.arange(g)[None, :] < proposal.lengths[:, None]
  return probs * valid[..., None]
