"""Chat templates: a checkpoint's own, rendered as transformers renders them.

  template = ChatTemplate.from_checkpoint("/path/to/llama")   # None: it has none
  text = template.render(messages, add_generation_prompt=True)
  spans = template.assistant_spans(messages)  # [(start, end)] in render(messages)

The template comes from `tokenizer_config.json`'s `chat_template` (a string, or
a list of named templates, "default" first), `chat_template.jinja` or
`chat_template.json`; the bundled pair has `BUNDLED_TEMPLATE`. Rendering uses
jinja2's sandbox with transformers' settings (trim_blocks, lstrip_blocks,
loopcontrols, `raise_exception`, `strftime_now`, a non-ASCII `tojson`,
`{% generation %}` blocks) and the tokenizer's special tokens as variables.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from typing import Any

# The bundled pair was trained on Python source, so a chat reads as comments; tools
# and tool calls in the Hermes format (`specjax.serving.http.tool_parsers.hermes`).
BUNDLED_TEMPLATE = (
  "{% if tools %}{{ '# tools:\\n' }}{% for t in tools %}"
  "{{ '# ' + t['function']['name'] + ' ' + (t['function']['parameters'] or {}) | tojson + '\\n' }}"
  "{% endfor %}"
  '{{ \'# call one as <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>\\n\' }}'
  "{% endif %}"
  "{% for m in messages %}{{ '# ' + m['role'] + ':\\n' + (m['content'] or '') }}"
  "{% for c in m['tool_calls'] or [] %}"
  "{{ '<tool_call>\\n{\"name\": \"' + c['function']['name'] + '\", \"arguments\": ' }}"
  "{{ c['function']['arguments'] | tojson + '}\\n</tool_call>' }}{% endfor %}"
  "{{ '\\n' }}{% endfor %}"
  "{% if add_generation_prompt %}{{ '# assistant:\\n' }}{% endif %}"
)
ROLES = ("system", "user", "assistant", "tool", "developer")
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")


def check_messages(messages: Any, where: str = "messages") -> list[dict[str, Any]]:
  """`messages` as a list of {"role", "content"} dicts; ValueError naming `where[i]`.

  OpenAI's tool turns too: an assistant message may carry `tool_calls` (a list of
  {"id", "type": "function", "function": {"name", "arguments"}}) with no
  `content` (null), and a "tool" message names the call it answers (`tool_call_id`).
  """
  if not isinstance(messages, list) or not messages:
    raise ValueError(f"{where} must be a non-empty list of {{role, content}} objects.")
  for i, m in enumerate(messages):
    if not isinstance(m, dict):
      raise ValueError(f"{where}[{i}] must be an object with 'role' and 'content'.")
    if m.get("role") not in ROLES:
      raise ValueError(f"{where}[{i}].role must be one of {ROLES}, got {m.get('role')!r}.")
    calls = m.get("tool_calls")
    if calls is not None:
      if m["role"] != "assistant":
        raise ValueError(f"{where}[{i}].tool_calls: only an assistant message makes tool calls.")
      _check_calls(calls, f"{where}[{i}].tool_calls")
    content = m.get("content")
    if not isinstance(content, str) and not (calls and content is None):
      raise ValueError(f"{where}[{i}].content must be a string, got {content!r}.")
    call_id = m.get("tool_call_id")
    if call_id is not None and not isinstance(call_id, str):
      raise ValueError(f"{where}[{i}].tool_call_id must be a string, got {call_id!r}.")
  return messages


def _check_calls(calls: Any, where: str) -> None:
  if not isinstance(calls, list) or not calls:
    raise ValueError(f"{where} must be a non-empty list of tool calls.")
  for j, call in enumerate(calls):
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
      raise ValueError(
        f'{where}[{j}] must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}.'
      )
    if not isinstance(function.get("arguments"), (str, dict)):
      raise ValueError(
        f"{where}[{j}].function.arguments must be a JSON string (or an object), got "
        f"{function.get('arguments')!r}."
      )


def _generation_extension():
  """`{% generation %}...{% endgeneration %}` (transformers' assistant masks) as plain output."""
  from jinja2 import nodes
  from jinja2.ext import Extension

  class Generation(Extension):
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return nodes.Scope(body, lineno=lineno)

  return Generation


@functools.lru_cache(maxsize=16)
def _compile(source: str):
  import jinja2
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
      x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )

  env = ImmutableSandboxedEnvironment(
    trim_blocks=True,
    lstrip_blocks=True,
    extensions=[_generation_extension(), jinja2.ext.loopcontrols],
  )
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env.from_string(source)


def _token_text(value) -> str | None:
  if isinstance(value, dict):  # an AddedToken as tokenizer_config.json stores it
    return value.get("content")
  return value if isinstance(value, str) else None


class ChatTemplate:
  """A jinja chat template and the special tokens it may name."""

  def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
    if not isinstance(source, str) or not source:
      raise ValueError("source must be a non-empty chat template string.")
    self.source = source
    self.special_tokens = dict(special_tokens or {})
    import jinja2

    try:  # a syntax error surfaces here, not at the first request
      _compile(source)
    except jinja2.TemplateSyntaxError as e:
      raise ValueError(f"the chat template has a syntax error at line {e.lineno}: {e}") from e

  @classmethod
  def from_checkpoint(cls, path: str) -> ChatTemplate | None:
    """The template of the checkpoint directory `path`, or None when it has none."""
    from specjax import pretrained

    pair = os.path.realpath(pretrained.PAIR_DIR)
    if os.path.commonpath([os.path.realpath(path), pair]) == pair:
      return cls(BUNDLED_TEMPLATE)
    config = _read_json(os.path.join(path, "tokenizer_config.json")) or {}
    special = {k: t for k in _SPECIAL if (t := _token_text(config.get(k))) is not None}
    source = config.get("chat_template")
    jinja = os.path.join(path, "chat_template.jinja")
    if source is None and os.path.isfile(jinja):
      with open(jinja, encoding="utf-8") as f:
        source = f.read()
    if source is None:
      source = (_read_json(os.path.join(path, "chat_template.json")) or {}).get("chat_template")
    if isinstance(source, list):  # named templates: transformers uses "default"
      named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
      source = named.get("default")
    return cls(source, special) if source else None

  def render(self, messages, add_generation_prompt: bool = False, tools=None, **variables) -> str:
    """The text of `messages` (checked by `check_messages`), as
    `tokenizer.apply_chat_template(messages, tokenize=False, tools=tools, ...)`
    gives it; `tools`: OpenAI's tool list ({"type": "function", "function": ...}
    each), or None."""
    check_messages(messages)
    return _compile(self.source).render(
      messages=messages,
      add_generation_prompt=add_generation_prompt,
      tools=tools,
      documents=None,
      **{**self.special_tokens, **variables},
    )

  def assistant_spans(self, messages) -> list[tuple[int, int]]:
    """Character spans `[start, end)` of `render(messages)` the assistant turns
    produce (with the template's end-of-turn text): what a drafter is trained on.

    Turn i's span runs from the end of `render(messages[:i], add_generation_prompt=True)`
    to the end of `render(messages[:i + 1])`, both prefixes of the whole text.

    Raises:
      ValueError: the template does not render a conversation as the
        concatenation of its turns (e.g. it rewrites earlier turns).
    """
    full = self.render(messages)
    spans = []
    for i, m in enumerate(messages):
      if m["role"] != "assistant":
        continue
      start = len(self.render(messages[:i], add_generation_prompt=True)) if i else 0
      end = len(self.render(messages[: i + 1]))
      if not full.startswith(self.render(messages[: i + 1])) or start > end:
        raise ValueError(
          f"messages[{i}]: this chat template does not render the conversation turn by "
          "turn, so the assistant's text cannot be located."
        )
      spans.append((start, end))
    return spans


def _read_json(path: str) -> dict | None:
  if not os.path.isfile(path):
    return None
  with open(path, encoding="utf-8") as f:
    try:
      value = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path} is not valid JSON: {e}") from e
  return value if isinstance(value, dict) else None
