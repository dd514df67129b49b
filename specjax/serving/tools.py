"""Tool calls, under the name they had before the HTTP side became a package: the
offer's checks live in `specjax.serving.http.tools`, the formats and their
parsers in `specjax.serving.http.tool_parsers`."""

from specjax.serving.http.tool_parsers import HERMES, ToolCallParser, ToolFormat, call_id
from specjax.serving.http.tools import NO_PARAMETERS, ToolOffer, template_messages

__all__ = [
  "HERMES",
  "NO_PARAMETERS",
  "ToolCallParser",
  "ToolFormat",
  "ToolOffer",
  "call_id",
  "template_messages",
]
