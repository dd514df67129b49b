"""An OpenAI-style completions API over a `BackgroundEngine` (FastAPI).

  app = make_app(BackgroundEngine(engine), tokenizer, model_name="specjax-stdlib")
  uvicorn.run(app)              # specjax/jobs/serve.py does this, with shutdown

  POST /v1/completions   {"prompt": "def f(x):\\n", "max_tokens": 32, "stream": true}
  GET  /health           {"status": "ok", "model": ..., engine settings}
  GET  /metrics          the engine's counters (`Engine.metrics()`)

Request fields: `model` (optional; must name the served model), `prompt` (text,
or a list of token ids), `max_tokens` (default 16), `temperature` (default 1),
`top_p` (default 1), `top_k` (an extension, default 0: off), `stream` (default
false), `stream_options` ({"include_usage": bool}, with `stream`) and
`stop_token_id` (an extension: stop after this id). Any other field is refused
rather than ignored. Every invalid request gets status 400 (404 for another
model) and `{"error": {"message", "type": "invalid_request_error", "param"}}`,
the message naming the field and its allowed range; the ranges are the engine's
own (`Engine.submit`'s messages, with its field names changed to these).

Streaming sends one server-sent event per engine event that adds text, then
`data: [DONE]`. A client that disconnects has its request cancelled in the
engine, freeing its slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import time
import uuid
from typing import Any

import numpy as np

try:
  import fastapi
  import pydantic
  from fastapi.responses import JSONResponse, StreamingResponse
  from starlette.exceptions import HTTPException
except ImportError as e:
  raise ImportError("the HTTP server needs FastAPI: pip install 'specjax[serve]'") from e

from specjax.sampling import SamplingParams
from specjax.serving.background import BackgroundEngine
from specjax.serving.request import Event, Request

# The engine's field names (in its ValueError messages) -> this API's names.
ENGINE_FIELDS = {
  "sampling.temperature": "temperature",
  "sampling.top_k": "top_k",
  "sampling.top_p": "top_p",
  "max_new_tokens": "max_tokens",
  "stop_id": "stop_token_id",
  "prompt": "prompt",
  # SamplingParams' own messages name the bare fields.
  "temperature": "temperature",
  "top_k": "top_k",
  "top_p": "top_p",
}
# Longest first, so "sampling.top_k" wins over "top_k".
_FIELD_PATTERN = re.compile(
  r"(?<![\w.])(" + "|".join(re.escape(f) for f in sorted(ENGINE_FIELDS, key=len)[::-1]) + r")\b"
)
# How often a request's handler checks that its client is still connected.
_DISCONNECT_POLL_S = 0.25
_DISCONNECTED = object()  # queued by the disconnect watcher


class StreamOptions(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(extra="forbid", strict=True)
  include_usage: bool = False


class CompletionBody(pydantic.BaseModel):
  """The accepted JSON body of POST /v1/completions (ranges are checked by the engine)."""

  # strict: no "16" for 16 or 1 for true; floats accept integers.
  model_config = pydantic.ConfigDict(extra="forbid", strict=True)
  model: str | None = None
  prompt: str | list[int]
  max_tokens: int = 16
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  stream: bool = False
  stream_options: StreamOptions | None = None
  stop_token_id: int | None = None


class APIError(Exception):
  """An error answered as `{"error": {"message", "type", "param"}}`."""

  def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None):
    super().__init__(message)
    self.status, self.message, self.param = status, message, param
    self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

  def response(self) -> JSONResponse:
    return JSONResponse(self.body(), status_code=self.status)

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.kind, "param": self.param}}


def engine_error(error: ValueError) -> APIError:
  """A 400 from the engine's (or SamplingParams') ValueError: the field it names
  first becomes `param`, and every engine field name in the message becomes
  this API's name (max_new_tokens -> max_tokens, ...)."""
  message = str(error)
  first = _FIELD_PATTERN.search(message)
  param = ENGINE_FIELDS[first.group(1)] if first else None
  return APIError(400, _FIELD_PATTERN.sub(lambda m: ENGINE_FIELDS[m.group(1)], message), param)


def parse_body(raw: bytes) -> CompletionBody:
  """The validated body; raises APIError (400) naming the offending field."""
  try:
    data = json.loads(raw)
  except (ValueError, UnicodeDecodeError) as e:
    raise APIError(400, f"the request body is not valid JSON: {e}") from None
  if not isinstance(data, dict):
    raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}.")
  try:
    return CompletionBody.model_validate(data)
  except pydantic.ValidationError as e:
    error = e.errors()[0]
    field = ".".join(str(p) for p in error["loc"]) if error["loc"] else None
    param = str(error["loc"][0]) if error["loc"] else None
    if param == "prompt" and error["type"] != "missing":  # which union member is noise
      message = (
        f"prompt must be a string or a list of integer token ids, got {_short(data['prompt'])}."
      )
    elif error["type"] == "extra_forbidden":
      model = StreamOptions if error["loc"][0] == "stream_options" else CompletionBody
      allowed = ", ".join(model.model_fields)
      message = f"{field} is not a supported field; the supported fields are {allowed}."
    elif error["type"] == "missing":
      message = f"{field} is required."
    else:
      message = f"{field}: {error['msg']}, got {_short(error.get('input'))}."
    raise APIError(400, message, param) from None


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


def make_app(background: BackgroundEngine, tokenizer, model_name: str):
  """The FastAPI app serving `background`'s engine.

  Args:
    background: the engine, running in its thread.
    tokenizer: turns text prompts into the target's ids and ids into text
      (`encode(str) -> list[int]`, `decode(ids) -> str`).
    model_name: the name clients see (and may pass as `model`).
  """
  api = _Completions(background, tokenizer, model_name)
  app = fastapi.FastAPI(title="specjax", version="1")
  app.add_exception_handler(APIError, _api_error)
  app.add_exception_handler(HTTPException, _http_error)
  app.get("/health")(api.health)
  app.get("/metrics")(api.metrics)
  app.post("/v1/completions")(api.completions)
  return app


async def _api_error(_, error: APIError):
  return error.response()


async def _http_error(_, error: HTTPException):  # 404 / 405 in the same shape
  return APIError(error.status_code, str(error.detail)).response()


class _Completions:
  """The endpoints of one served model."""

  def __init__(self, background: BackgroundEngine, tokenizer, model_name: str):
    self.background, self.tokenizer, self.model_name = background, tokenizer, model_name
    config = background.engine.config
    self.settings = {
      "policy": config.policy,
      "gamma": config.gamma,
      "slots": config.slots,
      "max_prompt_len": config.max_prompt_len,
      "max_new_tokens": config.max_new_tokens,
      "vocab_size": background.engine.vocab_size,
    }

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

  async def metrics(self):
    try:
      future = self.background.call_future(lambda e: e.metrics())
    except RuntimeError:
      raise APIError(503, "the server is shutting down.") from None
    return JSONResponse(_jsonable(await asyncio.wrap_future(future)))

  async def completions(self, http_request: fastapi.Request):
    body = parse_body(await http_request.body())
    request = self._request(body)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def on_event(event: Event) -> None:  # engine thread -> this event loop
      with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is listening
        loop.call_soon_threadsafe(events.put_nowait, event)

    rid = await _submit(self.background, request, on_event)
    head = {
      "id": f"cmpl-{uuid.uuid4().hex}",
      "object": "text_completion",
      "created": int(time.time()),
      "model": self.model_name,
    }
    watcher = asyncio.create_task(_watch_disconnect(http_request, self.background, rid, events))
    prompt_tokens = len(request.prompt)
    if body.stream:
      include_usage = body.stream_options is not None and body.stream_options.include_usage
      return StreamingResponse(
        _stream(
          self.background, self.tokenizer, rid, events, watcher, head, prompt_tokens, include_usage
        ),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
      )
    return await self._whole(rid, events, watcher, head, prompt_tokens)

  def _request(self, body: CompletionBody) -> Request:
    """The engine request `body` asks for; APIError naming the field it cannot."""
    if body.model is not None and body.model != self.model_name:
      raise APIError(
        404, f"model {body.model!r} is not served here; use {self.model_name!r}.", "model"
      )
    if body.stream_options is not None and not body.stream:
      raise APIError(400, "stream_options needs stream: true.", "stream_options")
    prompt = self.tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else body.prompt
    try:
      sampling = SamplingParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p)
      return Request(
        prompt=prompt, max_new_tokens=body.max_tokens, sampling=sampling, stop_id=body.stop_token_id
      )
    except ValueError as e:
      raise engine_error(e) from None

  async def _whole(self, rid: int, events, watcher, head: dict, prompt_tokens: int):
    """The non-streamed answer: waits for the request's last event."""
    finished = False
    try:
      tokens: list[int] = []
      while True:
        event = await events.get()
        if event is _DISCONNECTED:
          return JSONResponse({}, status_code=499)  # nobody reads it
        tokens.extend(event.tokens)
        if event.finished:
          finished = True
          break
    finally:
      watcher.cancel()
      if not finished:
        self.background.cancel(rid)
    error = _finish_error(event)
    if error is not None:
      raise error
    choice = {
      "index": 0,
      "text": self.tokenizer.decode(tokens),
      "finish_reason": event.finish_reason,
      "logprobs": None,
    }
    return {**head, "choices": [choice], "usage": _usage(prompt_tokens, len(tokens))}


async def _submit(background: BackgroundEngine, request: Request, on_event) -> int:
  """`background.submit` without blocking the event loop; a refused request
  becomes a 400 naming the field."""
  try:
    future = background.submit_future(request, on_event)
  except RuntimeError:
    raise APIError(503, "the server is shutting down.") from None
  try:
    return await asyncio.wrap_future(future)
  except ValueError as e:
    raise engine_error(e) from None
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


async def _watch_disconnect(http_request, background: BackgroundEngine, rid: int, events):
  """Cancels `rid` in the engine once the client has gone, and wakes the reader."""
  while not await http_request.is_disconnected():
    await asyncio.sleep(_DISCONNECT_POLL_S)
  background.cancel(rid)
  events.put_nowait(_DISCONNECTED)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
  return {
    "prompt_tokens": prompt_tokens,
    "completion_tokens": completion_tokens,
    "total_tokens": prompt_tokens + completion_tokens,
  }


def _sse(data: Any) -> str:
  return f"data: {json.dumps(data)}\n\n"


async def _stream(background, tokenizer, rid, events, watcher, head, prompt_tokens, include_usage):
  """The server-sent events of one request: a chunk per event with new text
  (the last one with its finish_reason), then [DONE]."""
  decoder = _Decoder(tokenizer)
  finished = False
  try:
    while not finished:
      event = await events.get()
      if event is _DISCONNECTED:
        return
      finished = event.finished
      error = _finish_error(event) if finished else None
      if error is not None:
        yield _sse(error.body())
        break
      text = decoder.add(event.tokens, final=finished)
      if text or finished:
        choice = {
          "index": 0,
          "text": text,
          "finish_reason": event.finish_reason if finished else None,
          "logprobs": None,
        }
        yield _sse({**head, "choices": [choice]})
    if include_usage:
      yield _sse({**head, "choices": [], "usage": _usage(prompt_tokens, len(decoder.ids))})
    yield "data: [DONE]\n\n"
  finally:
    watcher.cancel()
    if not finished:  # the client went away (or the stream was closed early)
      background.cancel(rid)
