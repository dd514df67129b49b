"""The draws: one token per row from warped probabilities, by inverse CDF."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.sampling.params import SamplingParams
from specjax.sampling.rows import RowSampling
from specjax.sampling.warps import warp_probs


def sample(key: jax.Array, probs: jax.Array) -> jax.Array:
  """Draws one token per row from probabilities `[..., V]` -> int32 `[...]`, by
  inverse CDF (one uniform per row, not V Gumbel variates)."""
  return sample_with_uniform(jax.random.uniform(key, probs.shape[:-1], jnp.float32), probs)


def sample_with_uniform(u: jax.Array, probs: jax.Array) -> jax.Array:
  """`sample` with its uniform given: `u [...]` in [0, 1), `probs [..., V]` -> int32
  `[...]`: the first positive-probability token whose cumulative mass exceeds
  u * total (a zero-probability token is never drawn)."""

  cdf = jnp.cumsum(probs, axis=-1)
  threshold = u[..., None].astype(probs.dtype) * cdf[..., -1:]
  hit = (cdf > threshold) & (probs > 0)
  token = jnp.where(
    jnp.any(hit, axis=-1), jnp.argmax(hit, axis=-1), jnp.argmax(probs, axis=-1)
  )  # unreachable unless u rounds up to total
  return token.astype(jnp.int32)


def sample_tokens(
  key: jax.Array, logits: jax.Array, params: SamplingParams | RowSampling
) -> tuple[jax.Array, jax.Array]:
  """Warps logits `[..., V]` and draws from them.

  Returns:
    `(tokens [...] int32, probs [..., V] float32)`: probs is exactly the
    distribution the tokens were drawn from (what verification needs as q).
  """
  probs = warp_probs(logits, params)
  if params.greedy:
    return jnp.argmax(probs, axis=-1).astype(jnp.int32), probs
  return sample(key, probs), probs
