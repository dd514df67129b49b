"""Per-row sampling data: the text the penalties read (`TokenHistory`) and the
settings of each row as arrays (`RowSampling`), with their checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.sampling.params import (
  MAX_LOGIT_BIAS,
  MAX_STOP_TOKEN_IDS,
  MIN_TEMPERATURE,
  RANGES,
  SamplingParams,
)
from specjax.validation import FieldError


@struct.dataclass
class TokenHistory:
  """The text the penalties read, per row, and under speculation per scored
  position (`along`).

  Attributes:
    counts: `[B, V]` int32, each token's count in the committed generated text.
    prompt: `[B, V]` bool, the tokens of the prompt.
    length: `[B]` int32, tokens generated so far (`min_tokens` reads it); after
      `along`, `[B, g + 1]` at each scored position.
    drafted: None, or after `along` the drafted tokens `[B, g]`.
    path: None, or after `along` `[B, g + 1, g]` bool: drafted token j comes
      before scored position t (on its path, for a tree).
  """

  counts: jax.Array
  prompt: jax.Array
  length: jax.Array
  drafted: jax.Array | None = None
  path: jax.Array | None = None

  @classmethod
  def of_prompts(
    cls, prompts: jax.Array, prompt_lengths: jax.Array, vocab_size: int
  ) -> TokenHistory:
    """Nothing generated yet; `prompts [B, P]` right-padded, `prompt_lengths [B]`."""
    b, width = prompts.shape
    valid = jnp.arange(width)[None, :] < prompt_lengths[:, None]
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], prompts.shape)
    prompt = jnp.zeros((b, vocab_size), bool).at[rows, prompts].max(valid, mode="drop")
    return cls(jnp.zeros((b, vocab_size), jnp.int32), prompt, jnp.zeros((b,), jnp.int32))

  def after(self, tokens: jax.Array, count: jax.Array | None = None) -> TokenHistory:
    """The history after the row's next tokens `tokens [B, n]` (or `[B]`), the
    first `count [B]` of them (default all)."""
    tokens = tokens.reshape(tokens.shape[0], -1)
    n = tokens.shape[1]
    count = jnp.full(tokens.shape[:1], n, jnp.int32) if count is None else count
    valid = (jnp.arange(n)[None, :] < count[:, None]).astype(jnp.int32)
    rows = jnp.broadcast_to(jnp.arange(tokens.shape[0])[:, None], tokens.shape)
    counts = self.counts.at[rows, tokens].add(valid, mode="drop")
    return self.replace(counts=counts, length=self.length + count)

  def along(self, tokens: jax.Array, parents: jax.Array | None = None) -> TokenHistory:
    """The history before each position of a scored block: s[-1] then the drafted
    `tokens [B, g]`. Position t of a chain: after x_1..x_t; with `parents [B or
    1, g]` (a token tree), position c + 1: after the nodes on node c's path from
    the root. Only the path is built here (`[B, g + 1, g]`); the counts `[B,
    g + 1, V]` when a warp reads them (`position_counts`)."""
    b, g = tokens.shape
    if parents is None:
      path = jnp.arange(g)[None, :] < jnp.arange(g + 1)[:, None]
      path = jnp.broadcast_to(path[None], (b, g + 1, g))
    else:
      path = jnp.zeros((b, g + 1, g), bool)
      for c in range(g):  # a parent's position is its column + 1 (-1, the root: 0)
        parent = jnp.clip(jnp.broadcast_to(jnp.asarray(parents[:, c]), (b,)) + 1, 0, c)
        above = jnp.take_along_axis(path, parent[:, None, None], axis=1)[:, 0]
        path = path.at[:, c + 1].set(above.at[:, c].set(True))
    length = self.length[:, None] + jnp.sum(path, axis=-1, dtype=jnp.int32)
    return self.replace(length=length, drafted=tokens, path=path)

  def position_counts(self) -> jax.Array:
    """`[B, V]` the counts, or after `along` `[B, g + 1, V]` at each position."""
    if self.path is None:
      return self.counts
    hot = jax.nn.one_hot(self.drafted, self.counts.shape[-1], dtype=jnp.int32)  # [B, g, V]
    extra = jnp.einsum("btj,bjv->btv", self.path.astype(jnp.int32), hot)
    return self.counts[:, None] + extra


@struct.dataclass
class RowSampling:
  """Per-row sampling settings as data (a pytree of `[B]` arrays): row b is warped
  with the `SamplingParams` it was built from, greedy and sampled rows in one
  program. Build it with `RowSampling.of`, which checks every row; fields left
  None (built by hand) are off.

  Attributes:
    temperature: `[B]` float32, >= 0 (below `MIN_TEMPERATURE`: greedy).
    top_k: `[B]` int32, >= 0 (0 = off).
    top_p: `[B]` float32 in (0, 1] (1 = off).
    presence_penalty, frequency_penalty, repetition_penalty, min_p: `[B]`
      float32, as in `SamplingParams`.
    bias_ids: `[B, MAX_LOGIT_BIAS]` int32, the biased ids (-1: padding).
    bias: `[B, MAX_LOGIT_BIAS]` float32, their biases.
    min_tokens: `[B]` int32; ignore_eos `[B]` bool.
    stop_token_ids: `[B, MAX_STOP_TOKEN_IDS]` int32 (-1: padding).
    history: None, or the rows' `TokenHistory` the penalties read (the loops
      bind it: `with_history`); None reads as an empty text.
    eos_id: static, the loop's EOS ids that `min_tokens` masks (None: none).
  """

  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array
  presence_penalty: jax.Array | None = None
  frequency_penalty: jax.Array | None = None
  repetition_penalty: jax.Array | None = None
  min_p: jax.Array | None = None
  bias_ids: jax.Array | None = None
  bias: jax.Array | None = None
  min_tokens: jax.Array | None = None
  ignore_eos: jax.Array | None = None
  stop_token_ids: jax.Array | None = None
  history: TokenHistory | None = None
  eos_id: int | tuple[int, ...] | None = struct.field(pytree_node=False, default=None)

  @classmethod
  def of(
    cls, params: SamplingParams | list[SamplingParams], batch: int | None = None
  ) -> RowSampling:
    """Rows from one `SamplingParams` per row (each validated), or one for `batch` rows."""
    if isinstance(params, SamplingParams):
      if batch is None:
        raise FieldError("batch", "batch is needed to broadcast one SamplingParams to rows.")
      params = [params] * batch
    params = list(params)
    if not params or not all(isinstance(p, SamplingParams) for p in params):
      raise FieldError(
        "params", f"params must be a non-empty list of specjax.SamplingParams, got {params!r}."
      )

    def padded(rows, width, fill, dtype):
      out = np.full((len(rows), width), fill, dtype)
      for b, row in enumerate(rows):
        out[b, : len(row)] = row
      return jnp.asarray(out)

    def column(name, dtype):
      return jnp.asarray([getattr(p, name) for p in params], dtype)

    return cls(
      temperature=column("temperature", jnp.float32),
      top_k=column("top_k", jnp.int32),
      top_p=column("top_p", jnp.float32),
      presence_penalty=column("presence_penalty", jnp.float32),
      frequency_penalty=column("frequency_penalty", jnp.float32),
      repetition_penalty=column("repetition_penalty", jnp.float32),
      min_p=column("min_p", jnp.float32),
      bias_ids=padded([[i for i, _ in p.logit_bias] for p in params], MAX_LOGIT_BIAS, -1, np.int32),
      bias=padded([[v for _, v in p.logit_bias] for p in params], MAX_LOGIT_BIAS, 0, np.float32),
      min_tokens=column("min_tokens", jnp.int32),
      ignore_eos=column("ignore_eos", bool),
      stop_token_ids=padded([p.stop_token_ids for p in params], MAX_STOP_TOKEN_IDS, -1, np.int32),
    )

  @property
  def greedy(self) -> bool:
    """Static: whether the warp is known to be greedy at trace time. Never for
    per-row settings (greedy rows are one-hot inside the sampled warp)."""
    return False

  @property
  def batch(self) -> int:
    return self.temperature.shape[0]

  def with_history(
    self, history: TokenHistory | None, eos_id: int | tuple[int, ...] | None
  ) -> RowSampling:
    """The warp of rows whose text is `history` (counts `[B, ..., V]` against
    logits `[B, ..., V]`), with the loop's EOS ids for `min_tokens`."""
    return self.replace(history=history, eos_id=eos_id)

  def after(self, tokens: jax.Array) -> RowSampling:
    """The warp after each row's next token `tokens [B]` (a drafter's chain:
    the counts advanced by the token just drawn); unchanged without a history."""
    if self.history is None:
      return self
    return self.replace(history=self.history.after(tokens))

  def repeat(self, count: int) -> RowSampling:
    """Each row's settings `count` times in a run: the warp of `[B * count, ...]`
    logits laid out row by row (e.g. a tree's nodes of each row)."""
    return jax.tree.map(lambda x: jnp.repeat(x, count, axis=0), self)

  def all_greedy(self) -> bool:
    """On the host: every row is greedy (no random numbers needed)."""
    return bool(np.all(np.asarray(self.temperature) < MIN_TEMPERATURE))

  def check(self, vocab_size: int, batch: int) -> None:
    """Raises a FieldError naming the field and row when a setting is out of range
    (on the host, before compiling)."""
    if self.batch != batch:
      raise FieldError("sampling", f"sampling has {self.batch} rows but the batch has {batch}.")
    t, k, p = (np.asarray(x) for x in (self.temperature, self.top_k, self.top_p))
    checks = [
      ("temperature", t, np.isfinite(t) & (t >= 0), "a number >= 0 and finite (0 = greedy)"),
      ("top_k", k, (k >= 0) & (k <= vocab_size), f"an integer in [0, vocab_size={vocab_size}]"),
      ("top_p", p, (p > 0) & (p <= 1), "in (0, 1] (1 = off)"),
    ]
    for name, (allowed, ok) in RANGES.items():
      if getattr(self, name) is not None:
        values = np.asarray(getattr(self, name))
        checks.append((name, values, ok(values), allowed))
    if self.min_tokens is not None:
      values = np.asarray(self.min_tokens)
      checks.append(("min_tokens", values, values >= 0, "an integer >= 0 (0 = off)"))
    for name, values, ok, allowed in checks:
      if values.shape != (batch,):
        raise FieldError(
          f"sampling.{name}", f"sampling.{name} must have shape [{batch}], got {values.shape}."
        )
      if not ok.all():
        row = int(np.argmin(ok))
        raise FieldError(
          f"sampling.{name}", f"sampling.{name} must be {allowed}; row {row} has {values[row]!r}."
        )
    if self.bias is not None:
      bias = np.asarray(self.bias)
      ok = (bias >= -100) & (bias <= 100)
      if not ok.all():
        row = int(np.argmin(ok.all(axis=-1)))
        raise FieldError(
          "sampling.bias", f"sampling.bias (logit_bias) must be in [-100, 100]; row {row} is not."
        )
    for name in ("bias_ids", "stop_token_ids"):
      ids = getattr(self, name)
      if ids is not None:
        ids = np.asarray(ids)
        ok = (ids >= -1) & (ids < vocab_size)
        if ids.ndim != 2 or ids.shape[0] != batch or not ok.all():
          raise FieldError(
            f"sampling.{name}",
            f"sampling.{name} must be [{batch}, n] ids in [0, vocab_size={vocab_size}) "
            "(-1: padding).",
          )
