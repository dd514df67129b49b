"""Static sampling settings and their checks: `SamplingParams` (hashable, a jit
static argument), the ranges each setting is held to, `GREEDY`."""

from __future__ import annotations

import dataclasses

import numpy as np

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
    check_float32("top_p", self.top_p)
    for name, (allowed, ok) in RANGES.items():
      value = getattr(self, name)
      if not is_real(value) or not ok(value):
        raise FieldError(name, f"{name} must be {allowed}, got {value!r}.")
      check_float32(name, value)
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


def check_float32(name: str, value: float) -> None:
  """FieldError for a non-zero real that float32 (the rows' dtype) rounds to 0
  or a subnormal (flushed to 0 on most devices): the setting would be silently
  lost (a penalty of 1e-45 is none at all)."""
  if value != 0 and abs(value) < MIN_TEMPERATURE:
    raise FieldError(
      name,
      f"{name} underflows float32 (its smallest normal is {MIN_TEMPERATURE:.4g}), got {value!r}.",
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
    check_float32("logit_bias", value)
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
