"""Sampling warps: logits -> the probabilities that are sampled *and* verified.

Exactness needs q to be the very law each draft token was drawn from and p the
target's after the same warp, so `warp_probs` serves draft and target alike and
`sample` draws from its probabilities, never raw logits. Settings are static
(`SamplingParams`) or per-row data (`RowSampling`). Warps run temperature, then
top-k, then top-p (as Hugging Face's); temperature 0 is one-hot at the argmax
(lowest index on ties). All arithmetic is float32.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.validation import is_int, is_real

# A positive temperature below float32's smallest normal number cannot divide
# logits in float32 (it is flushed to zero or overflows every quotient): such
# a temperature is greedy decoding in all but name, and is treated as greedy.
MIN_TEMPERATURE = float(np.finfo(np.float32).tiny)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Static sampling settings (hashable, so they can be jit static arguments).

  Attributes:
    temperature: finite, >= 0; below `MIN_TEMPERATURE` (~1.2e-38): greedy.
    top_k: keep the k most likely tokens (and ties with the k-th); 0: off.
    top_p: keep the smallest most-likely set of mass >= top_p, in (0, 1]; 1: off.

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


@struct.dataclass
class RowSampling:
  """Per-row sampling settings as data (a pytree of `[B]` arrays): row b is warped
  with `SamplingParams(temperature[b], top_k[b], top_p[b])`, greedy and sampled
  rows in one program. Build it with `RowSampling.of`, which checks every row.

  Attributes:
    temperature: `[B]` float32, >= 0 (below `MIN_TEMPERATURE`: greedy).
    top_k: `[B]` int32, >= 0 (0 = off).
    top_p: `[B]` float32 in (0, 1] (1 = off).
  """

  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array

  @classmethod
  def of(
    cls, params: SamplingParams | list[SamplingParams], batch: int | None = None
  ) -> RowSampling:
    """Rows from one `SamplingParams` per row (each validated), or one for `batch` rows."""
    if isinstance(params, SamplingParams):
      if batch is None:
        raise ValueError("batch is needed to broadcast one SamplingParams to rows.")
      params = [params] * batch
    params = list(params)
    if not params or not all(isinstance(p, SamplingParams) for p in params):
      raise ValueError(
        f"params must be a non-empty list of specjax.SamplingParams, got {params!r}."
      )
    return cls(
      temperature=jnp.asarray([p.temperature for p in params], jnp.float32),
      top_k=jnp.asarray([p.top_k for p in params], jnp.int32),
      top_p=jnp.asarray([p.top_p for p in params], jnp.float32),
    )

  @property
  def greedy(self) -> bool:
    """Static: whether the warp is known to be greedy at trace time. Never for
    per-row settings (greedy rows are one-hot inside the sampled warp)."""
    return False

  @property
  def batch(self) -> int:
    return self.temperature.shape[0]

  def repeat(self, count: int) -> RowSampling:
    """Each row's settings `count` times in a run: the warp of `[B * count, ...]`
    logits laid out row by row (e.g. a tree's nodes of each row)."""
    return jax.tree.map(lambda x: jnp.repeat(x, count, axis=0), self)

  def all_greedy(self) -> bool:
    """On the host: every row is greedy (no random numbers needed)."""
    return bool(np.all(np.asarray(self.temperature) < MIN_TEMPERATURE))

  def check(self, vocab_size: int, batch: int) -> None:
    """Raises a ValueError naming the field and row when a setting is out of range
    (on the host, before compiling)."""
    if self.batch != batch:
      raise ValueError(f"sampling has {self.batch} rows but the batch has {batch}.")
    t, k, p = (np.asarray(x) for x in (self.temperature, self.top_k, self.top_p))
    checks = (
      ("temperature", t, np.isfinite(t) & (t >= 0), "a number >= 0 and finite (0 = greedy)"),
      ("top_k", k, (k >= 0) & (k <= vocab_size), f"an integer in [0, vocab_size={vocab_size}]"),
      ("top_p", p, (p > 0) & (p <= 1), "in (0, 1] (1 = off)"),
    )
    for name, values, ok, allowed in checks:
      if values.shape != (batch,):
        raise ValueError(f"sampling.{name} must have shape [{batch}], got {values.shape}.")
      if not ok.all():
        row = int(np.argmin(ok))
        raise ValueError(f"sampling.{name} must be {allowed}; row {row} has {values[row]!r}.")


def warp_probs(logits: jax.Array, params: SamplingParams | RowSampling) -> jax.Array:
  """Turns logits `[..., V]` into warped float32 probabilities `[..., V]`.

  With `RowSampling` the logits are `[B, ..., V]` and row b gets its own warp.
  """
  if isinstance(params, RowSampling):
    return _warp_rows(logits.astype(jnp.float32), params)
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


def _warp_rows(logits: jax.Array, params: RowSampling) -> jax.Array:
  """`warp_probs` with per-row settings. Top-k and top-p thresholds come from
  bisection over float32 bit patterns, not a sort (XLA:CPU's sort costs ~100x at
  V = 4096); each runs only when some row asks for it.
  """
  v = logits.shape[-1]

  def per_row(x):  # [B] -> [B, 1, ..., 1], against logits [B, ..., V]
    return x.reshape(x.shape + (1,) * (logits.ndim - 1))

  t, k, top_p = per_row(params.temperature), per_row(params.top_k), per_row(params.top_p)
  greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), v, dtype=jnp.float32)

  def keep_top_k(x):  # ties with the k-th logit are kept
    kth = _largest_with(x, lambda keep: jnp.sum(keep, -1, keepdims=True) >= k)
    return jnp.where((k > 0) & (x < kth), -jnp.inf, x)

  logits = jax.lax.cond(jnp.any(k > 0), keep_top_k, lambda x: x, logits)
  logits = logits - jnp.max(logits, axis=-1, keepdims=True)
  probs = jax.nn.softmax(logits / jnp.where(t < MIN_TEMPERATURE, 1.0, t), axis=-1)

  def nucleus(probs):  # the smallest probability still needed to reach top_p; ties kept
    least = _largest_with(
      probs, lambda keep: jnp.sum(jnp.where(keep, probs, 0), -1, keepdims=True) >= top_p
    )
    # top_p = 1 is off outright: rounding must not drop the tail's smallest tokens.
    kept = jnp.where((top_p < 1) & (probs < least), 0.0, probs)
    return jnp.where(top_p < 1, kept / jnp.sum(kept, axis=-1, keepdims=True), probs)

  probs = jax.lax.cond(jnp.any(top_p < 1), nucleus, lambda x: x, probs)
  return jnp.where(t < MIN_TEMPERATURE, greedy, probs)


def _largest_with(x: jax.Array, holds) -> jax.Array:
  """`[..., 1]`: the largest value tau among `x [..., V]` (float32) such that
  `holds(x >= tau)` is true, for a predicate that only weakens as tau grows
  (true at the row's minimum). Exact: bisection over the order-preserving
  uint32 images of the floats ends on one of the values."""
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  sign = jnp.uint32(0x80000000)
  key = jnp.where(bits & sign, ~bits, bits | sign)  # float order as unsigned order
  lo = jnp.min(key, axis=-1, keepdims=True)
  hi = jnp.max(key, axis=-1, keepdims=True)

  def halve(_, bounds):
    lo, hi = bounds
    gap = hi - lo
    mid = lo + (gap >> 1) + (gap & 1)  # ceil((lo + hi) / 2) without overflow
    ok = holds(key >= mid)
    return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

  lo, _ = jax.lax.fori_loop(0, 32, halve, (lo, hi))
  bits = jnp.where(lo & sign, lo ^ sign, ~lo)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


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
