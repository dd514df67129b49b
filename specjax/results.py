"""Where a job's results go: JSON and text files, and markdown tables of its rows."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

# A markdown column: (header, cell). A cell is a `str.format` template over the
# row's keys ("{speedup:.2f}") or a function from the row to the cell's text.
Column = tuple[str, str | Callable[[Mapping[str, Any]], str]]


def write_text(path: str | None, text: str) -> None:
  """Writes `text` and a final newline to `path`; does nothing when `path` is empty."""
  if path:
    with open(path, "w") as f:
      f.write(text + "\n")


def write_json(path: str | None, result: Any) -> None:
  """Writes `result` as indented JSON to `path`; does nothing when `path` is empty."""
  write_text(path, json.dumps(result, indent=2))


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[Column]) -> str:
  """A GitHub markdown table of `rows`, one line each, one cell per column.

  Args:
    rows: the records (e.g. a launcher's JSON rows).
    columns: `(header, cell)` pairs; `cell` is a `str.format` template over a
      row's keys, e.g. `"{acceptance_rate:.3f}"`, or a function row -> text.
  """
  lines = ["| " + " | ".join(header for header, _ in columns) + " |", "|" + "---|" * len(columns)]
  for row in rows:
    cells = [cell(row) if callable(cell) else cell.format_map(row) for _, cell in columns]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)
