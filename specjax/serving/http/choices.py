"""A choice as the endpoints answer it: whole or as a streamed chunk, with its
logprobs in OpenAI's two shapes, and a chat's text read as content and
`tool_calls` by the tool format's parser."""

from __future__ import annotations

import numpy as np

from specjax.serving.http.tool_parsers import ToolFormat, ToolParser


class ChoiceForm:
  """One endpoint's JSON shapes: a choice (whole or a streamed chunk) and its
  logprobs; with `tools`, a chat's text split into content and `tool_calls`
  (one parser per choice).

  A call cut by `stop` or `max_tokens` before its arguments are whole JSON keeps
  the text written (a stream has sent it), its finish_reason is "stop" or
  "length", never "tool_calls", and the choice says so: `"incomplete_tool_call":
  true` (docs/serving.md)."""

  def __init__(self, tokenizer, chat: bool, logprobs: bool, tools: ToolFormat | None = None):
    self.tokenizer, self.chat, self.logprobs = tokenizer, chat, logprobs
    self.tools, self.parsers = tools, {}

  def choice(self, index, text, finish_reason, counted, whole=False, first=False) -> dict:
    out = {"index": index}
    if not self.chat:
      out["text"] = text
    elif self.tools is None:
      message = {"role": "assistant", "content": text} if whole or first else {"content": text}
      out["message" if whole else "delta"] = message
    else:
      parser = self.parsers.setdefault(index, self.tools.parser())
      out["message" if whole else "delta"] = self._calls(parser, text, finish_reason, whole, first)
      if finish_reason == "stop" and parser.finished_calls:
        finish_reason = "tool_calls"
      if finish_reason is not None and parser.cut:
        out["incomplete_tool_call"] = True
    out["logprobs"] = self._logprobs(counted) if self.logprobs else None
    out["finish_reason"] = finish_reason
    return out

  @staticmethod
  def _calls(parser: ToolParser, text: str, finish_reason, whole: bool, first: bool) -> dict:
    """The message (whole) or delta of a chat that may call tools."""
    content, calls = parser.feed(text, final=finish_reason is not None)
    message = {"role": "assistant"} if whole or first else {}
    if whole:
      message["content"] = content or None
      if parser.calls:
        message["tool_calls"] = parser.calls
    else:
      message["content"] = content if content or not calls else None
      if calls:
        message["tool_calls"] = calls
    return message

  def _logprobs(self, counted) -> dict:
    """OpenAI's shapes: chat `{"content": [{token, logprob, bytes, top_logprobs}]}`,
    completions (legacy) `{tokens, token_logprobs, top_logprobs, text_offset}`."""
    word = lambda t: self.tokenizer.decode([t])
    entries = [(word(t), lp, [(word(a), b) for a, b in top]) for t, (lp, top) in counted]
    if self.chat:
      item = lambda w, lp: {"token": w, "logprob": lp, "bytes": list(w.encode())}
      return {
        "content": [
          {**item(w, lp), "top_logprobs": [item(*a) for a in top]} for w, lp, top in entries
        ]
      }
    words = [w for w, *_ in entries]
    return {
      "tokens": words,
      "token_logprobs": [lp for _, lp, _ in entries],
      "top_logprobs": [dict(top[::-1]) for *_, top in entries],  # same text: the likelier
      "text_offset": np.cumsum([0] + [len(w) for w in words])[:-1].tolist(),
    }
