"""Drafting with a model: a small draft model, or the target's own first layers.

`ModelDrafter(model)` samples gamma tokens from a small model with the same
warp as the target. `layer_skip(target, k)` is the same drafter over the
target's first k layers plus its final norm and head (self-speculation):
`Transformer.forward_cached(..., num_layers=k)` on the very same parameters,
with a k-layer cache of its own.

Cache invariant (as in `SpecState`): the drafter's cache holds s[:-2]; each
iteration first feeds `recent = [s[-2], s[-1]]`, which re-syncs it after a
fully accepted block (the last drafted token was never fed) with one static
shape.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specjax.drafting.base import Proposal
from specjax.models.kv_cache import KVCache
from specjax.models.transformer import Transformer
from specjax.sampling import sample_tokens


def fit_ids(tokens: jax.Array, vocab_size: int) -> jax.Array:
  """Maps ids a model's vocabulary lacks to 0 before feeding them to it.

  With draft and target of different vocabulary sizes the other model can emit
  such ids. Whatever the draft reads, its q is still the law its proposal was
  drawn from, so exactness is unaffected.
  """
  return jnp.where(tokens < vocab_size, tokens, 0)


@struct.dataclass
class ModelDrafter:
  """Proposes tokens by sampling a `Transformer` (optionally its first `num_layers`).

  Attributes:
    model: the draft model (or the target itself, for layer skipping).
    num_layers: layers to run; None runs all of them.
    confidence: stop drafting a row when the draft's top probability falls
      below this (0 disables it): the adaptive "confidence" draft length.
  """

  model: Transformer
  num_layers: int | None = struct.field(pytree_node=False, default=None)
  confidence: float = struct.field(pytree_node=False, default=0.0)

  @property
  def vocab_size(self) -> int:
    return self.model.cfg.vocab_size

  def _forward(self, tokens, cache, logit_indices=None):
    return self.model.forward_cached(fit_ids(tokens, self.vocab_size), cache,
                                     logit_indices=logit_indices, num_layers=self.num_layers)

  def init(self, prompts, prompt_lengths, first, capacity) -> KVCache:
    b = prompts.shape[0]
    cache = self.model.init_cache(b, capacity, num_layers=self.num_layers)
    # No logits are needed here; one position keeps the head cheap.
    _, cache = self._forward(prompts, cache, jnp.zeros((b, 1), jnp.int32))
    return cache.with_lengths(prompt_lengths - 1)

  def propose(self, cache: KVCache, recent, key, limit, config):
    """Samples up to min(gamma, limit[b]) tokens per row; stops early once no
    row needs more (every call after the first is one token per row)."""
    b, g = recent.shape[0], config.gamma
    keys = jax.random.split(key, g)
    logits, cache = self._forward(recent, cache, jnp.ones((b, 1), jnp.int32))

    def draw(i, logits, tokens, probs, active):
      token, q = sample_tokens(keys[i], logits[:, 0], config.sampling)
      active = active & (i < limit)
      if self.confidence > 0:
        active = active & (jnp.max(q, axis=-1) >= self.confidence)
      return token, tokens.at[:, i].set(token), probs.at[:, i].set(q), active

    vocab = logits.shape[-1]
    tokens = jnp.zeros((b, g), jnp.int32)
    probs = jnp.zeros((b, g, vocab), jnp.float32)
    token, tokens, probs, active = draw(0, logits, tokens, probs, jnp.ones((b,), bool))
    lengths = active.astype(jnp.int32)

    def cond(carry):
      i, _, _, _, _, active, _ = carry
      return (i < g) & jnp.any(active)

    def body(carry):
      i, token, cache, tokens, probs, active, lengths = carry
      logits, cache = self._forward(token[:, None], cache)
      token, tokens, probs, active = draw(i, logits, tokens, probs, active)
      return i + 1, token, cache, tokens, probs, active, lengths + active

    i, _, cache, tokens, probs, _, lengths = jax.lax.while_loop(
        cond, body, (jnp.int32(1), token, cache, tokens, probs, active, lengths))
    return Proposal(tokens, probs, lengths, calls=i), cache

  def commit(self, cache: KVCache, emitted, old_length, new_length, goes_on) -> KVCache:
    # Holds s'[:-2] for rows that go on; stopped rows keep s[:-2] (in bounds).
    return cache.with_lengths(jnp.where(goes_on, new_length - 2, old_length - 2))


def layer_skip(target: Transformer, num_layers: int, confidence: float = 0.0) -> ModelDrafter:
  """Self-speculation: the target's first `num_layers` layers + final norm + head."""
  if not isinstance(num_layers, int) or not 1 <= num_layers < target.cfg.n_layers:
    raise ValueError(f"num_layers must be an int in [1, {target.cfg.n_layers - 1}] "
                     f"(fewer than the target's {target.cfg.n_layers} layers), "
                     f"got {num_layers!r}.")
  return ModelDrafter(target, num_layers=num_layers, confidence=confidence)
