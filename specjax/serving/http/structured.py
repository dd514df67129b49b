"""Structured output asked for by a request: `response_format`, `guided_regex`,
`guided_choice`, or a chat's tools, as one `specjax.constraints` constraint,
measured against the server's bounds before anything compiles it (the compile,
in a worker process the server can stop, is `specjax.serving.compiler`'s)."""

from __future__ import annotations

import json

from specjax import constraints, grammar
from specjax.serving.http.bodies import DEFAULT_LIMITS, ChatBody, RequestBody
from specjax.serving.http.errors import APIError
from specjax.serving.http.tool_parsers import HERMES, ToolFormat
from specjax.serving.limits import ServerLimits

RESPONSE_FORMATS = ("text", "json_object", "json_schema")
# What "json_object" stands for: any JSON object (outlines-core bounds its nesting).
JSON_OBJECT = {"type": "object"}


def constraint_of(
  body: RequestBody, limits: ServerLimits = DEFAULT_LIMITS, tool_format: ToolFormat = HERMES
) -> tuple[str, constraints.Constraint] | None:
  """`(param, constraint)` that `body` asks for (None: free text); APIError (400)
  naming the field for a malformed or second one, or one past `limits`. A chat's
  tools (tool_choice other than "none") ask for calls in `tool_format`."""
  asked = []
  fmt = body.response_format
  if fmt is not None and fmt.type != "text":
    if fmt.type == "json_object":
      asked.append(("response_format", constraints.JsonSchema(JSON_OBJECT)))
    elif fmt.type == "json_schema":
      if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        where = "response_format.json_schema" + ("" if fmt.json_schema is None else ".schema")
        raise APIError(400, f"{where} is required for type json_schema.", where)
      schema = constraints.JsonSchema(fmt.json_schema.schema_)
      asked.append(("response_format.json_schema.schema", schema))
    else:
      raise APIError(
        400,
        f"response_format.type must be one of {', '.join(RESPONSE_FORMATS)}, got {fmt.type!r}.",
        "response_format.type",
      )
  if body.guided_regex is not None:
    asked.append(("guided_regex", constraints.Regex(body.guided_regex)))
  if body.guided_choice is not None:
    asked.append(("guided_choice", constraints.Choice(tuple(body.guided_choice))))
  offer = body.offer(limits) if isinstance(body, ChatBody) else None
  calls = None if offer is None else offer.constraint(tool_format)
  if calls is not None:
    asked.append(("tools", calls))
  if len(asked) > 1:
    names = " and ".join(p.split(".")[0] for p, _ in asked)
    raise APIError(400, f"one constraint per request: got {names}.", asked[1][0].split(".")[0])
  if asked:
    _check_size(*asked[0], limits)
  return asked[0] if asked else None


def _check_size(param: str, constraint, limits: ServerLimits) -> None:
  """APIError (400 naming `param`) for a constraint past `limits`: the cheap
  measures, before any compile."""

  def refuse(what: str, field: str):
    most = getattr(limits, field)
    raise APIError(400, f"{param}: {what}; this server takes at most {most} ({field}).", param)

  if isinstance(constraint, constraints.Regex):
    pattern = constraint.pattern
    if len(pattern) > limits.max_regex_chars:
      refuse(f"the regex has {len(pattern)} characters", "max_regex_chars")
    repeat = grammar.regex_repeat(pattern)
    if repeat > limits.max_regex_repeat:
      refuse(f"a counted repetition makes {repeat} copies of one piece", "max_regex_repeat")
  elif isinstance(constraint, grammar.ToolCalls):
    for name, schema in constraint.functions:
      _check_schema(f"{param}: function {name!r}'s parameters", json.loads(schema), limits)
  elif isinstance(constraint, constraints.Choice):
    options = constraint.options
    if len(options) > limits.max_choices:
      refuse(f"{len(options)} options", "max_choices")
    chars = sum(len(o) for o in options)
    if chars > limits.max_choice_chars:
      refuse(f"the options have {chars} characters together", "max_choice_chars")
  else:
    _check_schema(param, constraint.schema, limits)


def _check_schema(where: str, schema, limits: ServerLimits) -> None:
  """APIError (400 naming `where`'s field) for a schema past `limits`."""
  param = where.split(":")[0]
  size = len(json.dumps(schema).encode())
  if size > limits.max_schema_bytes:
    raise APIError(
      400,
      f"{where}: the schema has {size} bytes (as JSON); this server takes at most "
      f"{limits.max_schema_bytes} (max_schema_bytes).",
      param,
    )
  depth = grammar.json_depth(schema, limits.max_schema_depth)
  if depth > limits.max_schema_depth:
    raise APIError(
      400,
      f"{where}: the schema nests more than {limits.max_schema_depth} levels deep; this "
      f"server takes at most {limits.max_schema_depth} (max_schema_depth).",
      param,
    )
