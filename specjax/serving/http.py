"""An OpenAI-style API over a `BackgroundEngine` (FastAPI).

  app = make_app(BackgroundEngine(engine), tokenizer, "specjax-stdlib", chat_template)
  uvicorn.run(app)              # specjax/jobs/serve.py does this, with shutdown

  POST /v1/completions       {"prompt": "def f(x):\\n", "max_tokens": 32, "stream": true}
  POST /v1/chat/completions  {"messages": [{"role": "user", "content": "hi"}]}
  GET  /v1/models            the served model
  GET  /health               {"status": "ok", "model": ..., engine settings}
  GET  /metrics              Prometheus text format (/metrics.json: `Engine.metrics()`)

The fields are `_Body`'s and each endpoint's own (docs/serving.md); any other
is refused rather than ignored. Every invalid request gets status 400 (404 for
another model) and `{"error": {"message", "type": "invalid_request_error",
"param"}}`, the message naming the field and its allowed range; the ranges are
the engine's own (`Engine.check`'s messages, with its field names changed).
The server's own bounds (`specjax.serving.limits.ServerLimits`) answer in the
same shape: 413 for a body too large, 415 for a Content-Type other than JSON,
429 (with Retry-After) past a queue or concurrency cap, 401 without the API
key when one is set (`make_app(api_key=...)`); docs/serving.md, "Limits and
security".

Streaming sends one server-sent event per engine event that adds text, then
`data: [DONE]`. A client that disconnects has its request cancelled in the
engine, freeing its slot.

Every `usage` (a stream's last chunk with `stream_options.include_usage`)
carries `speculation`: the request's drafted and accepted tokens, by draft
position, and forced ones (with n > 1 also each choice's, under `choices`),
which summed over requests equal /metrics' counters (docs/serving.md).
`user` (OpenAI's end-user identifier) is checked and otherwise ignored.

Structured output, in both endpoints: `response_format` ({"type": "json_object"}
or {"type": "json_schema", "json_schema": {"name", "schema"}}) and the
extensions `guided_regex` and `guided_choice` (vLLM's names). Each is compiled
once against the tokenizer, in a worker process the server can stop
(`specjax.serving.compiler`; cached), after the request's cheap checks, and
every token of the request, drafted or sampled, is drawn among what it allows;
the engine needs a constraint table (`EngineConfig.constraint_states`) and EOS ids.

Tool calls, in chat: `tools`, `tool_choice` and `parallel_tool_calls`
(`specjax.serving.tools`): the tools go to the chat template, the calls are a
constraint (`specjax.grammar.ToolCalls`) like the others, and the text is read
back as `message.tool_calls` (streamed: `delta.tool_calls`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import json
import logging
import math
import time
import uuid
from typing import Any

import numpy as np

from specjax import constraints, grammar
from specjax.vocab_map import token_bytes

try:
  import fastapi
  import prometheus_client
  import pydantic
  from fastapi.responses import JSONResponse, Response, StreamingResponse
  from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
  from starlette.exceptions import HTTPException
except ImportError as e:
  raise ImportError(
    "the HTTP server needs FastAPI and prometheus_client: pip install 'specjax[serve]'"
  ) from e

from specjax.data.chat import check_messages
from specjax.sampling import MAX_INT32, MIN_TEMPERATURE, SamplingParams
from specjax.serving.background import BackgroundEngine
from specjax.serving.compiler import CompilePool, CompileRefused
from specjax.serving.engine import QueueFull
from specjax.serving.limits import ServerLimits
from specjax.serving.request import Event, Request, SpeculationCounts
from specjax.serving.tools import (
  HERMES,
  ToolCallParser,
  ToolFormat,
  ToolOffer,
  template_messages,
)
from specjax.validation import FieldError

logger = logging.getLogger(__name__)

# The warps that read the row's text: the same name in the engine and in this API.
WARP_FIELDS = (
  "presence_penalty",
  "frequency_penalty",
  "repetition_penalty",
  "logit_bias",
  "min_p",
  "min_tokens",
  "ignore_eos",
  "stop_token_ids",
)
# The library's names of a request's fields (`FieldError.field`) that this API
# calls otherwise; any other is the same in both.
API_NAMES = {
  "max_new_tokens": "max_tokens",
  "stop_id": "stop_token_id",
  "max_draft_tokens": "speculation.max_draft_tokens",
  "timeout_s": "timeout",
  **{f"sampling.{f.name}": f.name for f in dataclasses.fields(SamplingParams)},
}
# How often a request's handler checks that its client is still connected.
_DISCONNECT_POLL_S = 0.25
_DISCONNECTED = object()  # queued by the disconnect watcher


class StreamOptions(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(extra="forbid", strict=True)
  include_usage: bool = False


class Speculation(pydantic.BaseModel):
  """The `speculation` extension: this request's own speculation settings."""

  model_config = pydantic.ConfigDict(extra="forbid", strict=True)
  enabled: bool = True  # false: decoded without drafted tokens (in the same batch)
  max_draft_tokens: int | None = None  # at most this many drafted tokens per step

  def cap(self) -> int | None:
    """`Request.max_draft_tokens`: None (the engine decides), or the cap."""
    return 0 if not self.enabled else self.max_draft_tokens


class JsonSchemaFormat(pydantic.BaseModel):
  """`response_format.json_schema`: OpenAI's named schema."""

  model_config = pydantic.ConfigDict(extra="forbid", strict=True, populate_by_name=True)
  name: str
  description: str | None = None
  schema_: dict[str, Any] | None = pydantic.Field(default=None, alias="schema")
  strict: bool | None = None


class ResponseFormat(pydantic.BaseModel):
  """`response_format`: "text" (no constraint), "json_object" or "json_schema"."""

  model_config = pydantic.ConfigDict(extra="forbid", strict=True)
  type: str
  json_schema: JsonSchemaFormat | None = None


RESPONSE_FORMATS = ("text", "json_object", "json_schema")
# What "json_object" stands for: any JSON object (outlines-core bounds its nesting).
JSON_OBJECT = {"type": "object"}


class _Body(pydantic.BaseModel):
  """The fields both endpoints accept (ranges are checked by the engine)."""

  # strict: no "16" for 16 or 1 for true; floats accept integers.
  model_config = pydantic.ConfigDict(extra="forbid", strict=True)
  model: str | None = None
  max_tokens: int = 16
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  stream: bool = False
  stream_options: StreamOptions | None = None
  stop_token_id: int | None = None
  stop: str | list[str] | None = None
  seed: int | None = None
  n: int = 1
  speculation: Speculation | None = None
  response_format: ResponseFormat | None = None
  guided_regex: str | None = None
  guided_choice: list[str] | None = None
  timeout: float | None = None  # seconds (an extension): the request's deadline
  user: str | None = None  # OpenAI's end-user identifier: checked, otherwise ignored
  # Warps over the request's text (`SamplingParams`; ranges checked there): OpenAI's
  # penalties and logit_bias, vLLM's repetition_penalty, min_p, min_tokens,
  # ignore_eos and stop_token_ids.
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  repetition_penalty: float = 1.0
  logit_bias: dict[str, float] | None = None
  min_p: float = 0.0
  min_tokens: int = 0
  ignore_eos: bool = False
  stop_token_ids: list[int] | None = None

  def sampling(self) -> SamplingParams:
    """The request's `SamplingParams` (a ValueError naming a field out of range)."""
    warps = {f: getattr(self, f) for f in WARP_FIELDS}
    warps["logit_bias"] = warps["logit_bias"] or {}
    warps["stop_token_ids"] = warps["stop_token_ids"] or []
    return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, **warps)


class CompletionBody(_Body):
  """The accepted JSON body of POST /v1/completions."""

  prompt: str | list[int]
  logprobs: int | None = None  # the legacy form: how many alternatives


class ChatBody(_Body):
  """The accepted JSON body of POST /v1/chat/completions."""

  messages: list[dict[str, Any]]
  max_completion_tokens: int | None = None  # the newer name of max_tokens
  logprobs: bool = False
  top_logprobs: int | None = None
  # Tool calls (specjax.serving.tools): OpenAI's function tools.
  tools: list[dict[str, Any]] | None = None
  tool_choice: str | dict[str, Any] | None = None
  parallel_tool_calls: bool = True

  def offer(self, limits: ServerLimits) -> ToolOffer | None:
    """The request's checked tools (None: none); APIError naming the field."""
    try:
      return ToolOffer.of(self.tools, self.tool_choice, self.parallel_tool_calls, limits.max_tools)
    except FieldError as e:
      raise APIError(400, str(e), e.field) from None


class APIError(Exception):
  """An error answered as `{"error": {"message", "type", "param"}}`; `retry_after`
  (seconds) adds a Retry-After header (429, 503)."""

  def __init__(
    self,
    status: int,
    message: str,
    param: str | None = None,
    kind: str | None = None,
    retry_after: float | None = None,
  ):
    super().__init__(message)
    self.status, self.message, self.param = status, message, param
    self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    self.retry_after = retry_after

  def response(self) -> JSONResponse:
    headers = None
    if self.retry_after is not None:
      headers = {"Retry-After": str(max(1, math.ceil(self.retry_after)))}
    if self.status == 401:
      headers = {"WWW-Authenticate": "Bearer"}
    return JSONResponse(self.body(), status_code=self.status, headers=headers)

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.kind, "param": self.param}}


def field_error(error: ValueError) -> APIError:
  """A 400 from the library's error about a request: a `FieldError`'s field, by
  this API's name, is `param` and begins the message."""
  if not isinstance(error, FieldError):
    return APIError(400, str(error))
  name = API_NAMES.get(error.field, error.field)
  return APIError(400, str(error.renamed(name)), name)


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
DEFAULT_LIMITS = ServerLimits()


def _no_constant(name: str):
  raise ValueError(f"{name} is not a JSON number")


def parse_body(
  raw: bytes, kind: type[_Body] = CompletionBody, limits: ServerLimits = DEFAULT_LIMITS
) -> _Body:
  """The validated body of a `kind` request; raises APIError (400) naming the offending
  field. Cheap checks only (`limits`' bounds on its size and its constraint): no
  tokenizing, no compiling."""
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
  try:
    body = kind.model_validate(data)
  except RecursionError:
    raise APIError(400, "the request body nests too deeply.") from None
  except pydantic.ValidationError as e:
    error = e.errors()[0]
    field = ".".join(str(p) for p in error["loc"]) if error["loc"] else None
    param = str(error["loc"][0]) if error["loc"] else None
    if param in _UNIONS and error["type"] != "missing":
      message = f"{param} must be {_UNIONS[param]}, got {_short(data[param])}."
    elif error["type"] == "extra_forbidden":
      model = _NESTED.get(tuple(error["loc"][:-1]), kind)
      allowed = ", ".join(f.alias or name for name, f in model.model_fields.items())
      message = f"{field} is not a supported field; the supported fields are {allowed}."
    elif error["type"] == "missing":
      message = f"{field} is required."
    else:
      message = f"{field}: {error['msg']}, got {_short(error.get('input'))}."
    raise APIError(400, message, param) from None
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
  _check_numbers(body)
  constraint_of(body, limits)  # its shape and size are checked here; compiling it comes later
  return body


# Integer fields stored as int32 by the engine and not `SamplingParams`' (which
# bounds min_tokens and stop_token_ids itself); the seed is 64-bit (`request_key`).
_INT32_FIELDS = (
  "max_tokens",
  "max_completion_tokens",
  "top_k",
  "stop_token_id",
  "logprobs",
  "top_logprobs",
)
# Real fields stored as float32 whose range holds 0 (off): a non-zero value that
# float32 rounds to 0 (or a subnormal, flushed to 0 on most devices) would be
# silently lost. (temperature and repetition_penalty: `SamplingParams`' ranges.)
_UNDERFLOWING = ("top_p", "presence_penalty", "frequency_penalty", "min_p")


def _check_numbers(body: _Body) -> None:
  """APIError (400 naming the field) for a number its storage dtype cannot hold:
  an integer past int32, a non-zero real that float32 rounds to 0, and the
  sampling settings' own ranges (`SamplingParams`: a temperature past float32's
  largest, a repetition penalty below its smallest normal)."""
  try:
    body.sampling()
  except ValueError as e:
    raise field_error(e) from None
  ints = [(f, getattr(body, f, None)) for f in _INT32_FIELDS]
  if body.speculation is not None:
    ints.append(("speculation.max_draft_tokens", body.speculation.max_draft_tokens))
  for field, value in ints:
    if isinstance(value, int) and not INT32_MIN <= value <= MAX_INT32:
      raise APIError(
        400,
        f"{field} must be an integer in [{INT32_MIN}, {MAX_INT32}] (int32), got {value}.",
        field.split(".")[0],
      )
  reals = [(f, getattr(body, f)) for f in _UNDERFLOWING]
  reals += [("logit_bias", v) for v in (body.logit_bias or {}).values()]
  for field, value in reals:
    if value != 0 and abs(value) < MIN_TEMPERATURE:
      raise APIError(
        400,
        f"{field} underflows float32 (its smallest normal is {MIN_TEMPERATURE:.4g}): use 0 "
        f"or a larger value, got {value!r}.",
        field,
      )


# Nested models, by their field's location (for the names of their fields).
_NESTED = {
  ("stream_options",): StreamOptions,
  ("speculation",): Speculation,
  ("response_format",): ResponseFormat,
  ("response_format", "json_schema"): JsonSchemaFormat,
}


def constraint_of(
  body: _Body, limits: ServerLimits = DEFAULT_LIMITS, tool_format: ToolFormat = HERMES
) -> tuple[str, constraints.Constraint] | None:
  """`(param, constraint)` that `body` asks for (None: free text); APIError (400)
  naming the field for a malformed or second one, or one past `limits`. A chat's
  tools (tool_choice other than "none") ask for calls in `tool_format`."""
  asked = []
  fmt = body.response_format
  if fmt is not None and fmt.type != "text":
    if fmt.type == "json_object":
      asked.append(("response_format", constraints.JsonSchema(JSON_OBJECT)))
    elif fmt.type == "json_schema":
      if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        where = "response_format.json_schema" + ("" if fmt.json_schema is None else ".schema")
        raise APIError(400, f"{where} is required for type json_schema.", where)
      schema = constraints.JsonSchema(fmt.json_schema.schema_)
      asked.append(("response_format.json_schema.schema", schema))
    else:
      raise APIError(
        400,
        f"response_format.type must be one of {', '.join(RESPONSE_FORMATS)}, got {fmt.type!r}.",
        "response_format.type",
      )
  if body.guided_regex is not None:
    asked.append(("guided_regex", constraints.Regex(body.guided_regex)))
  if body.guided_choice is not None:
    asked.append(("guided_choice", constraints.Choice(tuple(body.guided_choice))))
  offer = body.offer(limits) if isinstance(body, ChatBody) else None
  calls = None if offer is None else offer.constraint(tool_format)
  if calls is not None:
    asked.append(("tools", calls))
  if len(asked) > 1:
    names = " and ".join(p.split(".")[0] for p, _ in asked)
    raise APIError(400, f"one constraint per request: got {names}.", asked[1][0].split(".")[0])
  if asked:
    _check_size(*asked[0], limits)
  return asked[0] if asked else None


def _check_size(param: str, constraint, limits: ServerLimits) -> None:
  """APIError (400 naming `param`) for a constraint past `limits`: the cheap
  measures, before any compile."""

  def refuse(what: str, field: str):
    most = getattr(limits, field)
    raise APIError(400, f"{param}: {what}; this server takes at most {most} ({field}).", param)

  if isinstance(constraint, constraints.Regex):
    pattern = constraint.pattern
    if len(pattern) > limits.max_regex_chars:
      refuse(f"the regex has {len(pattern)} characters", "max_regex_chars")
    repeat = grammar.regex_repeat(pattern)
    if repeat > limits.max_regex_repeat:
      refuse(f"a counted repetition makes {repeat} copies of one piece", "max_regex_repeat")
  elif isinstance(constraint, grammar.ToolCalls):
    for name, schema in constraint.functions:
      _check_schema(f"{param}: function {name!r}'s parameters", json.loads(schema), limits)
  elif isinstance(constraint, constraints.Choice):
    options = constraint.options
    if len(options) > limits.max_choices:
      refuse(f"{len(options)} options", "max_choices")
    chars = sum(len(o) for o in options)
    if chars > limits.max_choice_chars:
      refuse(f"the options have {chars} characters together", "max_choice_chars")
  else:
    _check_schema(param, constraint.schema, limits)


def _check_schema(where: str, schema, limits: ServerLimits) -> None:
  """APIError (400 naming `where`'s field) for a schema past `limits`."""
  param = where.split(":")[0]
  size = len(json.dumps(schema).encode())
  if size > limits.max_schema_bytes:
    raise APIError(
      400,
      f"{where}: the schema has {size} bytes (as JSON); this server takes at most "
      f"{limits.max_schema_bytes} (max_schema_bytes).",
      param,
    )
  depth = grammar.json_depth(schema, limits.max_schema_depth)
  if depth > limits.max_schema_depth:
    raise APIError(
      400,
      f"{where}: the schema nests more than {limits.max_schema_depth} levels deep; this "
      f"server takes at most {limits.max_schema_depth} (max_schema_depth).",
      param,
    )


def _short(value, limit: int = 100) -> str:
  text = repr(value)
  return text if len(text) <= limit else text[: limit - 3] + "..."


class _Decoder:
  """Text of a growing token list, released as deltas: decodes the whole list
  each time and holds back a trailing U+FFFD (a character whose bytes are not
  all generated yet), so multi-token characters come out whole."""

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer
    self.ids: list[int] = []
    self.sent = ""

  def add(self, tokens, final: bool) -> str:
    self.ids.extend(tokens)
    text = self.tokenizer.decode(self.ids)
    if not final:
      text = text.rstrip("\ufffd")
    if not text.startswith(self.sent):  # a tokenizer whose decode is not prefix-stable
      return ""
    delta, self.sent = text[len(self.sent) :], text
    return delta


class _StopMatcher:
  """Where stop strings occur in a growing text, in time linear in the text:
  one Knuth-Morris-Pratt automaton per stop string, fed each new character once.
  `held()` is the longest tail of the text that still begins a stop string
  (what a stream must hold back); no work is proportional to the stop strings'
  lengths squared, which a long stop string would make block the event loop."""

  def __init__(self, stop: list[str]):
    self.stop = stop
    self.fail = [self._failure(s) for s in stop]
    self.state = [0] * len(stop)  # per stop string: its prefix the text ends with
    self.length = 0  # characters fed

  @staticmethod
  def _failure(s: str) -> list[int]:
    fail, k = [0] * len(s), 0
    for i in range(1, len(s)):
      while k and s[i] != s[k]:
        k = fail[k - 1]
      if s[i] == s[k]:
        k += 1
      fail[i] = k
    return fail

  def feed(self, text: str) -> int | None:
    """Feeds `text`; returns the start of the earliest stop string completed
    within it (in the whole text's positions), or None."""
    found = None
    for j, (s, fail) in enumerate(zip(self.stop, self.fail)):
      k, n = self.state[j], len(s)
      for i, c in enumerate(text):
        while k and c != s[k]:
          k = fail[k - 1]
        if c == s[k]:
          k += 1
        if k == n:
          start = self.length + i + 1 - n
          found = start if found is None else min(found, start)
          k = fail[k - 1]
          break  # later matches of this string start later
      self.state[j] = k
    self.length += len(text)
    return found

  def held(self) -> int:
    return max(self.state, default=0)


class _Choice:
  """One choice's text as it is released: decoded token by token, cut before
  the first stop string (which is not returned), holding back only a tail that
  could still begin one. `tokens` counts up to the one that completed a stop
  string (what usage reports)."""

  def __init__(self, tokenizer, stop: list[str]):
    self.decoder, self.stop = _Decoder(tokenizer), stop
    self.matcher = _StopMatcher(stop)
    self.text, self.sent = "", 0
    self.tokens = 0
    self.finish_reason: str | None = None
    self.first_token_time: float | None = None

  def add(self, event: Event) -> tuple[str, list]:
    """`(text released, [(token, logprob entry or None)] of the tokens counted)`."""
    counted, tokens = [], event.tokens
    lps = event.logprobs or (None,) * len(tokens)
    size = 1 if self.stop else max(len(tokens), 1)  # token by token only to find a stop
    for i in range(0, len(tokens), size):
      new = self.decoder.add(tokens[i : i + size], event.finished and i + size >= len(tokens))
      self.text += new
      self.tokens += len(tokens[i : i + size])
      counted += zip(tokens[i : i + size], lps[i : i + size])
      cut = self.matcher.feed(new) if self.stop else None
      if cut is not None:
        self.text, self.finish_reason = self.text[:cut], "stop"
        break
    if event.finished and self.finish_reason is None:
      self.text += self.decoder.add([], True)
      self.finish_reason = event.finish_reason
    if counted and self.first_token_time is None:
      self.first_token_time = time.perf_counter()
    end = len(self.text)
    if self.finish_reason is None:  # hold back a tail that may begin a stop string
      end -= self.matcher.held()
    delta, self.sent = self.text[self.sent : max(end, self.sent)], max(end, self.sent)
    return delta, counted


def _jsonable(value: Any) -> Any:
  """`value` with numpy scalars and arrays as Python numbers and lists, and
  non-finite floats as None (JSON has no NaN)."""
  if isinstance(value, dict):
    return {str(k): _jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_jsonable(v) for v in value]
  if isinstance(value, np.ndarray):
    return _jsonable(value.tolist())
  if isinstance(value, np.generic):
    value = value.item()
  if isinstance(value, float) and not math.isfinite(value):
    return None
  return value


def _finish_error(event: Event) -> APIError | None:
  """The error a request that ended without completing is answered with."""
  if event.finish_reason == "error":
    return APIError(500, f"generation failed: {event.error}")
  if event.finish_reason == "cancelled":  # by the server: it is shutting down
    return APIError(503, "the request was cancelled: the server is shutting down.")
  return None


def make_app(
  background: BackgroundEngine,
  tokenizer,
  model_name: str,
  chat_template=None,
  *,
  limits: ServerLimits = DEFAULT_LIMITS,
  api_key: str | None = None,
  allowed_hosts: tuple[str, ...] = (),
  tool_format: ToolFormat | None = None,
):
  """The FastAPI app serving `background`'s engine.

  Args:
    background: the engine, running in its thread.
    tokenizer: turns text prompts into the target's ids and ids into text
      (`encode(str) -> list[int]`, `decode(ids) -> str`).
    model_name: the name clients see (and may pass as `model`).
    chat_template: the checkpoint's `specjax.data.chat.ChatTemplate`, or None
      (then /v1/chat/completions answers 400).
    limits: the bounds on requests (`specjax.serving.limits.ServerLimits`).
    api_key: None, or the key every endpoint but /health requires as
      `Authorization: Bearer <key>` (401 otherwise).
    allowed_hosts: the Host names accepted (any port); empty: any.
    tool_format: how the model writes tool calls (`specjax.serving.tools`);
      None: the one `chat_template` shows (Hermes-style), or tools are refused.

  `app.state.compiler` is the constraint compile pool (None until the first
  constraint); `app.state.close()` kills its workers (on shutdown).
  """
  api = _Completions(background, tokenizer, model_name, chat_template, limits, tool_format)
  app = fastapi.FastAPI(title="specjax", version="1")
  app.add_exception_handler(APIError, _api_error)
  app.add_exception_handler(HTTPException, _http_error)
  app.add_exception_handler(Exception, _server_error)
  app.get("/health")(api.health)
  app.get("/metrics")(api.metrics)
  app.get("/metrics.json")(functools.partial(api.metrics, format="json"))
  app.get("/v1/models")(api.models)
  app.post("/v1/completions")(api.completions)
  app.post("/v1/chat/completions")(api.chat)
  app.add_middleware(_Guard, limits=limits, api_key=api_key, allowed_hosts=allowed_hosts)
  app.state.api = api
  app.state.close = api.close
  app.router.on_shutdown.append(api.close)
  return app


async def _api_error(_, error: APIError):
  return error.response()


async def _http_error(_, error: HTTPException):  # 404 / 405 in the same shape
  return APIError(error.status_code, str(error.detail)).response()


async def _server_error(_, error: Exception):  # a bug: still the API's shape, and logged
  logger.error("request failed", exc_info=error)
  return APIError(500, f"internal error: {type(error).__name__}").response()


# The endpoints whose body is JSON (415 for another Content-Type).
JSON_ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
OPEN_PATHS = ("/health",)  # no key needed, never refused as busy


class _Guard:
  """ASGI middleware in front of every endpoint, cheapest checks first: the Host
  allowlist (400), the API key (401, constant-time comparison), the Content-Type
  of JSON endpoints (415: a web page can post text/plain to a local server
  without a preflight), the declared body size (413) and the requests in
  flight (429 with Retry-After past `max_requests`; /health always answers)."""

  def __init__(self, app, limits: ServerLimits, api_key: str | None, allowed_hosts):
    self.app, self.limits = app, limits
    self.key = None if not api_key else f"Bearer {api_key}".encode()
    self.hosts = {h.lower() for h in allowed_hosts}
    self.in_flight = 0

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    error = self._refusal(scope)
    if error is not None:
      return await error.response()(scope, receive, send)
    if scope["path"] in OPEN_PATHS:
      return await self.app(scope, receive, send)
    self.in_flight += 1
    try:
      await self.app(scope, receive, send)
    finally:
      self.in_flight -= 1

  def _refusal(self, scope) -> APIError | None:
    headers = {k.lower(): v for k, v in scope["headers"]}
    if self.hosts:
      host = headers.get(b"host", b"").decode("latin-1").lower()
      name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
      if name.strip("[]") not in self.hosts and name not in self.hosts:
        return APIError(400, f"Host {host!r} is not served here (allowed_hosts).", "Host")
    path = scope["path"]
    if self.key is not None and path not in OPEN_PATHS:
      given = headers.get(b"authorization", b"")
      if not hmac.compare_digest(given, self.key):
        what = "a wrong key" if given else "no Authorization header"
        return APIError(
          401, f"this server needs an API key (Authorization: Bearer <key>); got {what}.",
          kind="authentication_error",
        )  # fmt: skip
    if scope["method"] == "POST" and path in JSON_ENDPOINTS:
      media = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
      if media != b"application/json":
        return APIError(
          415,
          f"the body must be Content-Type: application/json, got "
          f"{media.decode('latin-1') or 'none'!r}.",
          "Content-Type",
        )
      length = headers.get(b"content-length", b"0")
      if length.isdigit() and (len(length) > 18 or int(length) > self.limits.max_body_bytes):
        return _too_large(self.limits)
    if path not in OPEN_PATHS and self.in_flight >= self.limits.max_requests:
      return APIError(
        429,
        f"the server has {self.in_flight} requests in flight (max_requests); try again shortly.",
        retry_after=1,
      )
    return None


def _too_large(limits: ServerLimits) -> APIError:
  return APIError(413, f"the request body exceeds {limits.max_body_bytes} bytes (max_body_bytes).")


async def _read_body(http_request, limits: ServerLimits) -> bytes:
  """The body, read up to `max_body_bytes` (413 past it: a chunked body declares no length)."""
  chunks, size = [], 0
  async for chunk in http_request.stream():
    size += len(chunk)
    if size > limits.max_body_bytes:
      raise _too_large(limits)
    chunks.append(chunk)
  return b"".join(chunks)


# A token's text, at most, when the tokenizer's pieces cannot be read (specials'
# text may be longer than any piece): the prompt's bound before tokenizing.
_MAX_TOKEN_BYTES = 64


class _Completions:
  """The endpoints of one served model."""

  def __init__(
    self,
    background: BackgroundEngine,
    tokenizer,
    model_name: str,
    chat_template,
    limits,
    tool_format: ToolFormat | None = None,
  ):
    self.background, self.tokenizer, self.model_name = background, tokenizer, model_name
    self.chat_template, self.created, self.limits = chat_template, int(time.time()), limits
    self.tool_format = tool_format or ToolFormat.of(chat_template)  # None: tools refused
    config = background.engine.config
    self.settings = {
      "policy": config.policy,
      "gamma": config.gamma,
      "slots": config.slots,
      "max_prompt_len": config.max_prompt_len,
      "max_new_tokens": config.max_new_tokens,
      "vocab_size": background.engine.vocab_size,
      "logprobs": config.logprobs,
    }
    self.prometheus = Prometheus()
    try:
      self._pieces = token_bytes(tokenizer)
      longest = max((len(p) for p in self._pieces if p), default=1)
    except Exception:  # a tokenizer without readable pieces: no constraints, a loose bound
      self._pieces, longest = None, _MAX_TOKEN_BYTES
    # A prompt of more bytes than this has more tokens than the engine takes.
    self.max_prompt_bytes = config.max_prompt_len * max(longest, 1)
    self.compiler: CompilePool | None = None  # started at the first constraint

  def close(self) -> None:
    """Kills the compile workers (a compile in flight answers 503)."""
    if self.compiler is not None:
      self.compiler.close()

  def _compile_pool(self) -> CompilePool:
    if self.compiler is None:
      engine = self.background.engine
      self.compiler = CompilePool(
        self._pieces,
        np.atleast_1d(engine.eos_ids).tolist(),
        engine.vocab_size,
        self.limits,
        max_states=engine.config.constraint_states - 1,  # besides FREE
      )
    return self.compiler

  async def _constraint(self, body: _Body, http_request):
    """`(param, automaton)` of `body`'s constraint (compiled in a worker
    process), or None; APIError naming the field when it is refused."""
    asked = constraint_of(body, self.limits, self.tool_format or HERMES)
    if asked is None:
      return None
    param, constraint = asked
    engine = self.background.engine
    if not engine.config.constraint_states:
      raise APIError(
        400, f"{param}: this server takes no constraints (its constraint_states is 0).", param
      )
    if engine.eos_ids is None:
      raise APIError(400, f"{param}: this server has no EOS ids to end a constrained text.", param)
    if self._pieces is None:
      raise APIError(400, f"{param}: this server cannot read its tokenizer's pieces.", param)
    try:
      automaton = await self._compile_pool().compile(constraint, http_request.is_disconnected)
    except CompileRefused as e:
      raise APIError(e.status, f"{param}: {e.message}", param, retry_after=e.retry_after) from None
    return param, automaton

  async def health(self):
    closed = self.background.closed
    return JSONResponse(
      {
        "status": "closing" if closed else "ok",
        "model": self.model_name,
        **_jsonable(self.settings),
      },
      status_code=503 if closed else 200,
    )

  async def metrics(self, format: str = "prometheus"):
    """The Prometheus text format; `?format=json` (or /metrics.json): `Engine.metrics()`
    and the constraint compiles (`CompilePool.stats`)."""
    try:
      future = self.background.call_future(lambda e: e.metrics())
    except RuntimeError:
      raise APIError(503, "the server is shutting down.") from None
    metrics = _jsonable(await asyncio.wrap_future(future))
    if format == "json":
      compiles = self.compiler.stats() if self.compiler is not None else {"cached": 0}
      return JSONResponse({**metrics, "constraint_compiles": compiles})
    return Response(
      self.prometheus.render(metrics), media_type=prometheus_client.CONTENT_TYPE_LATEST
    )

  async def models(self):
    card = {
      "id": self.model_name,
      "object": "model",
      "created": self.created,
      "owned_by": "specjax",
    }
    return {"object": "list", "data": [card]}

  async def _encode(self, text: str, param: str, special: bool = True) -> list[int]:
    """`text`'s ids, tokenized off the event loop; its length is bounded first
    (a prompt that cannot fit is never tokenized)."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > self.max_prompt_bytes:
      limit = self.background.engine.config.max_prompt_len
      raise APIError(
        400,
        f"{param} has {size} bytes: more than the {limit} tokens this server takes "
        f"(max_prompt_len) can spell.",
        param,
      )
    batch = getattr(self.tokenizer, "encode_batch", None)
    try:
      if not special and batch is not None:
        return (await asyncio.to_thread(batch, [text], special=False))[0]
      return await asyncio.to_thread(self.tokenizer.encode, text)
    except Exception as e:
      raise APIError(400, f"{param} cannot be tokenized: {type(e).__name__}: {e}", param) from None

  async def completions(self, http_request: fastapi.Request):
    body = parse_body(await _read_body(http_request, self.limits), CompletionBody, self.limits)
    self._requests(body, [0], body.logprobs)  # the cheap checks, before tokenizing
    prompt = body.prompt
    if isinstance(prompt, str):
      prompt = await self._encode(prompt, "prompt")
    return await self._serve(http_request, body, prompt, body.logprobs)

  async def chat(self, http_request: fastapi.Request):
    body = parse_body(await _read_body(http_request, self.limits), ChatBody, self.limits)
    if self.chat_template is None:
      raise APIError(
        400,
        f"model {self.model_name!r} has no chat template (tokenizer_config.json's "
        "chat_template, chat_template.jinja): use /v1/completions.",
        "messages",
      )
    try:
      messages = template_messages(check_messages(body.messages), self.limits.max_json_depth)
    except ValueError as e:
      raise APIError(400, str(e), "messages") from None
    offer = body.offer(self.limits)
    calls = offer is not None and offer.choice != "none"
    if calls and self.tool_format is None:
      raise APIError(
        400,
        f"tools: the chat template of model {self.model_name!r} shows no tool-call format "
        'this server reads (Hermes-style <tool_call> blocks); tool_choice "none" only '
        "shows the tools.",
        "tools",
      )
    if body.top_logprobs is not None and not body.logprobs:
      raise APIError(400, "top_logprobs needs logprobs: true.", "top_logprobs")
    body.max_tokens = body.max_completion_tokens or body.max_tokens
    top = (body.top_logprobs or 0) if body.logprobs else None
    self._requests(body, [0], top)  # the cheap checks, before rendering and tokenizing
    render = functools.partial(
      self.chat_template.render,
      messages,
      add_generation_prompt=True,
      tools=None if offer is None else offer.tools,
    )
    try:
      text = await asyncio.to_thread(render)
    except Exception as e:  # the template refuses them (raise_exception), or breaks
      raise APIError(
        400, f"messages: the chat template refused them: {type(e).__name__}: {e}", "messages"
      ) from None
    # As transformers does: no special tokens added (a rendered chat carries its own BOS).
    ids = await self._encode(text, "messages", special=False)
    return await self._serve(http_request, body, ids, top, self.tool_format if calls else None)

  def _requests(self, body: _Body, prompt, logprobs: int | None, constraint=None) -> list[Request]:
    """The engine requests (one per choice) `body` asks for, with its compiled
    `constraint` `(param, automaton)`; APIError naming the field it cannot."""
    if body.model is not None and body.model != self.model_name:
      raise APIError(
        404, f"model {body.model!r} is not served here; use {self.model_name!r}.", "model"
      )
    if body.stream_options is not None and not body.stream:
      raise APIError(400, "stream_options needs stream: true.", "stream_options")
    try:
      sampling = body.sampling()
      cap = None if body.speculation is None else body.speculation.cap()
      automaton = None if constraint is None else constraint[1]
      fields = (body.max_tokens, sampling, body.stop_token_id, body.seed)
      timeout = self.limits.request_timeout_s or None
      if body.timeout is not None:  # the client's own deadline, within the server's
        timeout = body.timeout if timeout is None else min(body.timeout, timeout)
      requests = [
        Request(prompt, *fields, i, logprobs, cap, automaton, timeout) for i in range(body.n)
      ]
      self.background.engine.check(requests[0])  # pure: safe from this thread
    except ValueError as e:
      if constraint is not None and getattr(e, "field", None) == "constraint":
        raise APIError(400, f"{constraint[0]}: {e}", constraint[0]) from None
      error = field_error(e)
      if isinstance(body, ChatBody) and error.param == "logprobs":
        error.param = "top_logprobs"
      raise error from None
    return requests

  async def _serve(
    self, http_request, body: _Body, prompt, logprobs: int | None, tools: ToolFormat | None = None
  ):
    """Runs `body`'s choices and answers, streamed or whole; with `tools`, a
    chat's text is read as content and tool calls in that format."""
    self._requests(body, prompt, logprobs)  # the prompt's length, before compiling
    requests = self._requests(body, prompt, logprobs, await self._constraint(body, http_request))
    run = _Run(self.background, http_request, body.stop, self.tokenizer, self.prometheus)
    await run.start(requests)
    chat = isinstance(body, ChatBody)
    form = _Form(self.tokenizer, chat, logprobs is not None, tools)
    head = {
      "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
      "object": "chat.completion" if chat else "text_completion",
      "created": int(time.time()),
      "model": self.model_name,
    }
    if body.stream:
      usage = body.stream_options is not None and body.stream_options.include_usage
      return StreamingResponse(
        _stream(run, form, head, len(prompt) if usage else None),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
      )
    texts, counted = [""] * body.n, [[] for _ in range(body.n)]
    async for i, text, tokens in run.chunks():
      texts[i] += text
      counted[i] += tokens
    if run.disconnected:
      return JSONResponse({}, status_code=499)  # nobody reads it
    choices = [
      form.choice(i, texts[i], c.finish_reason, counted[i], whole=True)
      for i, c in enumerate(run.choices)
    ]
    await run.settle()
    return {**head, "choices": choices, "usage": run.usage(len(prompt))}


class _Form:
  """One endpoint's JSON shapes: a choice (whole or a streamed chunk) and its
  logprobs; with `tools`, a chat's text split into content and `tool_calls`
  (one `ToolCallParser` per choice)."""

  def __init__(self, tokenizer, chat: bool, logprobs: bool, tools: ToolFormat | None = None):
    self.tokenizer, self.chat, self.logprobs = tokenizer, chat, logprobs
    self.tools, self.parsers = tools, {}

  def choice(self, index, text, finish_reason, counted, whole=False, first=False) -> dict:
    out = {"index": index}
    if not self.chat:
      out["text"] = text
    elif self.tools is None:
      message = {"role": "assistant", "content": text} if whole or first else {"content": text}
      out["message" if whole else "delta"] = message
    else:
      parser = self.parsers.setdefault(index, ToolCallParser(self.tools))
      content, calls = parser.feed(text, final=finish_reason is not None)
      message = {"role": "assistant"} if whole or first else {}
      if whole:
        message["content"] = content or None
        if parser.calls:
          message["tool_calls"] = parser.calls
      else:
        message["content"] = content if content or not calls else None
        if calls:
          message["tool_calls"] = calls
      out["message" if whole else "delta"] = message
      if finish_reason == "stop" and parser.finished_calls:
        finish_reason = "tool_calls"
    out["logprobs"] = self._logprobs(counted) if self.logprobs else None
    out["finish_reason"] = finish_reason
    return out

  def _logprobs(self, counted) -> dict:
    """OpenAI's shapes: chat `{"content": [{token, logprob, bytes, top_logprobs}]}`,
    completions (legacy) `{tokens, token_logprobs, top_logprobs, text_offset}`."""
    word = lambda t: self.tokenizer.decode([t])
    entries = [(word(t), lp, [(word(a), b) for a, b in top]) for t, (lp, top) in counted]
    if self.chat:
      item = lambda w, lp: {"token": w, "logprob": lp, "bytes": list(w.encode())}
      return {
        "content": [
          {**item(w, lp), "top_logprobs": [item(*a) for a in top]} for w, lp, top in entries
        ]
      }
    words = [w for w, *_ in entries]
    return {
      "tokens": words,
      "token_logprobs": [lp for _, lp, _ in entries],
      "top_logprobs": [dict(top[::-1]) for *_, top in entries],  # same text: the likelier
      "text_offset": np.cumsum([0] + [len(w) for w in words])[:-1].tolist(),
    }


class _Run:
  """One HTTP request's choices in the engine (`_Choice` each): their text as it
  comes. A choice is closed once answered (a stop string stops its engine row);
  whatever still runs when the answer ends, or the client leaves, is cancelled."""

  def __init__(self, background, http_request, stop, tokenizer, prometheus: Prometheus):
    self.background, self.http_request, self.prometheus = background, http_request, prometheus
    self.stop, self.tokenizer = stop, tokenizer
    self.queue: asyncio.Queue = asyncio.Queue()
    self.ids: dict[int, int] = {}  # open choice -> engine request id
    self.disconnected, self.watcher = False, None
    self.start_time = time.perf_counter()
    zeros = (0,) * background.engine.config.gamma  # one entry per draft position
    self.no_counts = SpeculationCounts(drafted_at_position=zeros, accepted_at_position=zeros)

  async def start(self, requests: list[Request]) -> None:
    loop = asyncio.get_running_loop()
    self.choices = [_Choice(self.tokenizer, self.stop) for _ in requests]
    # Each choice's speculation figures, from its engine request's finished event.
    self.counts = [self.no_counts] * len(requests)
    self.running = set(range(len(requests)))  # choices whose engine request has not finished

    def on_event(i: int, event: Event) -> None:  # engine thread -> this event loop
      with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is listening
        loop.call_soon_threadsafe(self.queue.put_nowait, (i, event))

    try:
      for i, request in enumerate(requests):
        self.ids[i] = await _submit(self.background, request, functools.partial(on_event, i))
    except BaseException:
      self.close()
      raise
    self.watcher = asyncio.create_task(self._watch())

  async def chunks(self):
    """`(choice, text, [(token, logprob entry)])` as events add to the choices;
    APIError for a choice that failed."""
    try:
      while self.ids:
        item = await self.queue.get()
        if item is _DISCONNECTED:
          self.disconnected = True
          return
        i, event = item
        if event.finished:
          self._finished(i, event)
        if i not in self.ids:
          continue
        if event.finish_reason == "timeout":  # its text so far is its answer
          if not self.choices[i].tokens and not event.tokens:
            raise APIError(
              429, "the request waited past request_timeout_s for a slot.", retry_after=1
            )
          event = dataclasses.replace(event, finish_reason="length")
        error = _finish_error(event) if event.finished else None
        if error is not None:
          raise error
        choice = self.choices[i]
        text, counted = choice.add(event)
        if choice.finish_reason is not None:
          del self.ids[i]
          self.background.cancel(event.request_id, "stop")  # a stop string (else a no-op)
          self.prometheus.observe(self.start_time, choice)
        if text or counted or choice.finish_reason:
          yield i, text, counted
    finally:
      self.close()

  def close(self) -> None:
    if self.watcher is not None:
      self.watcher.cancel()
    for rid in self.ids.values():
      self.background.cancel(rid)
    self.ids.clear()

  def _finished(self, i: int, event: Event) -> None:
    self.running.discard(i)
    if event.speculation is not None:
      self.counts[i] = event.speculation

  async def settle(self, timeout_s: float = 10.0) -> None:
    """Waits for the finished events of the choices answered before their engine
    request ended (a stop string stops its row at the engine's next step), so that
    usage counts every step their rows took part in, as the engine's counters do."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while self.running:
      try:
        item = await asyncio.wait_for(self.queue.get(), max(deadline - loop.time(), 0))
      except asyncio.TimeoutError:
        logger.warning("no finished event for choices %s; their usage counts 0", self.running)
        return
      if item is not _DISCONNECTED and item[1].finished:
        self._finished(*item)

  def usage(self, prompt: int) -> dict:
    """OpenAI's usage, and `speculation`: the choices' drafted and accepted tokens
    summed (with n > 1 each choice's own under `choices`); docs/serving.md."""
    n = sum(c.tokens for c in self.choices)
    total = functools.reduce(lambda a, b: a + b, self.counts)
    speculation = total.as_dict()
    if len(self.counts) > 1:
      speculation["choices"] = [{"index": i, **c.as_dict()} for i, c in enumerate(self.counts)]
    return {
      "prompt_tokens": prompt,
      "completion_tokens": n,
      "total_tokens": prompt + n,
      "speculation": speculation,
    }

  async def _watch(self) -> None:
    """Wakes the reader once the client has gone."""
    while not await self.http_request.is_disconnected():
      await asyncio.sleep(_DISCONNECT_POLL_S)
    self.queue.put_nowait(_DISCONNECTED)


async def _submit(background: BackgroundEngine, request: Request, on_event) -> int:
  """`background.submit` without blocking the event loop; a refused request
  becomes a 400 naming the field."""
  try:
    future = background.submit_future(request, on_event)
  except RuntimeError:
    raise APIError(503, "the server is shutting down.") from None
  try:
    return await asyncio.wrap_future(future)
  except QueueFull as e:
    raise APIError(429, str(e), retry_after=1) from None
  except ValueError as e:
    raise field_error(e) from None
  except RuntimeError:
    raise APIError(503, "the server is shutting down.") from None
  except asyncio.CancelledError:
    # Cancelling the wrapper cancels the submission unless the engine thread
    # has begun it; then cancel the request once it has an id.
    def cancel_submitted(f) -> None:
      if not f.cancelled() and f.exception() is None:
        background.cancel(f.result())

    future.add_done_callback(cancel_submitted)
    raise


def _sse(data: Any) -> str:
  return f"data: {json.dumps(data)}\n\n"


async def _stream(run: _Run, form: _Form, head: dict, prompt_tokens: int | None):
  """The server-sent events of one request: a chunk per event that adds text or
  logprobs (a choice's last with its finish_reason), then the usage
  (`prompt_tokens` not None) and [DONE]."""
  head = {**head, "object": head["object"] + (".chunk" if form.chat else "")}
  started = set()
  try:
    async for i, text, counted in run.chunks():
      reason = run.choices[i].finish_reason
      chunk = form.choice(i, text, reason, counted, first=i not in started)
      started.add(i)
      yield _sse({**head, "choices": [chunk]})
  except APIError as error:
    yield _sse(error.body())
    return
  except Exception as error:  # a bug: the stream still ends with an error event
    logger.exception("stream failed")
    yield _sse(APIError(500, f"internal error: {type(error).__name__}").body())
    return
  if run.disconnected:
    return
  if prompt_tokens is not None:
    await run.settle()
    yield _sse({**head, "choices": [], "usage": run.usage(prompt_tokens)})
  yield "data: [DONE]\n\n"


class Prometheus:
  """/metrics in the Prometheus text format: the engine's figures (`Engine.metrics()`,
  read at each scrape) and the choices' TTFT / TPOT histograms, as the server saw them."""

  def __init__(self):
    self.registry, self.snapshot = prometheus_client.CollectorRegistry(), {}
    self.registry.register(self)
    self.ttft, self.tpot = (
      prometheus_client.Histogram(f"specjax_{name}_seconds", doc, registry=self.registry)
      for name, doc in (
        ("time_to_first_token", "Request arrival to a choice's first token."),
        ("time_per_output_token", "A choice's time per token after the first."),
      )
    )

  def observe(self, start: float, choice: _Choice) -> None:
    if choice.first_token_time is not None:
      self.ttft.observe(choice.first_token_time - start)
      if choice.tokens > 1:
        self.tpot.observe((time.perf_counter() - choice.first_token_time) / (choice.tokens - 1))

  def render(self, snapshot: dict) -> bytes:
    self.snapshot = snapshot
    return prometheus_client.generate_latest(self.registry)

  def collect(self):
    m = self.snapshot
    if not m:
      return
    requests = CounterMetricFamily("specjax_requests", "Requests by outcome.", labels=["outcome"])
    for outcome in ("submitted", "completed", "cancelled", "failed"):
      requests.add_metric([outcome], m["requests"][outcome])
    steps = CounterMetricFamily(
      "specjax_steps", "Engine steps by draft length (0: plain).", labels=["draft_length"]
    )
    for gamma, count in m["steps"].items():
      steps.add_metric([gamma], count)
    yield from (requests, steps)
    yield CounterMetricFamily("specjax_generated_tokens", "Tokens generated.", m["tokens"])
    spec = m["speculation"]  # what the requests' usage.speculation figures add up to
    for kind, doc in (
      ("drafted", "Drafted tokens offered to the verifier"),
      ("accepted", "Drafted tokens accepted"),
    ):
      yield CounterMetricFamily(f"specjax_{kind}_tokens", f"{doc}.", spec[kind])
      by_position = CounterMetricFamily(
        f"specjax_{kind}_tokens_by_position",
        f"{doc}, by draft position (1: the first drafted token).",
        labels=["position"],
      )
      for i, count in enumerate(spec[f"{kind}_at_position"]):
        by_position.add_metric([str(i + 1)], count)
      yield by_position
    yield CounterMetricFamily(
      "specjax_forced_tokens", "Tokens drafted because a constraint forced them.", spec["forced"]
    )
    for name, doc, value in (
      ("requests_running", "Requests holding a slot.", m["requests"]["live"]),
      ("queue_depth", "Requests waiting for a slot.", m["requests"]["queued"]),
      ("acceptance_rate", "Accepted / evaluated drafted tokens.", m["acceptance_rate"]),
      ("draft_length", "The adaptive policy's draft length in use.", m["policy"]["gamma"]),
    ):
      yield GaugeMetricFamily(f"specjax_{name}", doc, math.nan if value is None else value)
