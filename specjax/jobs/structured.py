"""The decode job's structured output (`config.constraint` of configs/decode.py):
the constraint a value names, its token automaton for the target's tokenizer,
the prompts of the bundled task, and whether an output satisfies it.

  ""                      no constraint
  signature               the bundled task: a function's signature as JSON,
                          {"name": string, "args": [string]} (`SIGNATURE_SCHEMA`)
  json:<file or JSON>     a JSON schema, in a file or inline (starting with "{")
  regex:<pattern>         text matching the whole pattern
  choice:a|b|c            exactly one of the options

An output is checked by a checker that is not the automaton that produced it:
json.loads and `jsonschema` for a schema (where jsonschema is installed; else
the schema's regular expression, `constraints.to_regex`), `re.fullmatch` for a
regex, membership for a choice.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence

from specjax import constraints
from specjax.bench import constraint_memory
from specjax.data.tokenizer import Tokenizer
from specjax.vocab_map import token_bytes

# The memory table's signature schema: its small bounds keep every text inside
# the job's token budget (at most about 70 characters, so a 64-token run ends at
# EOS; an output cut off by the budget would not parse).
SIGNATURE_SCHEMA = constraint_memory.SCHEMAS["signature"]

# The bundled pair knows Python, not instructions: one worked example in a
# comment after a def, then the def to describe. Row i takes def i (cycling).
_EXAMPLE = 'def add(a, b):\n    pass\n# {"name": "add", "args": ["a", "b"]}\n\n'
_DEFS = (
  "def read_file(path, mode):",
  "def fibonacci(n):",
  "def join(sep, items):",
  "def move(src, dst, force):",
)
SIGNATURE_PROMPTS = tuple(f"{_EXAMPLE}{d}\n    pass\n# " for d in _DEFS)

BUNDLED = {"signature": SIGNATURE_SCHEMA}
PROMPT_SETS = ("held_out", "signature")
FORMS = "'' (none), signature, json:<schema file or inline JSON>, regex:<pattern>, choice:a|b|c"

Constraint = constraints.Constraint


def parse(value: str) -> Constraint | None:
  """The constraint `config.constraint` names (None for ""); a ValueError naming
  the field and the allowed forms for anything else. A schema is also compiled
  to its regular expression here, so a malformed one fails before any model loads."""
  if not isinstance(value, str):
    raise ValueError(f"config.constraint must be a string ({FORMS}), got {value!r}.")
  if not value:
    return None
  kind, sep, body = value.partition(":")
  if not sep and value in BUNDLED:
    return constraints.JsonSchema(BUNDLED[value])
  if sep and body and kind == "regex":
    return constraints.Regex(body)
  if sep and kind == "choice" and all(body.split("|")):
    return constraints.Choice(tuple(body.split("|")))
  if sep and body and kind == "json":
    schema = constraints.JsonSchema(_schema(body))
    try:
      constraints.to_regex(schema)
    except ValueError as e:
      raise ValueError(f"config.constraint: {e}") from None
    return schema
  raise ValueError(f"config.constraint must be one of {FORMS}; got {value!r}.")


def _schema(body: str) -> dict:
  """The JSON object `json:<body>` names: inline, or the file at that path."""
  what = "inline JSON"
  if not body.lstrip().startswith("{"):
    if not os.path.isfile(body):
      raise ValueError(
        f"config.constraint=json:{body}: no such file (inline schemas start with '{{')."
      )
    what = f"the file {body}"
    with open(body, encoding="utf-8") as f:
      body = f.read()
  try:
    schema = json.loads(body)
  except json.JSONDecodeError as e:
    raise ValueError(f"config.constraint: {what} is not JSON ({e}).") from None
  if not isinstance(schema, dict):
    raise ValueError(f"config.constraint: {what} is not a JSON object (a schema).")
  return schema


def compile_rows(
  constraint: Constraint,
  tokenizer: Tokenizer,
  eos: Sequence[int] | None,
  vocab_size: int,
  batch: int,
) -> tuple[constraints.RowConstraints, int, list[int]]:
  """`(rules, states, eos)`: the same automaton on each of `batch` rows, its number
  of states, and the ids that end a constrained text: the tokenizer's specials
  (ids with no bytes, which the automaton can never spell) and the checkpoint's
  `eos` (host compilation; a ValueError naming config.constraint when no text
  this vocabulary spells matches)."""
  pieces = token_bytes(tokenizer)
  eos = sorted({i for i, piece in enumerate(pieces) if piece is None} | set(eos or ()))
  try:
    automaton = constraints.compile_constraint(constraint, pieces, eos, vocab_size)
  except ValueError as e:
    raise ValueError(f"config.constraint: {e}") from None
  return constraints.row_constraints([automaton] * batch, vocab_size), automaton.num_states, eos


def prompts(prompt_set: str, constraint_value: str, batch: int) -> list[str] | None:
  """`batch` prompts of `prompt_set` ("": the constraint's task, the signature
  prompts for "signature"), or None for the job's default (the held-out split)."""
  name = prompt_set or ("signature" if constraint_value == "signature" else "held_out")
  if name == "held_out":
    return None
  return [SIGNATURE_PROMPTS[i % len(SIGNATURE_PROMPTS)] for i in range(batch)]


def text_ids(tokens: Sequence[int], eos: Sequence[int]) -> tuple[list[int], bool]:
  """`(ids, ended)`: a row's generated ids without its final EOS, and whether it
  ended with one (a text cut off by the token budget is not complete)."""
  ids = [int(t) for t in tokens]
  ended = bool(ids) and ids[-1] in set(eos)
  return (ids[:-1] if ended else ids), ended


def satisfies(constraint: Constraint, text: str) -> bool:
  """Whether `text` (an output without its EOS) is in the constraint's language,
  checked independently of the automaton (see the module doc)."""
  if isinstance(constraint, constraints.Choice):
    return text in constraint.options
  if isinstance(constraint, constraints.Regex):
    return re.fullmatch(constraint.pattern, text) is not None
  try:
    value = json.loads(text)
  except json.JSONDecodeError:
    return False
  schema = (
    constraint.schema if isinstance(constraint.schema, dict) else json.loads(constraint.schema)
  )
  try:
    import jsonschema
  except ImportError:  # not a dependency of specjax: the schema's own language
    return re.fullmatch(constraints.to_regex(constraint), text) is not None
  return jsonschema.Draft202012Validator(schema).is_valid(value)


def checker(constraint: Constraint) -> str:
  """What `satisfies` checks `constraint` with (for the result file)."""
  if isinstance(constraint, constraints.JsonSchema):
    try:
      import jsonschema  # noqa: F401
    except ImportError:
      return "json.loads + the schema's regex (jsonschema not installed)"
    return "json.loads + jsonschema"
  return "re.fullmatch" if isinstance(constraint, constraints.Regex) else "one of the options"
