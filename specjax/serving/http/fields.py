"""A request body parsed and its fields checked, each failure a 400 naming the
field (`param`) and its allowed range: the JSON itself, pydantic's types, the
API's own bounds, numbers in the dtype they are stored in, and the library's
ranges (`SamplingParams`, `Engine.check`), whose `FieldError`s name the
library's field, renamed here to this API's (`API_NAMES`)."""

from __future__ import annotations

import dataclasses
import json

import pydantic

from specjax import grammar
from specjax.sampling import MAX_INT32, SamplingParams
from specjax.serving.http.bodies import DEFAULT_LIMITS, NESTED, CompletionBody, RequestBody
from specjax.serving.http.errors import APIError
from specjax.serving.http.structured import constraint_of
from specjax.serving.limits import ServerLimits
from specjax.validation import FieldError

# The library's names of a request's fields (`FieldError.field`) that this API
# calls otherwise; any other is the same in both.
API_NAMES = {
  "max_new_tokens": "max_tokens",
  "stop_id": "stop_token_id",
  "max_draft_tokens": "speculation.max_draft_tokens",
  "timeout_s": "timeout",
  **{f"sampling.{f.name}": f.name for f in dataclasses.fields(SamplingParams)},
}
# Fields of two types: pydantic's message per member is noise.
_UNIONS = {
  "prompt": "a string or a list of integer token ids",
  "stop": "a string or a list of strings",
  "tool_choice": '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
}
STOP_STRINGS = 4  # at most, as OpenAI's API
INT32_MIN = -(2**31)
MAX_CHOICES = 16  # n at most
MAX_USER_CHARS = 256  # `user`'s characters at most
# Integer fields stored as int32 by the engine and not `SamplingParams`' (which
# bounds min_tokens and stop_token_ids itself); the seed is 64-bit (`request_key`).
# Each with its least value (checked, below it, where the field's own range is).
_INT32_FIELDS = {
  "max_tokens": 1,
  "max_completion_tokens": 1,
  "top_k": 0,
  "stop_token_id": 0,
  "logprobs": 0,
  "top_logprobs": 0,
}


def field_error(error: ValueError) -> APIError:
  """A 400 from the library's error about a request: a `FieldError`'s field, by
  this API's name, is `param` and begins the message."""
  if not isinstance(error, FieldError):
    return APIError(400, str(error))
  name = API_NAMES.get(error.field, error.field)
  return APIError(400, str(error.renamed(name)), name)


def parse_body(
  raw: bytes, kind: type[RequestBody] = CompletionBody, limits: ServerLimits = DEFAULT_LIMITS
) -> RequestBody:
  """The validated body of a `kind` request; raises APIError (400) naming the offending
  field. Cheap checks only (`limits`' bounds on its size and its constraint): no
  tokenizing, no compiling."""
  data = _load(raw, limits)
  body = _validate(data, kind)
  stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
  if len(stop) > STOP_STRINGS or not all(stop):
    raise APIError(
      400, f"stop must be up to {STOP_STRINGS} non-empty strings, got {_short(stop)}.", "stop"
    )
  longest = max(map(len, stop), default=0)
  if longest > limits.max_stop_chars:
    raise APIError(
      400,
      f"stop: each stop string has at most {limits.max_stop_chars} characters "
      f"(max_stop_chars), got one of {longest}.",
      "stop",
    )
  body.stop = stop
  if not 1 <= body.n <= MAX_CHOICES:
    raise APIError(400, f"n must be an integer in [1, {MAX_CHOICES}], got {body.n}.", "n")
  if body.user is not None and len(body.user) > MAX_USER_CHARS:
    raise APIError(
      400, f"user has at most {MAX_USER_CHARS} characters, got {len(body.user)}.", "user"
    )
  check_numbers(body)
  constraint_of(body, limits)  # its shape and size are checked here; compiling it comes later
  return body


def _no_constant(name: str):
  raise ValueError(f"{name} is not a JSON number")


def _load(raw: bytes, limits: ServerLimits) -> dict:
  """The body's JSON object, within `limits`' nesting, every string valid Unicode."""
  try:
    data = json.loads(raw, parse_constant=_no_constant)  # no NaN / Infinity
  except RecursionError:
    raise APIError(
      400, f"the request body nests too deeply; at most {limits.max_json_depth} levels."
    ) from None
  except (ValueError, UnicodeDecodeError) as e:
    raise APIError(400, f"the request body is not valid JSON: {e}") from None
  if not isinstance(data, dict):
    raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}.")
  depth = grammar.json_depth(data, limits.max_json_depth)
  if depth > limits.max_json_depth:
    raise APIError(
      400,
      f"the request body nests more than {limits.max_json_depth} levels deep (max_json_depth).",
    )
  for key, value in data.items():
    try:  # a lone surrogate ("\ud800") parses but is no text: no tokenizer takes it
      (str(key) + json.dumps(value, ensure_ascii=False)).encode("utf-8")
    except UnicodeEncodeError:
      raise APIError(
        400, f"{key} holds a lone surrogate (e.g. \\ud800): not valid Unicode text.", str(key)
      ) from None
  return data


def _validate(data: dict, kind: type[RequestBody]) -> RequestBody:
  """`data` as a `kind`; pydantic's first error, as a 400 naming its field."""
  try:
    return kind.model_validate(data)
  except RecursionError:
    raise APIError(400, "the request body nests too deeply.") from None
  except pydantic.ValidationError as e:
    error = e.errors()[0]
  field = ".".join(str(p) for p in error["loc"]) if error["loc"] else None
  param = str(error["loc"][0]) if error["loc"] else None
  if param in _UNIONS and error["type"] != "missing":
    message = f"{param} must be {_UNIONS[param]}, got {_short(data[param])}."
  elif error["type"] == "extra_forbidden":
    model = NESTED.get(tuple(error["loc"][:-1]), kind)
    allowed = ", ".join(f.alias or name for name, f in model.model_fields.items())
    message = f"{field} is not a supported field; the supported fields are {allowed}."
  elif error["type"] == "missing":
    message = f"{field} is required."
  else:
    message = f"{field}: {error['msg']}, got {_short(error.get('input'))}."
  raise APIError(400, message, param)


def check_numbers(body: RequestBody) -> None:
  """APIError (400 naming the field) for a number its storage dtype cannot hold:
  an integer past int32, and the sampling settings' own ranges (`SamplingParams`:
  a temperature past float32's largest, a repetition penalty below its smallest
  normal, a non-zero real that float32 rounds to 0)."""
  try:
    body.sampling()
  except ValueError as e:
    raise field_error(e) from None
  ints = [(f, getattr(body, f, None), least) for f, least in _INT32_FIELDS.items()]
  if body.speculation is not None:
    ints.append(("speculation.max_draft_tokens", body.speculation.max_draft_tokens, 0))
  for field, value, least in ints:
    if isinstance(value, int) and not INT32_MIN <= value <= MAX_INT32:
      raise APIError(
        400,
        f"{field} must be an integer in [{least}, {MAX_INT32}] (int32), got {value}.",
        field.split(".")[0],
      )


def _short(value, limit: int = 100) -> str:
  text = repr(value)
  return text if len(text) <= limit else text[: limit - 3] + "..."
