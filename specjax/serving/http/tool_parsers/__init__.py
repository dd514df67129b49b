"""Tool-call formats and the parsers that read them back as OpenAI's
`tool_calls`, one module each (`base` says what a format gives). A chat
template shows its model's format (`ToolFormat.of`); the request's calls are
constrained to it (`specjax.serving.http.tools.ToolOffer.constraint`) and read
back by its parser (`ToolFormat.parser`).

  tagged   the layout `open {"name": ..., "arguments": {...}} close` and its parser
  hermes   Hermes-style `<tool_call>` blocks (tagged)
"""

from specjax.serving.http.tool_parsers.base import ToolParser, call_id, known, register
from specjax.serving.http.tool_parsers.hermes import HERMES
from specjax.serving.http.tool_parsers.tagged import ToolCallParser, ToolFormat

__all__ = [
  "HERMES",
  "ToolCallParser",
  "ToolFormat",
  "ToolParser",
  "call_id",
  "known",
  "register",
]
