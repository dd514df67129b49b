"""POST /v1/chat/completions: messages rendered by the checkpoint's chat template
(with the request's tools, if any) and continued; with tools, the answer's text
read back as content and tool calls."""

from __future__ import annotations

import asyncio
import functools

import fastapi

from specjax.data.chat import check_messages
from specjax.serving.http.bodies import ChatBody
from specjax.serving.http.errors import APIError
from specjax.serving.http.fields import parse_body
from specjax.serving.http.model import ServedModel
from specjax.serving.http.tools import ToolOffer, template_messages


async def chat(model: ServedModel, http_request: fastapi.Request):
  """The assistant's answer to the body's messages, whole or streamed."""
  body = parse_body(await http_request.body(), ChatBody, model.limits)
  if model.chat_template is None:
    raise APIError(
      400,
      f"model {model.model_name!r} has no chat template (tokenizer_config.json's "
      "chat_template, chat_template.jinja): use /v1/completions.",
      "messages",
    )
  try:
    messages = template_messages(check_messages(body.messages), model.limits.max_json_depth)
  except ValueError as e:
    raise APIError(400, str(e), "messages") from None
  offer = body.offer(model.limits)
  calls = _calls(model, offer)
  if body.top_logprobs is not None and not body.logprobs:
    raise APIError(400, "top_logprobs needs logprobs: true.", "top_logprobs")
  body.max_tokens = body.max_completion_tokens or body.max_tokens
  top = (body.top_logprobs or 0) if body.logprobs else None
  model.requests(body, [0], top)  # the cheap checks, before rendering and tokenizing
  text = await _render(model, messages, offer)
  # As transformers does: no special tokens added (a rendered chat carries its own BOS).
  ids = await model.encode(text, "messages", special=False)
  return await model.serve(http_request, body, ids, top, model.tool_format if calls else None)


def _calls(model: ServedModel, offer: ToolOffer | None) -> bool:
  """Whether the model may call the offered tools (APIError: it writes no format we read)."""
  calls = offer is not None and offer.choice != "none"
  if calls and model.tool_format is None:
    raise APIError(
      400,
      f"tools: the chat template of model {model.model_name!r} shows no tool-call format "
      'this server reads (Hermes-style <tool_call> blocks); tool_choice "none" only '
      "shows the tools.",
      "tools",
    )
  return calls


async def _render(model: ServedModel, messages: list[dict], offer: ToolOffer | None) -> str:
  """The prompt's text: the chat template rendered off the event loop."""
  render = functools.partial(
    model.chat_template.render,
    messages,
    add_generation_prompt=True,
    tools=None if offer is None else offer.tools,
  )
  try:
    return await asyncio.to_thread(render)
  except Exception as e:  # the template refuses them (raise_exception), or breaks
    raise APIError(
      400, f"messages: the chat template refused them: {type(e).__name__}: {e}", "messages"
    ) from None
