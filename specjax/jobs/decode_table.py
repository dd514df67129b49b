"""A table of decode runs (`experiments/decode_table.py`, configs/decode_table.py).

Each row is the main job (`specjax.jobs.decode.run`) with a few of its fields
changed (dtype, temperature, drafter, batch, the transformers comparison), so
one command gives the figures of several settings side by side, e.g. the
scaled pair's memory-bound table (`--config=configs/decode_table.py:1b`).
`COLUMNS` are the table's headline figures; the JSON keeps every row's full
result.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import ml_collections

from specjax.jobs import decode
from specjax.results import markdown_table


def row_config(config: ml_collections.ConfigDict, changes: dict) -> ml_collections.ConfigDict:
  """`config.decode` with row `changes` applied; a field decode does not have is
  a ValueError naming it."""
  out = config.decode.copy_and_resolve_references()
  unknown = sorted(set(changes) - set(out.keys()))
  if unknown:
    raise ValueError(f"config.rows: {unknown} are not fields of configs/decode.py.")
  out.update(changes)
  return out


def run(config: ml_collections.ConfigDict, *, progress: bool = False) -> list[dict[str, Any]]:
  """Decodes each row of `config.rows`; returns their results in order. Every
  row's config is checked before the first one runs."""
  if not config.rows:
    raise ValueError("config.rows must name at least one row.")
  configs = [row_config(config, dict(changes)) for changes in config.rows]
  for c in configs:
    decode.check_config(c)
  results = []
  for i, (changes, c) in enumerate(zip(config.rows, configs), 1):
    start = time.perf_counter()
    if progress:
      print(f"[{i}/{len(configs)}] {dict(changes)}", file=sys.stderr, flush=True)
    results.append({"changes": dict(changes), **decode.run(c)})
    if progress:
      r = results[-1]
      print(
        f"    speedup {r['speedup']:.2f} in {time.perf_counter() - start:.0f} s",
        file=sys.stderr,
        flush=True,
      )
  return results


def _optional(key: str, spec: str):
  return lambda r: "" if r.get(key) is None else format(r[key], spec)


def _measured_over_predicted(r: dict) -> str:
  predicted = r.get("predicted_speedup")
  return f"{r['speedup'] / predicted:.2f}" if predicted else ""


COLUMNS = (
  ("dtype", "{dtype}"),
  ("drafter", "{drafter}"),
  ("T", "{temperature:g}"),
  ("batch", "{batch_size}"),
  ("γ", "{gamma}"),
  ("AR ms/tok", "{ar_ms_per_token:.1f}"),
  ("AR / floor", _optional("ar_over_floor", ".2f")),
  ("verify cost", _optional("verify_cost", ".2f")),
  ("c", _optional("draft_cost_ratio_c", ".3f")),
  ("α", "{acceptance_rate:.3f}"),
  ("tok/iter", "{tokens_per_iteration:.2f}"),
  ("spec ms/tok", "{spec_ms_per_token:.1f}"),
  ("speedup", "{speedup:.2f}"),
  ("predicted", _optional("predicted_speedup", ".2f")),
  ("measured / predicted", _measured_over_predicted),
  ("greedy identical", lambda r: "" if "texts_identical" not in r else str(r["texts_identical"])),
  ("HF ms/tok", _optional("hf_ms_per_token", ".1f")),
  ("HF assisted ms/tok", _optional("hf_assisted_ms_per_token", ".1f")),
  ("peak GB", "{peak_memory_gb:.1f}"),
)


def markdown(rows: list[dict[str, Any]]) -> str:
  """The rows as a markdown table of `COLUMNS`."""
  return markdown_table(rows, COLUMNS)
