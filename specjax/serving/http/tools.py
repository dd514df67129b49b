"""Tool calls in chat completions: OpenAI's `tools`, `tool_choice` and
`parallel_tool_calls`, checked, and the calls they allow as a constraint.

  offer = ToolOffer.of(body.tools, body.tool_choice, body.parallel_tool_calls, max_tools)
  text = template.render(template_messages(messages), True, tools=offer.tools)
  constraint = offer.constraint(fmt)        # None for tool_choice "none"
  parser = fmt.parser(); content, deltas = parser.feed(text_delta, final)

The tools reach the model through the checkpoint's chat template (its `tools`
variable, as transformers renders it). The model writes a call in the
template's format (`specjax.serving.http.tool_parsers`: Hermes-style `<tool_call>`
blocks), and the constraint (`specjax.grammar.ToolCalls`) makes every call parse
and its arguments validate: "required" and a named function force calls; "auto"
allows text, or text and then calls. The format's parser reads the text back as
OpenAI's `tool_calls`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from specjax import grammar
from specjax.serving.http.tool_parsers import ToolFormat
from specjax.validation import FieldError

CHOICES = ("none", "auto", "required")
# OpenAI's rule for a function's name.
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# What a function without `parameters` takes: an object with no declared fields.
NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclasses.dataclass(frozen=True)
class ToolOffer:
  """A request's tools as checked: `tools` (OpenAI's list, for the template),
  `functions` (name -> parameters schema), `choice` ("none", "auto",
  "required" or a function's name) and `parallel`."""

  tools: list[dict[str, Any]]
  functions: dict[str, dict]
  choice: str
  parallel: bool

  @classmethod
  def of(cls, tools, tool_choice, parallel: bool, max_tools: int) -> ToolOffer | None:
    """The offer of a request's fields, None without tools (and `tool_choice`
    absent or "none"); a FieldError naming `tools` or `tool_choice` (its message
    the entry: `tools[i].function.name`, ...)."""
    if tools is None:
      if tool_choice not in (None, "none"):
        raise FieldError(
          "tool_choice", f"tool_choice needs tools; got tool_choice {tool_choice!r} and no tools."
        )
      return None
    if not isinstance(tools, list) or not tools:
      raise FieldError("tools", "tools must be a non-empty list of function tools.")
    if len(tools) > max_tools:
      raise FieldError(
        "tools", f"tools: at most {max_tools} functions (max_tools), got {len(tools)}."
      )
    functions = {}
    for i, tool in enumerate(tools):
      where = f"tools[{i}]"
      if not isinstance(tool, dict) or tool.get("type") != "function":
        raise FieldError("tools", f'{where}.type must be "function", got {_get(tool, "type")!r}.')
      function = tool.get("function")
      if not isinstance(function, dict):
        raise FieldError("tools", f"{where}.function must be an object with a name.")
      unknown = set(tool) - {"type", "function"} or set(function) - {
        "name", "description", "parameters", "strict",
      }  # fmt: skip
      if unknown:
        raise FieldError(
          "tools", f"{where}: {sorted(unknown)[0]} is not a supported field of a tool."
        )
      name = function.get("name")
      if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise FieldError(
          "tools", f"{where}.function.name must be 1 to 64 letters, digits, _ or -, got {name!r}."
        )
      if name in functions:
        raise FieldError("tools", f"{where}.function.name: {name!r} is offered twice.")
      parameters = function.get("parameters", NO_PARAMETERS)
      if not isinstance(parameters, dict):
        raise FieldError("tools", f"{where}.function.parameters must be a JSON schema object.")
      if not isinstance(function.get("description", ""), str):
        raise FieldError("tools", f"{where}.function.description must be a string.")
      functions[name] = parameters
    choice = _choice(tool_choice, functions)
    return cls(tools, functions, choice, bool(parallel))

  def constraint(self, fmt: ToolFormat) -> grammar.ToolCalls | None:
    """What the text must be (None: "none", free text)."""
    if self.choice == "none":
      return None
    names = list(self.functions) if self.choice in CHOICES else [self.choice]
    return grammar.ToolCalls(
      tuple((n, json.dumps(self.functions[n], sort_keys=True)) for n in names),
      required=self.choice != "auto",
      parallel=self.parallel,
      open=fmt.open,
      close=fmt.close,
      separator=fmt.separator,
    )


def _get(value, key):
  return value.get(key) if isinstance(value, dict) else None


def _choice(tool_choice, functions: dict) -> str:
  if tool_choice is None:
    return "auto"
  if isinstance(tool_choice, str):
    if tool_choice not in CHOICES:
      raise FieldError(
        "tool_choice",
        f'tool_choice must be one of {", ".join(CHOICES)} or {{"type": "function", '
        f'"function": {{"name": ...}}}}, got {tool_choice!r}.',
      )
    return tool_choice
  name = _get(_get(tool_choice, "function"), "name")
  if _get(tool_choice, "type") != "function" or not isinstance(name, str):
    raise FieldError(
      "tool_choice",
      f'tool_choice must be {{"type": "function", "function": {{"name": ...}}}}, '
      f"got {tool_choice!r}.",
    )
  if name not in functions:
    raise FieldError(
      "tool_choice",
      f"tool_choice.function.name: {name!r} is not among the tools ({', '.join(functions)}).",
    )
  return name


def template_messages(messages: list[dict], max_depth: int = 64) -> list[dict]:
  """`messages` as chat templates read them: a tool call's `arguments` (a JSON
  string in OpenAI's API) as the object it spells, as transformers' templates
  expect (they write it with `tojson`). ValueError naming one that is not JSON
  or nests deeper than `max_depth` (the server's `max_json_depth`)."""
  out = []
  for i, m in enumerate(messages):
    calls = m.get("tool_calls")
    if calls:
      fixed = []
      for j, call in enumerate(calls):
        function = dict(call["function"])
        if isinstance(function["arguments"], str):
          where = f"messages[{i}].tool_calls[{j}].function.arguments"
          try:
            function["arguments"] = json.loads(function["arguments"])
          except RecursionError:
            raise FieldError(
              "messages", f"{where} nests more than {max_depth} levels deep."
            ) from None
          except ValueError:
            raise FieldError(
              "messages", f"{where} is not valid JSON: {function['arguments'][:100]!r}."
            ) from None
          if grammar.json_depth(function["arguments"], max_depth) > max_depth:
            raise FieldError("messages", f"{where} nests more than {max_depth} levels deep.")
        fixed.append({**call, "function": function})
      m = {**m, "tool_calls": fixed}
    out.append(m)
  return out
