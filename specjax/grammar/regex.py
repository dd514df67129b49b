"""A constraint's regular expression (`to_regex`, in outlines-core's syntax):
a pattern as given, a choice's options escaped, a schema's by outlines-core, and
tool calls in a chat template's format, with text that never holds a word
(`text_without`) before them where calls are optional.
"""

from __future__ import annotations

import json

from specjax.grammar.kinds import Choice, Constraint, JsonSchema, Regex, ToolCalls
from specjax.grammar.outlines import _outlines, _uncaught


def to_regex(constraint: Constraint) -> str:
  """The regular expression a constraint stands for (ValueError naming the field
  when it is malformed)."""
  _, build_regex_from_schema = _outlines()
  if isinstance(constraint, Regex):
    if not isinstance(constraint.pattern, str) or not constraint.pattern:
      raise ValueError(f"regex must be a non-empty string, got {constraint.pattern!r}.")
    return constraint.pattern
  if isinstance(constraint, Choice):
    options = tuple(constraint.options)
    if not options or not all(isinstance(o, str) and o for o in options):
      raise ValueError(f"choice must be a non-empty list of non-empty strings, got {options!r}.")
    return "|".join(_escape(o) for o in options)
  if isinstance(constraint, JsonSchema):
    schema = constraint.schema
    try:
      text = schema if isinstance(schema, str) else json.dumps(schema)
      json.loads(text)
      return build_regex_from_schema(text)
    except BaseException as e:  # outlines-core raises its own types, panics included
      if _uncaught(e):
        raise
      raise ValueError(f"json_schema is not a schema outlines-core can compile: {e}") from None
  if isinstance(constraint, ToolCalls):
    return _tool_calls_regex(constraint)
  raise ValueError(
    f"constraint must be a Regex, JsonSchema, Choice or ToolCalls, got {type(constraint).__name__}."
  )


def _escape(text: str) -> str:
  """`text` as a literal in outlines-core's regex syntax (a newline as \\n)."""
  out = "".join("\\" + c if c in r".^$*+?{}[]\|()" else c for c in text)
  return out.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")


def _not_in_class(chars: str) -> str:
  return "[^" + "".join("\\" + c if c in "\\]-[^&~" else c for c in chars) + "]"


def text_without(word: str) -> str:
  """A regex of the texts that never hold `word` (whose first character occurs
  only first): a run without word[0], then pieces each beginning with word[0]
  whose next characters leave `word` before its end. Unambiguous: each next
  character picks one branch."""
  first = word[:1]
  if not word or first in word[1:]:
    raise ValueError(f"word must be characters whose first occurs once, got {word!r}.")
  rest = _not_in_class(first)
  if len(word) == 1:
    return f"{rest}*"
  piece = f"(?:{_not_in_class(first + word[-1])}{rest}*)?"
  for c in word[-2:0:-1]:
    piece = f"(?:{_not_in_class(first + c)}{rest}*|{_escape(c)}{piece})?"
  return f"{rest}*(?:{_escape(first)}{piece})*"


def _tool_calls_regex(constraint: ToolCalls) -> str:
  _, build_regex_from_schema = _outlines()
  if not constraint.functions:
    raise ValueError("tools must offer at least one function.")
  calls = []
  for name, schema in constraint.functions:
    try:
      json.loads(schema)
      arguments = build_regex_from_schema(schema)
    except BaseException as e:  # outlines-core raises its own types, panics included
      if _uncaught(e):
        raise
      raise ValueError(
        f"the parameters of function {name!r} are not a schema outlines-core can compile: {e}"
      ) from None
    head = _escape(json.dumps({"name": name, "arguments": 0})[:-2])  # up to ARGS
    calls.append(f"{head}{arguments}\\}}")
  block = f"{_escape(constraint.open)}(?:{'|'.join(calls)}){_escape(constraint.close)}"
  blocks = f"{block}(?:{_escape(constraint.separator)}{block})*" if constraint.parallel else block
  if constraint.required:
    return blocks
  return f"{text_without(constraint.open.strip())}(?:{blocks})?"
