"""What a tool-call format gives the server: a parser that reads a choice's text
back as OpenAI's `tool_calls` (`ToolParser`), and where a chat template shows
the format (the formats a template may show are registered: `register`, `known`)."""

from __future__ import annotations

import uuid
from typing import Protocol


class ToolParser(Protocol):
  """One choice's text, fed as it grows, split into content and tool calls.

  `feed(delta, final)` returns the content released and OpenAI's
  `delta.tool_calls` entries; `calls` holds every call begun (`{"id", "type",
  "function": {"name", "arguments"}}`). `finished_calls`: the text ends after
  whole calls (finish_reason "tool_calls"); `cut`: it ends inside the last
  call's arguments, which are then not whole JSON (cut by `stop` or `max_tokens`)."""

  calls: list[dict]

  def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]: ...

  @property
  def finished_calls(self) -> bool: ...

  @property
  def cut(self) -> bool: ...


_KNOWN: list = []


def register(fmt):
  """Makes `fmt` one that a chat template may show (`known`); returns it."""
  _KNOWN.append(fmt)
  return fmt


def known() -> tuple:
  """The registered formats, in the order they were registered."""
  return tuple(_KNOWN)


def call_id() -> str:
  return f"call_{uuid.uuid4().hex[:24]}"


def held(text: str, word: str) -> int:
  """The longest tail of `text` that begins `word` (what a stream holds back)."""
  for k in range(min(len(text), len(word) - 1), 0, -1):
    if word.startswith(text[-k:]):
      return k
  return 0
