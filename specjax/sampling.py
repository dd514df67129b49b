"""Sampling warps: logits -> the probabilities that are sampled *and* verified.

Exact speculative decoding needs q to be the very distribution each draft token
was drawn from, and p the target's distribution after the same warp. So one
function, `warp_probs`, turns logits into probabilities for draft and target
alike, and `sample` draws from those probabilities, never from raw logits.

Order of the warps (as in Hugging Face's logits processors): temperature, then
top-k, then top-p. Temperature 0 means greedy: the warp is one-hot at the argmax
(lowest index on ties), so every verifier reduces to argmax matching.
All arithmetic is float32, whatever dtype the model computes in.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax.validation import is_int, is_real

# A positive temperature below float32's smallest normal number cannot divide
# logits in float32 (it is flushed to zero or overflows every quotient): such
# a temperature is greedy decoding in all but name, and is treated as greedy.
MIN_TEMPERATURE = float(np.finfo(np.float32).tiny)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Static sampling settings (hashable, so they can be jit static arguments).

  Attributes:
    temperature: finite, >= 0; 0 (or anything below `MIN_TEMPERATURE`, about
      1.2e-38) means greedy decoding.
    top_k: keep the k most likely tokens; 0 disables the filter. Tokens tied
      with the k-th logit are kept too.
    top_p: nucleus mass in (0, 1]; 1 disables the filter. Keeps the smallest
      set of most likely tokens whose mass reaches top_p.
  """

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if not is_real(self.temperature) or not 0 <= self.temperature < float("inf"):
      raise ValueError(
        f"temperature must be a number >= 0 and finite (0 = greedy), got {self.temperature!r}."
      )
    if not is_int(self.top_k) or self.top_k < 0:
      raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}.")
    if not is_real(self.top_p) or not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}.")
    # numpy scalars become Python numbers: equal settings hash equally (jit cache).
    object.__setattr__(self, "temperature", float(self.temperature))
    object.__setattr__(self, "top_k", int(self.top_k))
    object.__setattr__(self, "top_p", float(self.top_p))

  @property
  def greedy(self) -> bool:
    return self.temperature < MIN_TEMPERATURE

  def check_vocab(self, vocab_size: int) -> None:
    """Raises if top_k exceeds the vocabulary (it would silently mean 'off')."""
    if self.top_k > vocab_size:
      raise ValueError(f"top_k must be in [0, vocab_size={vocab_size}], got {self.top_k}.")


GREEDY = SamplingParams(temperature=0.0)


def warp_probs(logits: jax.Array, params: SamplingParams) -> jax.Array:
  """Turns logits `[..., V]` into warped float32 probabilities `[..., V]`."""
  logits = logits.astype(jnp.float32)
  if params.greedy:
    return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
  if params.top_k and params.top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, params.top_k)[0][..., -1:]
    logits = jnp.where(logits >= kth, logits, -jnp.inf)
  # Shift before dividing: the largest logit becomes exactly 0, so however small
  # the temperature, quotients only overflow towards -inf (probability 0) and
  # never meet inf - inf.
  logits = logits - jnp.max(logits, axis=-1, keepdims=True)
  if params.temperature != 1:
    logits = logits / params.temperature
  probs = jax.nn.softmax(logits, axis=-1)
  if params.top_p < 1:
    sorted_probs = jnp.sort(probs, axis=-1)[..., ::-1]
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    # The smallest probability still needed to reach top_p; ties with it are kept.
    kept = jnp.where(mass_before < params.top_p, sorted_probs, jnp.inf)
    threshold = jnp.min(kept, axis=-1, keepdims=True)
    probs = jnp.where(probs >= threshold, probs, 0.0)
    probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
  return probs


def sample(key: jax.Array, probs: jax.Array) -> jax.Array:
  """Draws one token per row from probabilities `[..., V]` -> int32 `[...]`.

  Inverse-CDF sampling: one uniform per row and a cumulative sum, instead of the
  V Gumbel variates of `jax.random.categorical` (far less random-bit work per
  draw); see `sample_with_uniform`.
  """
  return sample_with_uniform(jax.random.uniform(key, probs.shape[:-1], jnp.float32), probs)


def sample_with_uniform(u: jax.Array, probs: jax.Array) -> jax.Array:
  """`sample` with its uniform given: `u [...]` in [0, 1), `probs [...,  V]` -> int32 `[...]`.

  Callers that need several random numbers per step draw them in one call and
  pass them here (one random-bit computation instead of one per draw). The
  first token whose cumulative mass exceeds u * total is taken, among tokens
  of positive probability only, so a zero-probability token is never drawn
  even if the cumsum rounds unevenly.
  """
  cdf = jnp.cumsum(probs, axis=-1)
  threshold = u[..., None].astype(probs.dtype) * cdf[..., -1:]
  hit = (cdf > threshold) & (probs > 0)
  token = jnp.where(
    jnp.any(hit, axis=-1), jnp.argmax(hit, axis=-1), jnp.argmax(probs, axis=-1)
  )  # unreachable unless u rounds up to total
  return token.astype(jnp.int32)


def sample_tokens(
  key: jax.Array, logits: jax.Array, params: SamplingParams
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
