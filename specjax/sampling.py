"""Sampling warps: logits -> the probabilities that are sampled *and* verified.

Exactness needs q to be the very law each draft token was drawn from and p the
target's after the same warp, so `warp_probs` serves draft and target alike and
`sample` draws from its probabilities, never raw logits. Settings are static
(`SamplingParams`) or per-row data (`RowSampling`). All arithmetic is float32.

The order is vLLM's (v1 sampler). On the raw logits: `logit_bias`, the
`min_tokens` mask (EOS and stop ids at -inf until then), then the repetition
penalty (over the prompt and the generated tokens, as vLLM and Hugging Face
define it), then the frequency and presence penalties (over the generated
tokens only, as OpenAI defines them). Then temperature, then min-p, top-k and
top-p (min-p and top-k commute: both keep the tokens above a threshold of one
order); temperature 0 is one-hot at the argmax of the penalised logits (lowest
index on ties).

The penalties read a row's text (`TokenHistory`): under speculation the warp at
draft position t reads the counts including the drafted tokens before t, and
the target's p at scored row t the same (`TokenHistory.along`), so p and q are
warped alike and every verifier stays exact.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.validation import FieldError, is_int, is_real

# A positive temperature below float32's smallest normal number cannot divide
# logits in float32 (it is flushed to zero or overflows every quotient): such
# a temperature is greedy decoding in all but name, and is treated as greedy.
MIN_TEMPERATURE = float(np.finfo(np.float32).tiny)
# Settings are stored in float32 and int32 (`RowSampling`): a value past these
# would overflow to inf (or wrap) there, so the checks refuse it where it is given.
MAX_FLOAT32 = float(np.finfo(np.float32).max)
MAX_INT32 = int(np.iinfo(np.int32).max)

# Fixed per-row capacities, so that a row's bias and stop ids are data, not shape.
MAX_LOGIT_BIAS = 300  # entries of `logit_bias` per row (OpenAI's limit)
MAX_STOP_TOKEN_IDS = 32  # entries of `stop_token_ids` per row

# Each real-valued warp setting: its allowed range as the errors word it, and the
# test of a value (numpy-vectorised: it checks one value or a row's array).
RANGES = {
  "presence_penalty": ("in [-2, 2] (0 = off)", lambda x: (x >= -2) & (x <= 2)),
  "frequency_penalty": ("in [-2, 2] (0 = off)", lambda x: (x >= -2) & (x <= 2)),
  # Below float32's smallest normal number a penalty is 0 (or flushed to it) once
  # stored: dividing by it is no penalty at all.
  "repetition_penalty": (
    f"in (0, 2] and at least {MIN_TEMPERATURE:.4g} (float32's smallest normal; 1 = off)",
    lambda x: (x >= MIN_TEMPERATURE) & (x <= 2),
  ),
  "min_p": ("in [0, 1] (0 = off)", lambda x: (x >= 0) & (x <= 1)),
}


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Static sampling settings (hashable, so they can be jit static arguments).

  Attributes:
    temperature: >= 0 and at most `MAX_FLOAT32` (~3.4e38, float32's largest:
      it is stored in float32); below `MIN_TEMPERATURE` (~1.2e-38): greedy.
    top_k: keep the k most likely tokens (and ties with the k-th); 0: off.
    top_p: keep the smallest most-likely set of mass >= top_p, in (0, 1]; 1: off.
    presence_penalty: in [-2, 2]; subtracted from the logit of every token the
      row has generated (OpenAI's; not the prompt's tokens). 0: off.
    frequency_penalty: in [-2, 2]; times the token's count in the generated
      text, subtracted from its logit (OpenAI's). 0: off.
    repetition_penalty: in [`MIN_TEMPERATURE`, 2]; a token seen in the prompt or the generated
      text has its positive logit divided by it, its negative one multiplied
      (vLLM's and Hugging Face's). 1: off.
    logit_bias: token id -> bias in [-100, 100] added to its logit (a dict, or
      pairs), at most `MAX_LOGIT_BIAS` ids, each checked against the vocabulary.
    min_p: in [0, 1]; keep the tokens of probability >= min_p times the
      largest, after temperature (vLLM's). 0: off.
    min_tokens: in [0, `MAX_INT32`]; EOS (unless `ignore_eos`) and `stop_token_ids` are masked
      until the row has generated this many tokens. 0: off.
    ignore_eos: the model's EOS ids do not stop the row (it runs to its budget
      or a stop id).
    stop_token_ids: ids (at most `MAX_STOP_TOKEN_IDS`) after any of which the
      row stops (the id is kept), besides the EOS ids.

  The settings after `top_p` need the row's text (`TokenHistory`): the
  generation loops run a `SamplingParams` that sets any of them as
  `RowSampling` rows (data: new values never recompile).
  """

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  repetition_penalty: float = 1.0
  logit_bias: tuple[tuple[int, float], ...] = ()
  min_p: float = 0.0
  min_tokens: int = 0
  ignore_eos: bool = False
  stop_token_ids: tuple[int, ...] = ()

  def __post_init__(self):
    if not is_real(self.temperature) or not 0 <= self.temperature <= MAX_FLOAT32:
      raise FieldError(
        "temperature",
        f"temperature must be a number >= 0 and at most {MAX_FLOAT32:.4g} (float32's "
        f"largest; 0 = greedy), got {self.temperature!r}.",
      )
    if not is_int(self.top_k) or self.top_k < 0:
      raise FieldError("top_k", f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}.")
    if not is_real(self.top_p) or not 0 < self.top_p <= 1:
      raise FieldError("top_p", f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}.")
    for name, (allowed, ok) in RANGES.items():
      value = getattr(self, name)
      if not is_real(value) or not ok(value):
        raise FieldError(name, f"{name} must be {allowed}, got {value!r}.")
      object.__setattr__(self, name, float(value))
    object.__setattr__(self, "logit_bias", check_logit_bias(self.logit_bias))
    if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= MAX_INT32:
      raise FieldError(
        "min_tokens",
        f"min_tokens must be an integer >= 0 and at most {MAX_INT32} (int32; 0 = off), "
        f"got {self.min_tokens!r}.",
      )
    if not isinstance(self.ignore_eos, (bool, np.bool_)):
      raise FieldError("ignore_eos", f"ignore_eos must be a bool, got {self.ignore_eos!r}.")
    object.__setattr__(self, "stop_token_ids", check_stop_token_ids(self.stop_token_ids))
    # numpy scalars become Python numbers: equal settings hash equally (jit cache).
    object.__setattr__(self, "temperature", float(self.temperature))
    object.__setattr__(self, "top_k", int(self.top_k))
    object.__setattr__(self, "top_p", float(self.top_p))
    object.__setattr__(self, "min_tokens", int(self.min_tokens))
    object.__setattr__(self, "ignore_eos", bool(self.ignore_eos))

  @property
  def greedy(self) -> bool:
    return self.temperature < MIN_TEMPERATURE

  @property
  def has_warps(self) -> bool:
    """Whether it sets anything past temperature, top-k and top-p (the settings
    the loops run as `RowSampling` rows, with the rows' `TokenHistory`)."""
    return self != SamplingParams(self.temperature, self.top_k, self.top_p)

  def check_vocab(self, vocab_size: int) -> None:
    """Raises if top_k exceeds the vocabulary (it would silently mean 'off') or an
    id of logit_bias or stop_token_ids is not in it."""
    if self.top_k > vocab_size:
      raise FieldError("top_k", f"top_k must be in [0, vocab_size={vocab_size}], got {self.top_k}.")
    for name, ids in (
      ("logit_bias", [i for i, _ in self.logit_bias]),
      ("stop_token_ids", self.stop_token_ids),
    ):
      bad = [i for i in ids if i >= vocab_size]
      if bad:
        raise FieldError(
          name, f"{name} ids must be in [0, vocab_size={vocab_size}), got {bad[0]!r}."
        )


def check_logit_bias(bias) -> tuple[tuple[int, float], ...]:
  """`logit_bias` (a dict id -> bias, or pairs) as sorted `(id, bias)` pairs:
  ids integers in [0, `MAX_INT32`] (strings of ASCII digits too, as JSON keys
  are: `str.isdigit` would take other scripts' digits), biases in
  [-100, 100], at most `MAX_LOGIT_BIAS`. Raises a FieldError naming the field."""
  pairs = bias.items() if isinstance(bias, dict) else bias
  try:
    pairs = list(pairs)
  except TypeError:
    raise FieldError(
      "logit_bias", f"logit_bias must be a dict of token id -> bias, got {bias!r}."
    ) from None
  if len(pairs) > MAX_LOGIT_BIAS:
    raise FieldError(
      "logit_bias", f"logit_bias must have at most {MAX_LOGIT_BIAS} entries, got {len(pairs)}."
    )
  out = {}
  for pair in pairs:
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
      raise FieldError(
        "logit_bias", f"logit_bias must be a dict of token id -> bias, got {bias!r}."
      )
    token, value = pair
    if isinstance(token, str) and token.isascii() and token.isdigit():
      token = int(token)
    if not is_int(token) or not 0 <= token <= MAX_INT32:
      raise FieldError(
        "logit_bias",
        f"logit_bias keys must be token ids (integers in [0, {MAX_INT32}]), got {token!r}.",
      )
    if not is_real(value) or not -100 <= value <= 100:
      raise FieldError(
        "logit_bias", f"logit_bias values must be in [-100, 100], got {value!r} for {token}."
      )
    out[int(token)] = float(value)
  return tuple(sorted(out.items()))


def check_stop_token_ids(ids) -> tuple[int, ...]:
  """`stop_token_ids` as a tuple of ints in [0, `MAX_INT32`] (at most
  `MAX_STOP_TOKEN_IDS`)."""
  if not isinstance(ids, (list, tuple)) or not all(is_int(i) and 0 <= i <= MAX_INT32 for i in ids):
    raise FieldError(
      "stop_token_ids",
      f"stop_token_ids must be a list of token ids (integers in [0, {MAX_INT32}]), got {ids!r}.",
    )
  if len(ids) > MAX_STOP_TOKEN_IDS:
    raise FieldError(
      "stop_token_ids",
      f"stop_token_ids must have at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}.",
    )
  return tuple(int(i) for i in ids)


GREEDY = SamplingParams(temperature=0.0)


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
  module's order): logit bias, the `min_tokens` mask, then the repetition,
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
