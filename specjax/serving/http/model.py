"""One served model: its engine, tokenizer, limits and constraint compiles, and
the path every generation request takes through them (the body's cheap checks,
tokenizing off the event loop, the constraint compiled in a worker, one engine
request per choice, the answer whole or streamed). The endpoints that differ
are `completions` and `chat`."""

from __future__ import annotations

import asyncio
import time
import uuid

import numpy as np
from fastapi.responses import JSONResponse

from specjax.serving import compiler as compiler_lib
from specjax.serving.background import BackgroundEngine
from specjax.serving.http import streaming
from specjax.serving.http.bodies import ChatBody, RequestBody
from specjax.serving.http.choices import ChoiceForm
from specjax.serving.http.errors import APIError
from specjax.serving.http.fields import field_error
from specjax.serving.http.metrics import Prometheus, jsonable, scrape
from specjax.serving.http.run import Run
from specjax.serving.http.structured import constraint_of
from specjax.serving.http.tool_parsers import HERMES, ToolFormat
from specjax.serving.limits import ServerLimits
from specjax.serving.request import Request
from specjax.validation import FieldError
from specjax.vocab_map import token_bytes

# A token's text, at most, when the tokenizer's pieces cannot be read (specials'
# text may be longer than any piece): the prompt's bound before tokenizing.
_MAX_TOKEN_BYTES = 64


class ServedModel:
  """The state the endpoints of one served model share, and their common path."""

  def __init__(
    self,
    background: BackgroundEngine,
    tokenizer,
    model_name: str,
    chat_template,
    limits: ServerLimits,
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
    self.compiler: compiler_lib.CompilePool | None = None  # started at the first constraint

  def close(self) -> None:
    """Kills the compile workers (a compile in flight answers 503)."""
    if self.compiler is not None:
      self.compiler.close()

  async def health(self):
    closed = self.background.closed
    return JSONResponse(
      {
        "status": "closing" if closed else "ok",
        "model": self.model_name,
        **jsonable(self.settings),
      },
      status_code=503 if closed else 200,
    )

  async def models(self):
    card = {
      "id": self.model_name,
      "object": "model",
      "created": self.created,
      "owned_by": "specjax",
    }
    return {"object": "list", "data": [card]}

  async def metrics(self, format: str = "prometheus"):
    """The Prometheus text format; `?format=json` (or /metrics.json): `Engine.metrics()`
    and the constraint compiles (`CompilePool.stats`)."""
    return await scrape(self.background, self.prometheus, self.compiler, format)

  async def encode(self, text: str, param: str, special: bool = True) -> list[int]:
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

  def requests(self, body: RequestBody, prompt, logprobs: int | None, constraint=None):
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
      if constraint is not None and isinstance(e, FieldError) and e.field == "constraint":
        param = constraint[0]  # the field that asked for it: response_format, guided_regex...
        raise APIError(400, f"{param}: {e}", param) from None
      error = field_error(e)
      if isinstance(body, ChatBody) and error.param == "logprobs":
        error.param = "top_logprobs"
      raise error from None
    return requests

  async def serve(self, http_request, body: RequestBody, prompt, logprobs, tools=None):
    """Runs `body`'s choices and answers, streamed or whole; with `tools` (a
    `ToolFormat`), a chat's text is read as content and tool calls in that format."""
    self.requests(body, prompt, logprobs)  # the prompt's length, before compiling
    constraint = await self.constraint(body, http_request)
    requests = self.requests(body, prompt, logprobs, constraint)
    run = Run(self.background, http_request, body.stop, self.tokenizer, self.prometheus)
    await run.start(requests)
    chat = isinstance(body, ChatBody)
    form = ChoiceForm(self.tokenizer, chat, logprobs is not None, tools)
    head = {
      "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
      "object": "chat.completion" if chat else "text_completion",
      "created": int(time.time()),
      "model": self.model_name,
    }
    if body.stream:
      usage = body.stream_options is not None and body.stream_options.include_usage
      return streaming.response(run, form, head, len(prompt) if usage else None)
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

  async def constraint(self, body: RequestBody, http_request):
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
    peer = http_request.client  # the share of the pool is the peer address's
    try:
      automaton = await self._compile_pool().compile(
        constraint, http_request.is_disconnected, client=peer.host if peer else None
      )
    except compiler_lib.CompileRefused as e:
      raise APIError(e.status, f"{param}: {e.message}", param, retry_after=e.retry_after) from None
    return param, automaton

  def _compile_pool(self) -> compiler_lib.CompilePool:
    if self.compiler is None:
      engine = self.background.engine
      self.compiler = compiler_lib.CompilePool(
        self._pieces,
        np.atleast_1d(engine.eos_ids).tolist(),
        engine.vocab_size,
        self.limits,
        max_states=engine.config.constraint_states - 1,  # besides FREE
      )
    return self.compiler
