"""The FastAPI app: the served model's endpoints behind the guard, every error
in the API's shape."""

from __future__ import annotations

import functools

import fastapi
from starlette.exceptions import HTTPException

from specjax.serving.background import BackgroundEngine
from specjax.serving.http import errors
from specjax.serving.http.bodies import DEFAULT_LIMITS
from specjax.serving.http.chat import chat
from specjax.serving.http.completions import completions
from specjax.serving.http.guard import Guard
from specjax.serving.http.model import ServedModel
from specjax.serving.http.tool_parsers import ToolFormat
from specjax.serving.limits import ServerLimits


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
    allowed_hosts: the Host names accepted (any port); empty: the local names
      (localhost, 127.0.0.1, ::1) on a connection to a loopback address, any
      other Host elsewhere; "*": any (`specjax.serving.http.guard`).
    tool_format: how the model writes tool calls (`specjax.serving.http.tool_parsers`);
      None: the one `chat_template` shows (Hermes-style), or tools are refused.

  `app.state.compiler` is the constraint compile pool (None until the first
  constraint); `app.state.close()` kills its workers (on shutdown).
  """
  model = ServedModel(background, tokenizer, model_name, chat_template, limits, tool_format)
  app = fastapi.FastAPI(title="specjax", version="1")
  app.add_exception_handler(errors.APIError, errors.api_error)
  app.add_exception_handler(HTTPException, errors.http_error)
  app.add_exception_handler(Exception, errors.server_error)
  app.get("/health")(model.health)
  app.get("/metrics")(model.metrics)
  app.get("/metrics.json")(functools.partial(model.metrics, format="json"))
  app.get("/v1/models")(model.models)

  @app.post("/v1/completions")
  async def _completions(http_request: fastapi.Request):
    return await completions(model, http_request)

  @app.post("/v1/chat/completions")
  async def _chat(http_request: fastapi.Request):
    return await chat(model, http_request)

  app.add_middleware(Guard, limits=limits, api_key=api_key, allowed_hosts=allowed_hosts)
  app.state.api = model
  app.state.close = model.close
  app.router.on_shutdown.append(model.close)
  return app
