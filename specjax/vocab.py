"""Draft and target over one shared vocabulary of possibly different sizes.

Two models of one tokenizer can have different vocabulary sizes (embedding
tables padded differently). Verification compares their laws over the larger
vocabulary, and each model must only be fed ids it has:

  pad_vocab(probs, V)   a model's law `[..., V_model]` over `[..., V]`: ids it lacks get 0
  fit_ids(tokens, V)    ids a model lacks mapped to 0 before it reads them
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def pad_vocab(probs: jax.Array, vocab_size: int, fill: float = 0.0) -> jax.Array:
  """Pads probabilities `[..., V_model]` to `[..., vocab_size]` with `fill` (a model's
  law over a larger shared vocabulary: ids it lacks get probability 0; for logits
  pass fill=-inf, so they are never an argmax)."""
  extra = vocab_size - probs.shape[-1]
  if not extra:
    return probs
  return jnp.pad(probs, [(0, 0)] * (probs.ndim - 1) + [(0, extra)], constant_values=fill)


def fit_ids(tokens: jax.Array, vocab_size: int) -> jax.Array:
  """Maps ids a model's vocabulary lacks to 0 before feeding them to it (the
  draft's q is still its proposal's law, so exactness is unaffected)."""

  return jnp.where(tokens < vocab_size, tokens, 0)
