"""Tool calls in chat completions: OpenAI's `tools`, `tool_choice` and
`parallel_tool_calls`, produced under each function's JSON schema.

  fmt = ToolFormat.of(template)                       # None: the template has none
  offer = ToolOffer.of(body.tools, body.tool_choice, body.parallel_tool_calls)
  text = template.render(template_messages(messages), True, tools=offer.tools)
  constraint = offer.constraint(fmt)                  # None for tool_choice "none"
  parser = ToolCallParser(fmt); content, deltas = parser.feed(text_delta, final)

The tools reach the model through the checkpoint's chat template (its `tools`
variable, as transformers renders it). The model writes a call in the
template's format, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
for Hermes-style templates (Qwen2.5, Qwen3, Hermes and many fine-tunes), and
the constraint (`specjax.grammar.ToolCalls`) makes every call parse and its
arguments validate: "required" and a named function force calls; "auto" allows
text, or text and then calls. The parser splits the text as it grows into
content and OpenAI's `tool_calls`, whole or as `delta.tool_calls` chunks; the
arguments are the text the model wrote, so a stream's pieces join into the
whole answer's string.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import uuid
from typing import Any

from specjax import grammar
from specjax.validation import FieldError

CHOICES = ("none", "auto", "required")
# OpenAI's rule for a function's name.
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# What a function without `parameters` takes: an object with no declared fields.
NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclasses.dataclass(frozen=True)
class ToolFormat:
  """How a chat template's model writes its tool calls: `open`, the call as
  `{"name": NAME, "arguments": ARGS}`, `close`; several joined by `separator`."""

  name: str
  open: str
  close: str
  separator: str

  @classmethod
  def of(cls, template) -> ToolFormat | None:
    """The format a `ChatTemplate`'s source shows, or None (tools refused)."""
    source = getattr(template, "source", "") or ""
    return HERMES if HERMES.open.strip() in source else None


HERMES = ToolFormat("hermes", "<tool_call>\n", "\n</tool_call>", "\n")
_DECODER = json.JSONDecoder()


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


def call_id() -> str:
  return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallParser:
  """One choice's text, fed as it grows, split into content and tool calls.

  The text is what `ToolCalls` allows: content (none of `fmt.open`), then calls
  `open {"name": "f", "arguments": ARGS} close`, joined by `separator`. `feed`
  returns the content released (a tail that may begin `open` is held back until
  it is known) and OpenAI's `delta.tool_calls` entries: a call's first entry has
  its index, id, type and name; its arguments follow in pieces as written.
  `calls` holds every call begun (`{"id", "type", "function": {"name", "arguments"}}`),
  `complete` the number finished."""

  def __init__(self, fmt: ToolFormat):
    self.fmt = fmt
    self.text, self.pos = "", 0
    self.state = "content"  # content -> head -> arguments -> tail -> between -> head ...
    self.calls: list[dict] = []
    self.complete = 0
    self._args_from = 0

  def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
    self.text += delta
    content, deltas = "", []
    while True:
      rest = self.text[self.pos :]
      if self.state == "content":
        at = rest.find(self.fmt.open)
        if at < 0:
          keep = 0 if final else _held(rest, self.fmt.open)
          content += rest[: len(rest) - keep]
          self.pos += len(rest) - keep
          return content, deltas
        content += rest[:at]
        self.pos += at + len(self.fmt.open)
        self.state = "head"
      elif self.state == "head":
        end = rest.find('", "arguments": ')
        if end < 0:
          return content, deltas  # the name is not whole yet
        name, index = rest[len('{"name": "') : end], len(self.calls)
        self.calls.append(
          {"id": call_id(), "type": "function", "function": {"name": name, "arguments": ""}}
        )
        deltas.append(
          {"index": index, "id": self.calls[-1]["id"], "type": "function",
           "function": {"name": name, "arguments": ""}}
        )  # fmt: skip
        self.pos += end + len('", "arguments": ')
        self._args_from = self.pos
        self.state = "arguments"
      elif self.state == "arguments":
        end = None
        if "}" in rest:  # the arguments object ends where it parses whole
          with contextlib.suppress(ValueError):
            _, end = _DECODER.raw_decode(self.text, self._args_from)
        piece = self.text[self.pos : len(self.text) if end is None else end]
        if piece:
          self.calls[-1]["function"]["arguments"] += piece
          deltas.append({"index": len(self.calls) - 1, "function": {"arguments": piece}})
        self.pos += len(piece)
        if end is None:
          return content, deltas
        self.state = "tail"
      elif self.state == "tail":
        tail = "}" + self.fmt.close
        if not rest.startswith(tail):
          return content, deltas
        self.pos += len(tail)
        self.complete += 1
        self.state = "between"
      else:  # between calls
        joint = self.fmt.separator + self.fmt.open
        if not rest.startswith(joint):
          return content, deltas
        self.pos += len(joint)
        self.state = "head"

  @property
  def finished_calls(self) -> bool:
    """Whether the text ends after whole calls (then finish_reason is "tool_calls")."""
    return self.complete > 0 and self.state == "between"


def _held(text: str, word: str) -> int:
  """The longest tail of `text` that begins `word` (what a stream holds back)."""
  for k in range(min(len(text), len(word) - 1), 0, -1):
    if word.startswith(text[-k:]):
      return k
  return 0
