"""Tool calls as tagged JSON objects: `open {"name": NAME, "arguments": ARGS} close`,
several joined by `separator`, after any content. This is the layout the
constraint `specjax.grammar.ToolCalls` writes, so a `ToolFormat` is its four
strings and every format of this layout reads back with `ToolCallParser`."""

from __future__ import annotations

import contextlib
import dataclasses
import json

from specjax.serving.http.tool_parsers.base import call_id, held, known


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
    """The registered format a `ChatTemplate`'s source shows, or None (tools refused)."""
    source = getattr(template, "source", "") or ""
    return next((f for f in known() if f.open.strip() in source), None)

  def parser(self) -> ToolCallParser:
    """A parser for one choice's text in this format."""
    return ToolCallParser(self)


_DECODER = json.JSONDecoder()
_HEAD, _ARGUMENTS = '{"name": "', '", "arguments": '


class ToolCallParser:
  """A `ToolParser` for the text `specjax.grammar.ToolCalls` allows in `fmt`:
  content (none of `fmt.open`), then calls `open {"name": "f", "arguments": ARGS}
  close`, joined by `separator`. `feed` holds back a tail that may begin `open`
  until it is known; a call's first `delta.tool_calls` entry has its index, id,
  type and name, its arguments follow in pieces as written (a stream's pieces
  join into the whole answer's string). `complete` counts the calls finished."""

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
    step = {
      "content": self._content,
      "head": self._head,
      "arguments": self._arguments,
      "tail": self._tail,
      "between": self._between,
    }
    while True:
      released, more = step[self.state](self.text[self.pos :], deltas, final)
      content += released
      if not more:
        return content, deltas

  def _content(self, rest: str, deltas, final) -> tuple[str, bool]:
    at = rest.find(self.fmt.open)
    if at < 0:
      keep = 0 if final else held(rest, self.fmt.open)
      self.pos += len(rest) - keep
      return rest[: len(rest) - keep], False
    self.pos += at + len(self.fmt.open)
    self.state = "head"
    return rest[:at], True

  def _head(self, rest: str, deltas, final) -> tuple[str, bool]:
    end = rest.find(_ARGUMENTS)
    if end < 0:
      return "", False  # the name is not whole yet
    name, index = rest[len(_HEAD) : end], len(self.calls)
    self.calls.append(
      {"id": call_id(), "type": "function", "function": {"name": name, "arguments": ""}}
    )
    deltas.append(
      {"index": index, "id": self.calls[-1]["id"], "type": "function",
       "function": {"name": name, "arguments": ""}}
    )  # fmt: skip
    self.pos += end + len(_ARGUMENTS)
    self._args_from = self.pos
    self.state = "arguments"
    return "", True

  def _arguments(self, rest: str, deltas, final) -> tuple[str, bool]:
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
      return "", False
    self.state = "tail"
    return "", True

  def _tail(self, rest: str, deltas, final) -> tuple[str, bool]:
    tail = "}" + self.fmt.close
    if not rest.startswith(tail):
      return "", False
    self.pos += len(tail)
    self.complete += 1
    self.state = "between"
    return "", True

  def _between(self, rest: str, deltas, final) -> tuple[str, bool]:
    joint = self.fmt.separator + self.fmt.open
    if not rest.startswith(joint):
      return "", False
    self.pos += len(joint)
    self.state = "head"
    return "", True

  @property
  def finished_calls(self) -> bool:
    """Whether the text ends after whole calls (then finish_reason is "tool_calls")."""
    return self.complete > 0 and self.state == "between"

  @property
  def cut(self) -> bool:
    """Whether the text ends inside the last call's arguments: not whole JSON."""
    return self.state == "arguments"
