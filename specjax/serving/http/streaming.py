"""Server-sent events: a request's answer as it is generated, one event per
engine event that adds text, then the usage (when asked for) and `[DONE]`; a
failure mid-stream ends it with an error event in the API's shape."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi.responses import StreamingResponse

from specjax.serving.http.choices import ChoiceForm
from specjax.serving.http.errors import APIError
from specjax.serving.http.run import Run

logger = logging.getLogger(__name__)

HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: Any) -> str:
  return f"data: {json.dumps(data)}\n\n"


async def stream(run: Run, form: ChoiceForm, head: dict, prompt_tokens: int | None):
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
      yield sse({**head, "choices": [chunk]})
  except APIError as error:
    yield sse(error.body())
    return
  except Exception as error:  # a bug: the stream still ends with an error event
    logger.exception("stream failed")
    yield sse(APIError(500, f"internal error: {type(error).__name__}").body())
    return
  if run.disconnected:
    return
  if prompt_tokens is not None:
    await run.settle()
    yield sse({**head, "choices": [], "usage": run.usage(prompt_tokens)})
  yield "data: [DONE]\n\n"


def response(run: Run, form: ChoiceForm, head: dict, prompt_tokens: int | None):
  """The streamed answer of `run` (`stream`'s events)."""
  events = stream(run, form, head, prompt_tokens)
  return StreamingResponse(events, media_type="text/event-stream", headers=HEADERS)
