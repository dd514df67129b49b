"""The request bodies both endpoints accept, as pydantic models (strict: no "16"
for 16, no 1 for true; any field not named here is refused). Ranges are checked
later (`specjax.serving.http.fields`), by the library's own checks where it has them."""

from __future__ import annotations

from typing import Any

import pydantic

from specjax.sampling import SamplingParams
from specjax.serving.http.errors import APIError
from specjax.serving.http.tools import ToolOffer
from specjax.serving.limits import ServerLimits
from specjax.validation import FieldError

DEFAULT_LIMITS = ServerLimits()
# The warps that read the row's text: the same name in the library and in this API.
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


# Nested models, by their field's location (for the names of their fields).
NESTED = {
  ("stream_options",): StreamOptions,
  ("speculation",): Speculation,
  ("response_format",): ResponseFormat,
  ("response_format", "json_schema"): JsonSchemaFormat,
}


class RequestBody(pydantic.BaseModel):
  """The fields both endpoints accept."""

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
    """The request's `SamplingParams` (a FieldError naming a field out of range)."""
    warps = {f: getattr(self, f) for f in WARP_FIELDS}
    warps["logit_bias"] = warps["logit_bias"] or {}
    warps["stop_token_ids"] = warps["stop_token_ids"] or []
    return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, **warps)


class CompletionBody(RequestBody):
  """The accepted JSON body of POST /v1/completions."""

  prompt: str | list[int]
  logprobs: int | None = None  # the legacy form: how many alternatives


class ChatBody(RequestBody):
  """The accepted JSON body of POST /v1/chat/completions."""

  messages: list[dict[str, Any]]
  max_completion_tokens: int | None = None  # the newer name of max_tokens
  logprobs: bool = False
  top_logprobs: int | None = None
  # Tool calls (specjax.serving.http.tools): OpenAI's function tools.
  tools: list[dict[str, Any]] | None = None
  tool_choice: str | dict[str, Any] | None = None
  parallel_tool_calls: bool = True

  def offer(self, limits: ServerLimits) -> ToolOffer | None:
    """The request's checked tools (None: none); APIError naming the field."""
    try:
      return ToolOffer.of(self.tools, self.tool_choice, self.parallel_tool_calls, limits.max_tools)
    except FieldError as e:
      raise APIError(400, str(e), e.field) from None
