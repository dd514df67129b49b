"""Constraint tables' memory: dense `[S, V]` against the token-class layout.

For realistic JSON schemas over the bundled 4,096-id vocabulary and, given a
path to one, a 131,072-id vocabulary (Mistral's Tekken, shipped in the
`mistral-common` wheel on PyPI; nothing is downloaded at run time):

  pip download mistral-common --no-deps -d /tmp/tekken
  unzip -o /tmp/tekken/mistral_common-*.whl 'mistral_common/data/tekken_240911.json' -d /tmp/tekken
  python -c "from specjax.bench import constraint_memory as m; print(m.markdown(m.table(
      '/tmp/tekken/mistral_common/data/tekken_240911.json')))"

Each row: compile time (outlines-core's index and our token classes), states,
token classes, allowed (state, token) pairs, and the bytes of the dense table,
of the class layout as `row_constraints` builds it, and of a bitmask layout
(allowed bits per state, each state's most common next state, the other
transitions as sorted (id, next) pairs) for comparison.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Sequence

import numpy as np

from specjax import constraints
from specjax.results import markdown_table

# A tool call's signature (the usage guide's example and the decode job's
# `signature` task, `specjax.jobs.structured`) and a user record with
# the usual field kinds: integers, numbers, booleans, bounded and patterned
# strings, an enum, a nested object and an array.
SCHEMAS = {
  "signature": {
    "type": "object",
    "properties": {
      "name": {"type": "string", "maxLength": 12},
      "args": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "args"],
  },
  "record": {
    "type": "object",
    "properties": {
      "id": {"type": "integer"},
      "name": {"type": "string", "maxLength": 32},
      "email": {"type": "string", "pattern": "[a-z0-9.]{1,20}@[a-z0-9]{1,12}\\.(com|org|net)"},
      "role": {"type": "string", "enum": ["admin", "editor", "viewer", "guest"]},
      "active": {"type": "boolean"},
      "score": {"type": "number"},
      "address": {
        "type": "object",
        "properties": {
          "street": {"type": "string"},
          "city": {"type": "string", "maxLength": 24},
          "zip": {"type": "string", "pattern": "[0-9]{5}"},
        },
        "required": ["street", "city", "zip"],
      },
      "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 5},
    },
    "required": ["id", "name", "email", "role", "active", "score", "address", "tags"],
  },
}


def tekken_token_bytes(path: str) -> list[bytes | None]:
  """Each id's bytes in a Tekken tokenizer file (`mistral-common`'s data/*.json):
  the special tokens first (None), then the byte-level BPE ranks."""
  with open(path) as f:
    data = json.load(f)
  config = data["config"]
  specials, size = config["default_num_special_tokens"], config["default_vocab_size"]
  ranks = data["vocab"][: size - specials]
  return [None] * specials + [base64.b64decode(r["token_bytes"]) for r in ranks]


def bitmask_bytes(automaton: constraints.Automaton) -> int:
  """Bytes of the bitmask layout: `[S, V/32]` uint32 allowed bits, `[S]` most
  common next state, `[S + 1]` segment starts and 8 bytes per other transition."""
  sizes = np.bincount(automaton.token_class, minlength=automaton.num_classes)
  exceptions = 0
  for row in automaton.class_next:
    ok = row >= 0
    counts = np.bincount(row[ok], weights=sizes[ok]) if ok.any() else np.zeros(1)
    exceptions += int(sizes[ok].sum() - counts.max())
  s, v = automaton.num_states, automaton.vocab_size
  return s * ((v + 31) // 32) * 4 + s * 4 + (s + 1) * 4 + exceptions * 8


def measure(vocab: str, token_bytes: Sequence[bytes | None], vocab_size: int, schema: str) -> dict:
  """One row: `SCHEMAS[schema]` compiled over `token_bytes` (EOS: the None ids)."""
  eos = [i for i, b in enumerate(token_bytes[:vocab_size]) if b is None]
  start = time.perf_counter()
  automaton = constraints.compile_constraint(
    constraints.JsonSchema(SCHEMAS[schema]), token_bytes, eos, vocab_size
  )
  compile_ms = (time.perf_counter() - start) * 1e3
  report = constraints.memory_report(automaton)
  return {
    "vocab": vocab,
    "schema": schema,
    "compile_ms": compile_ms,
    **report,
    "bitmask_bytes": bitmask_bytes(automaton),
  }


def table(tekken: str | None = None) -> list[dict]:
  """Rows for both schemas over the bundled vocabulary and, with `tekken` (a
  path, see the module doc), over Tekken's 131,072 ids."""
  from specjax import pretrained
  from specjax.vocab_map import token_bytes

  target, _, tok = pretrained.load_pair()
  vocabularies = [("bundled", token_bytes(tok), target.cfg.vocab_size)]
  if tekken:
    pieces = tekken_token_bytes(tekken)
    vocabularies.append(("tekken", pieces, len(pieces)))
  return [
    measure(name, pieces, size, schema) for name, pieces, size in vocabularies for schema in SCHEMAS
  ]


def _mb(key: str):
  return lambda row: f"{row[key] / 2**20:.2f} MiB"


COLUMNS = (
  ("vocabulary", lambda row: f"{row['vocab']} ({row['vocab_size']:,})"),
  ("schema", "{schema}"),
  ("compile", "{compile_ms:,.0f} ms"),
  ("states", "{states:,}"),
  ("classes", "{classes:,}"),
  ("transitions", "{transitions:,}"),
  ("dense [S, V]", _mb("dense_bytes")),
  ("classes [S, C] + [V]", _mb("sparse_bytes")),
  ("bitmask + exceptions", _mb("bitmask_bytes")),
)


def markdown(rows: list[dict]) -> str:
  """The rows as a markdown table."""
  return markdown_table(rows, COLUMNS)
