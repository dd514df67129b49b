"""Hermes-style tool calls (Qwen2.5, Qwen3, Hermes and many fine-tunes): each
call `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, several
joined by a newline; a template that shows `<tool_call>` gets this format."""

from specjax.serving.http.tool_parsers.base import register
from specjax.serving.http.tool_parsers.tagged import ToolFormat

HERMES = register(ToolFormat("hermes", "<tool_call>\n", "\n</tool_call>", "\n"))
