"""Checks of the generation calls' arguments, run on the host before compiling.

Each failure is a `ValueError` naming the argument and its allowed range. Value
checks need concrete arrays: under a caller's `jax.jit` only static checks run.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np

from specjax import verify
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import check_capacity
from specjax.sampling import RowSampling, SamplingParams
from specjax.validation import FieldError, check_eos_ids, check_int, check_positive_int

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def _is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def check_prompts(prompts, prompt_lengths, vocab_size: int) -> tuple[int, int]:
  """Checks `prompts [B, P]` (right-padded ints) and `prompt_lengths [B]`.

  Returns:
    (B, P).
  """
  for name, x, rank in (("prompts", prompts, 2), ("prompt_lengths", prompt_lengths, 1)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise ValueError(f"{name} must be an integer array, got {type(x).__name__}.")
    if not np.issubdtype(x.dtype, np.integer):
      raise ValueError(f"{name} must have an integer dtype, got {x.dtype}.")
    if x.ndim != rank:
      raise ValueError(f"{name} must have rank {rank}, got shape {tuple(x.shape)}.")
  batch, width = prompts.shape
  if batch < 1 or width < 1:
    raise ValueError(f"prompts must have shape [B >= 1, P >= 1], got {tuple(prompts.shape)}.")
  if prompt_lengths.shape[0] != batch:
    raise ValueError(
      f"prompt_lengths has {prompt_lengths.shape[0]} rows but prompts has {batch}; they must match."
    )
  if _is_concrete(prompt_lengths):
    rows, lengths = _local_rows(prompt_lengths)
    bad = (lengths < 1) | (lengths > width)
    if bad.any():
      raise ValueError(
        f"prompt_lengths must be in [1, P={width}], got {lengths[bad].tolist()} "
        f"at rows {rows[bad].tolist()}."
      )
    if _is_concrete(prompts):
      prompt_rows, tokens = _local_rows(prompts)
      length_of = dict(zip(rows.tolist(), lengths.tolist()))
      # Multi-host: check the rows this process holds of both arrays.
      keep = [i for i, r in enumerate(prompt_rows.tolist()) if r in length_of]
      prompt_rows, tokens = prompt_rows[keep], tokens[keep]
      lengths = np.asarray([length_of[r] for r in prompt_rows.tolist()], np.int64)
      valid = np.arange(width)[None, :] < lengths[:, None]
      bad = valid & ((tokens < 0) | (tokens >= vocab_size))
      if bad.any():
        rows, cols = np.nonzero(bad)
        raise ValueError(
          f"prompts must hold token ids in [0, vocab_size={vocab_size}) within "
          f"prompt_lengths; got {tokens[rows[0], cols[0]]} at row "
          f"{prompt_rows[rows[0]]}, column {cols[0]}."
        )
  return batch, width


def _local_rows(x) -> tuple[np.ndarray, np.ndarray]:
  """(row indices, values) of the rows this process holds: all of them for host
  or fully addressable arrays; on multi-host meshes each process checks its own."""
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    values = np.asarray(x)
    return np.arange(values.shape[0]), values
  rows = {}
  for shard in x.addressable_shards:
    start = shard.index[0].start or 0
    for i, row in enumerate(np.asarray(shard.data)):
      rows[start + i] = row
  order = sorted(rows)
  return np.asarray(order), np.stack([rows[r] for r in order])


def check_sampling(sampling, vocab_size: int, batch: int, per_row: bool = True) -> None:
  """A `SamplingParams`, or (where the loop takes them, `per_row`) `RowSampling`
  of `batch` rows, every setting in range."""
  if per_row and isinstance(sampling, RowSampling):
    sampling.check(vocab_size, batch)
    return
  if not isinstance(sampling, SamplingParams):
    kinds = "a specjax.SamplingParams or RowSampling" if per_row else "a specjax.SamplingParams"
    raise FieldError("sampling", f"sampling must be {kinds}, got {sampling!r}.")
  sampling.check_vocab(vocab_size)


def as_rows(sampling, vocab_size: int, prompts) -> SamplingParams | RowSampling:
  """A `SamplingParams` that sets penalties, bias, min-p or stop settings
  (`has_warps`), checked against the vocabulary and run as `RowSampling` rows
  (they read each row's text); anything else as it is (checked later)."""
  if isinstance(sampling, SamplingParams) and sampling.has_warps:
    sampling.check_vocab(vocab_size)
    return RowSampling.of(sampling, np.shape(prompts)[0] if np.ndim(prompts) else 1)
  return sampling


def check_pad_id(pad_id) -> int:
  """The output buffer is int32: pad_id must fit in it."""
  return check_int("pad_id", pad_id, INT32_MIN, INT32_MAX)


def check_key(key, sampling: SamplingParams | RowSampling, batch: int | None = None) -> jax.Array:
  """A typed PRNG key from a typed key of shape () or raw `uint32[2]` data; with
  `batch`, also one key per row: typed keys `[batch]` or raw `uint32[batch, 2]`
  (returned as `[batch]` typed keys). Required unless every row is greedy."""

  if key is None:
    greedy = sampling.all_greedy() if isinstance(sampling, RowSampling) else sampling.greedy
    if not greedy:
      raise ValueError("key must be a jax.random key when temperature > 0.")
    return jax.random.key(0)
  per_row = "" if batch is None else f", or one per row (keys [{batch}] or uint32[{batch}, 2])"
  if isinstance(key, jax.Array):
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
      if key.shape == () or (batch is not None and key.shape == (batch,)):
        return key
      raise ValueError(
        f"key must be a single jax.random.key (shape ()){per_row}, got keys of "
        f"shape {tuple(key.shape)}."
      )
    if key.dtype == np.uint32 and key.shape == (2,):
      return jax.random.wrap_key_data(key)
    if key.dtype == np.uint32 and batch is not None and key.shape == (batch, 2):
      return jax.random.wrap_key_data(key)
  raise ValueError(f"key must be a jax.random.key(...){per_row}, got {key!r}.")


def per_row_keys(key) -> bool:
  """Whether `key` looks like one key per row (typed `[B]` or uint32 `[B, 2]`);
  `check_key` checks B."""
  if not isinstance(key, jax.Array):
    return False
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    return key.ndim == 1
  return key.dtype == np.uint32 and key.ndim == 2


class GenerateArgs(NamedTuple):
  """The arguments every generate loop shares, checked and normalised."""

  max_new_tokens: int
  eos_id: int | tuple[int, ...] | None
  pad_id: int
  batch: int
  width: int  # P, the prompts' padded width
  capacity: int  # KV-cache slots per row (`cache_capacity`)


def check_generate_args(
  cfg: ModelConfig,
  role: str,
  prompts,
  prompt_lengths,
  *,
  max_new_tokens,
  sampling,
  eos_id,
  pad_id,
  gamma: int | None = None,
  per_row: bool = True,
) -> GenerateArgs:
  """The generate loops' shared checks for the model (`role`, e.g. "target") of
  config `cfg`; `gamma` adds a block's slack to the capacity; `per_row`: the
  loop takes `RowSampling`. The key is checked later (`check_key`)."""
  max_new_tokens = check_positive_int("max_new_tokens", max_new_tokens)
  batch, width = check_prompts(prompts, prompt_lengths, cfg.vocab_size)
  check_sampling(sampling, cfg.vocab_size, batch, per_row)
  eos_id = check_eos_ids("eos_id", eos_id, cfg.vocab_size)
  pad_id = check_pad_id(pad_id)
  capacity = check_capacity(role, cfg.max_seq_len, width, max_new_tokens, gamma)
  return GenerateArgs(max_new_tokens, eos_id, pad_id, batch, width, capacity)


def resolve_verifier(
  verifier, sampling: SamplingParams | RowSampling, allowed=None, per_row_keys: bool = False
):
  """The verifier a loop runs: "auto" is "greedy" at temperature 0, else "token",
  or "coupled" when the keys are per row.

  Args:
    verifier: "auto", a name in `specjax.verify.VERIFIERS`, or a verifier function.
    sampling: the loop's warp (`RowSampling` is never greedy as a whole).
    allowed: None (any verifier), or the names a loop takes besides "auto".
    per_row_keys: the call gave one key per row.

  Raises:
    ValueError naming `verifier` when it is unknown, not allowed, "greedy"
    while sampling, or a batch-wide rule with per-row keys.
  """
  if verifier == "auto":
    if sampling.greedy:
      return "greedy"
    return "coupled" if per_row_keys else "token"
  if allowed is not None and verifier not in allowed:
    names = [repr(name) for name in ("auto", *allowed)]
    names = ", ".join(names[:-1]) + " or " + names[-1]
    raise ValueError(f"verifier must be one of {names}, got {verifier!r}.")
  rule = verify.get_verifier(verifier)
  if rule is verify.greedy_verify and not sampling.greedy:
    raise ValueError(
      "verifier='greedy' needs temperature 0 (a static SamplingParams, without penalties, "
      "logit_bias, min_p or stop settings, which run as per-row settings); use 'token', "
      "'block', 'coupled' or 'auto'."
    )
  if per_row_keys and rule is not verify.coupled_verify and not sampling.greedy:
    raise ValueError(
      f"verifier={verifier!r} draws one batch of random numbers, so it cannot use one "
      "key per row: pass verifier='coupled' (or 'auto') with per-row keys, or one key."
    )
  if rule is verify.coupled_verify and sampling.greedy:
    return "greedy"  # the coupled draw from a one-hot law is its argmax
  return verifier
