"""An OpenAI-style API over a `BackgroundEngine` (FastAPI).

  app = make_app(BackgroundEngine(engine), tokenizer, "specjax-stdlib", chat_template)
  uvicorn.run(app)              # specjax/jobs/serve.py does this, with shutdown

  POST /v1/completions       {"prompt": "def f(x):\\n", "max_tokens": 32, "stream": true}
  POST /v1/chat/completions  {"messages": [{"role": "user", "content": "hi"}]}
  GET  /v1/models            the served model
  GET  /health               {"status": "ok", "model": ..., engine settings}
  GET  /metrics              Prometheus text format (/metrics.json: `Engine.metrics()`)

One module per concept (after vLLM's `entrypoints/openai`), in the order a
request meets them:

  guard         the middleware: Host, API key, Content-Type, body size and deadline,
                requests in flight
  bodies        the request bodies (pydantic models)
  fields        parsing a body and checking its fields: 400s naming the field
  structured    the constraint a request asks for, bounded before compiling
  tools         `tools` / `tool_choice` checked, the calls they allow
  tool_parsers/ tool-call formats and their parsers (tagged JSON; hermes)
  model         one served model: the path every generation request takes
  completions   POST /v1/completions
  chat          POST /v1/chat/completions
  run           a request's choices in the engine
  text          detokenising and stop strings
  choices       a choice's JSON, whole or a chunk; logprobs; tool calls read back
  streaming     server-sent events
  metrics       /metrics (Prometheus) and /metrics.json
  errors        `APIError` and the app's error handlers
  app           `make_app`

Every invalid request gets status 400 (404 for another model) and `{"error":
{"message", "type": "invalid_request_error", "param"}}`, the message naming the
field and its allowed range; the ranges are the library's own (a `FieldError`
carries the library's name of the field, `fields.API_NAMES` gives this API's).
The server's own bounds (`specjax.serving.limits.ServerLimits`) answer in the
same shape: 408 for a body not sent in time, 413 for one too large, 415 for a
Content-Type other than JSON, 429 (with Retry-After) past a queue or
concurrency cap, 401 without the API key when one is set; docs/serving.md,
"Limits and security".

Streaming sends one server-sent event per engine event that adds text, then
`data: [DONE]`. A client that disconnects has its request cancelled in the
engine, freeing its slot. Every `usage` carries `speculation`: the request's
drafted and accepted tokens, by draft position, and forced ones, which summed
over requests equal /metrics' counters (docs/serving.md). `user` (OpenAI's
end-user identifier) is checked and otherwise ignored.

Structured output, in both endpoints: `response_format` ({"type": "json_object"}
or {"type": "json_schema", "json_schema": {"name", "schema"}}) and the
extensions `guided_regex` and `guided_choice` (vLLM's names). Each is compiled
once against the tokenizer, in a worker process the server can stop
(`specjax.serving.compiler`; cached), after the request's cheap checks, and
every token of the request, drafted or sampled, is drawn among what it allows;
the engine needs a constraint table (`EngineConfig.constraint_states`) and EOS
ids. Tool calls, in chat: the tools go to the chat template, the calls are a
constraint (`specjax.grammar.ToolCalls`) like the others, and the text is read
back as `message.tool_calls` (streamed: `delta.tool_calls`).
"""

try:
  import fastapi  # noqa: F401
  import prometheus_client  # noqa: F401
  import pydantic  # noqa: F401
except ImportError as e:
  raise ImportError(
    "the HTTP server needs FastAPI and prometheus_client: pip install 'specjax[serve]'"
  ) from e

from specjax.serving.http.app import make_app
from specjax.serving.http.bodies import ChatBody, CompletionBody, RequestBody
from specjax.serving.http.errors import APIError
from specjax.serving.http.fields import API_NAMES, field_error, parse_body
from specjax.serving.http.guard import Guard
from specjax.serving.http.metrics import Prometheus
from specjax.serving.http.model import ServedModel
from specjax.serving.http.structured import constraint_of
from specjax.serving.http.text import ChoiceText, Decoder, StopMatcher

__all__ = [
  "API_NAMES",
  "APIError",
  "ChatBody",
  "ChoiceText",
  "CompletionBody",
  "Decoder",
  "Guard",
  "Prometheus",
  "RequestBody",
  "ServedModel",
  "StopMatcher",
  "constraint_of",
  "field_error",
  "make_app",
  "parse_body",
]
