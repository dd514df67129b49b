"""What a request may ask its text to be (`Regex`, `JsonSchema`, `Choice`,
`ToolCalls`), the kinds' names in the compile worker's messages (`KINDS`), and
the error of a constraint that cannot be compiled (`CompileError`).
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Regex:
  """Text matching `pattern` (outlines-core's regex syntax), then EOS."""

  pattern: str


@dataclasses.dataclass(frozen=True)
class JsonSchema:
  """JSON text valid under `schema` (a dict or its JSON string), then EOS."""

  schema: Any


@dataclasses.dataclass(frozen=True)
class Choice:
  """Exactly one of `options` (non-empty strings), then EOS."""

  options: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class ToolCalls:
  """Tool calls in a chat template's format, then EOS: each call is `open`,
  `{"name": NAME, "arguments": ARGS}` (ARGS valid under that function's
  parameters schema) and `close`; calls follow one another after `separator`
  (`parallel`), or there is one. `required=False` ("auto") allows text instead,
  or text and then calls: text that never holds `open`'s first line.

  Attributes:
    functions: `(name, parameters schema as JSON text)` per function offered.
  """

  functions: tuple[tuple[str, str], ...]
  required: bool = True
  parallel: bool = True
  open: str = "<tool_call>\n"
  close: str = "\n</tool_call>"
  separator: str = "\n"


Constraint = Regex | JsonSchema | Choice | ToolCalls  # what a request may ask for


class CompileError(ValueError):
  """A constraint that cannot be compiled (the message says why)."""


KINDS = {"regex": Regex, "json_schema": JsonSchema, "choice": Choice, "tool_calls": ToolCalls}
