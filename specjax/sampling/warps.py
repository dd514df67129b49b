"""The warps: logits to the probabilities that are sampled and verified
(`warp_probs`), the steps before temperature (`penalized_logits`), and the
check that a row's law is finite (`finite_rows`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.sampling.params import MIN_TEMPERATURE, SamplingParams
from specjax.sampling.rows import RowSampling


def warp_probs(logits: jax.Array, params: SamplingParams | RowSampling) -> jax.Array:
  """Turns logits `[..., V]` into warped float32 probabilities `[..., V]`.

  With `RowSampling` the logits are `[B, ..., V]` and row b gets its own warp.
  """
  if isinstance(params, SamplingParams) and params.has_warps:  # no history: an empty text
    params = RowSampling.of(params, logits.shape[0])
  if isinstance(params, RowSampling):
    return _warp_rows(penalized_logits(logits, params), params)
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


def penalized_logits(logits: jax.Array, params: SamplingParams | RowSampling) -> jax.Array:
  """float32 logits `[B, ..., V]` after the steps before temperature (the
  order in `specjax.sampling`'s doc): logit bias, the `min_tokens` mask, then the repetition,
  frequency and presence penalties over `params.history` (None: an empty text;
  ids past its vocabulary count 0). Each step runs only when some row sets it.
  A static `SamplingParams` changes nothing (the loops run one that sets such
  steps as rows); greedy decoding takes the argmax of these logits."""
  logits = logits.astype(jnp.float32)
  if not isinstance(params, RowSampling) or params.presence_penalty is None:
    return logits
  b, v = logits.shape[0], logits.shape[-1]
  h = params.history

  def per_row(x):  # [B] or [B, T] -> against logits [B, ..., V]
    return x.reshape(x.shape + (1,) * (logits.ndim - x.ndim))

  def at_positions(x):  # [B, V] or [B, T, V] -> against logits [B, ..., V]
    return x.reshape(x.shape[:1] + (1,) * (logits.ndim - x.ndim) + x.shape[1:])

  def scatter(ids, values, init):  # [B, V]: each row's `values` at its ids (-1: none)
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], ids.shape)
    ids = jnp.where(ids < 0, v, ids)  # padding (and ids past V) dropped
    return jnp.full((b, v), init).at[rows, ids].set(values, mode="drop")

  def bias(logits):
    return logits + at_positions(scatter(params.bias_ids, params.bias, jnp.float32(0)))

  def mask_stops(logits):  # the stop ids, and EOS unless ignored, until min_tokens
    banned = scatter(params.stop_token_ids, True, False)
    if params.eos_id is not None:
      eos = jnp.isin(jnp.arange(v), jnp.asarray(params.eos_id, jnp.int32))
      banned = banned | (eos[None, :] & ~params.ignore_eos[:, None])
    masked = jnp.where(early & at_positions(banned), -jnp.inf, logits)
    # A law with nothing left (a constraint that allows only EOS) keeps its EOS.
    return jnp.where(jnp.any(masked > -jnp.inf, axis=-1, keepdims=True), masked, logits)

  def penalize(logits):
    counts, prompt = _fit_vocab(h.position_counts(), v), _fit_vocab(h.prompt, v)
    counts, prompt = at_positions(counts), at_positions(prompt)
    r = per_row(params.repetition_penalty)
    seen = prompt | (counts > 0)
    logits = jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)
    frequency, presence = per_row(params.frequency_penalty), per_row(params.presence_penalty)
    return logits - frequency * counts - presence * (counts > 0)

  def unchanged(x):
    return x

  logits = jax.lax.cond(jnp.any(params.bias_ids >= 0), bias, unchanged, logits)
  length = jnp.zeros((b,), jnp.int32) if h is None else h.length
  early = per_row(length) < per_row(params.min_tokens)
  logits = jax.lax.cond(jnp.any(early), mask_stops, unchanged, logits)
  if h is None:
    return logits
  on = (
    jnp.any(params.repetition_penalty != 1)
    | jnp.any(params.frequency_penalty != 0)
    | jnp.any(params.presence_penalty != 0)
  )
  return jax.lax.cond(on, penalize, unchanged, logits)


def finite_rows(x: jax.Array) -> jax.Array:
  """`[B]` bool: whether each row of a law `[B, ..., V]` (probabilities, or
  logits where -inf is a masked token) holds no NaN and no +inf. A penalty or
  temperature at float32's edge, or a broken model, can make a row's law NaN,
  and every sampler then falls back to some id (0): the generation loops stop
  such a row instead (`SpeculativeStats.non_finite`)."""
  bad = jnp.isnan(x) | jnp.isposinf(x)
  return ~jnp.any(bad.reshape(x.shape[0], -1), axis=-1)


def _fit_vocab(x: jax.Array, v: int) -> jax.Array:
  """`x [..., V']` cut or zero-padded to `[..., v]` (a draft's vocabulary size)."""
  extra = v - x.shape[-1]
  if extra <= 0:
    return x[..., :v]
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


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
  if params.min_p is not None:  # after temperature; the largest probability is always kept

    def min_p(probs):
      m = per_row(params.min_p)
      kept = jnp.where(probs >= m * jnp.max(probs, axis=-1, keepdims=True), probs, 0.0)
      return jnp.where(m > 0, kept / jnp.sum(kept, axis=-1, keepdims=True), probs)

    probs = jax.lax.cond(jnp.any(params.min_p > 0), min_p, lambda x: x, probs)

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
