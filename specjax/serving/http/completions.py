"""POST /v1/completions: a prompt (text, or token ids) continued."""

from __future__ import annotations

import fastapi

from specjax.serving.http.bodies import CompletionBody
from specjax.serving.http.fields import parse_body
from specjax.serving.http.model import ServedModel


async def completions(model: ServedModel, http_request: fastapi.Request):
  """The completion of the body's prompt, whole or streamed (`ServedModel.serve`)."""
  body = parse_body(await http_request.body(), CompletionBody, model.limits)
  model.requests(body, [0], body.logprobs)  # the cheap checks, before tokenizing
  prompt = body.prompt
  if isinstance(prompt, str):
    prompt = await model.encode(prompt, "prompt")
  return await model.serve(http_request, body, prompt, body.logprobs)
