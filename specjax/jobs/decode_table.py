"""A table of decode runs (`experiments/decode_table.py`, configs/decode_table.py).

Each row is `specjax.jobs.decode.run` with a few fields changed (e.g.
`--config=configs/decode_table.py:1b`). `COLUMNS` are the headline figures; the
JSON keeps every row's full result.
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
  if not isinstance(config.num_rows, int) or config.num_rows < 0:
    raise ValueError(f"config.num_rows must be an int >= 0 (0: all rows), got {config.num_rows!r}.")
  rows = config.rows[: config.num_rows or None]
  configs = [row_config(config, dict(changes)) for changes in rows]
  for c in configs:
    decode.check_config(c)
  results = []
  for i, (changes, c) in enumerate(zip(rows, configs), 1):
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
  """The speedup after the prefill over Leviathan's prediction (which has no prefill)."""
  predicted = r.get("predicted_speedup")
  return f"{r['decode_speedup'] / predicted:.2f}" if predicted else ""


COLUMNS = (
  ("dtype", "{dtype}"),
  ("draft dtype", "{draft_dtype}"),
  ("drafter", "{drafter}"),
  ("T", "{temperature:g}"),
  ("batch", "{batch_size}"),
  ("γ", "{gamma}"),
  ("verifier", "{verifier}"),
  ("constraint", lambda r: r.get("constraint") or ""),
  ("AR ms/tok", "{ar_ms_per_token:.1f}"),
  ("AR / floor", _optional("ar_over_floor", ".2f")),
  ("verify cost", _optional("verify_cost", ".2f")),
  ("c", _optional("draft_cost_ratio_c", ".3f")),
  ("α", "{acceptance_rate:.3f}"),
  ("tok/iter", "{tokens_per_iteration:.2f}"),
  ("spec ms/tok", "{spec_ms_per_token:.1f}"),
  ("speedup", "{speedup:.2f}"),
  ("after prefill", _optional("decode_speedup", ".2f")),
  ("predicted", _optional("predicted_speedup", ".2f")),
  ("measured / predicted", _measured_over_predicted),
  ("valid", _optional("valid_fraction", ".2f")),  # outputs that satisfy the constraint
  ("mask ms/iter", _optional("mask_ms_per_iteration", ".3f")),
  ("mask / iter", _optional("mask_fraction", ".3f")),
  ("greedy identical", lambda r: "" if "texts_identical" not in r else str(r["texts_identical"])),
  ("HF ms/tok", _optional("hf_ms_per_token", ".1f")),
  ("HF assisted ms/tok", _optional("hf_assisted_ms_per_token", ".1f")),
  ("peak GB", "{peak_memory_gb:.1f}"),
)


def markdown(rows: list[dict[str, Any]]) -> str:
  """The rows as a markdown table of `COLUMNS`."""
  return markdown_table(rows, COLUMNS)


def plot_speedup_by_size(rows: list[dict[str, Any]], path: str) -> str:
  """Measured speedup against target parameters (log scale), one line per
  (temperature, drafter), with Leviathan's prediction from each row's measured
  α, c and verify cost beside it; a PNG at `path` (matplotlib)."""
  from specjax.reproduce.figures import pyplot, save_figure

  plt = pyplot()
  fig, ax = plt.subplots(figsize=(6.4, 4.2))
  groups: dict[tuple, list[dict]] = {}
  for r in rows:
    groups.setdefault((r["temperature"], r["drafter"], r["dtype"]), []).append(r)
  for (temperature, drafter, dtype), group in sorted(groups.items()):
    group = sorted(group, key=lambda r: r["target_params"])
    sizes = [r["target_params"] for r in group]
    label = f"{drafter}, T={temperature:g}, {dtype}"
    line = ax.plot(sizes, [r["speedup"] for r in group], "o-", label=f"measured: {label}")
    predicted = [
      (n, r["predicted_speedup"]) for n, r in zip(sizes, group) if r.get("predicted_speedup")
    ]
    if predicted:
      ax.plot(*zip(*predicted), "x--", color=line[0].get_color(), label=f"predicted: {label}")
    for n, r in zip(sizes, group):
      ax.annotate(
        r.get("scale") or "bundled",
        (n, r["speedup"]),
        textcoords="offset points",
        xytext=(4, -12),
        fontsize=8,
      )
  ax.axhline(1.0, color="grey", lw=0.8)
  ax.set_xscale("log")
  ax.set_xlabel("target parameters")
  ax.set_ylabel("speedup over autoregressive decoding")
  first = rows[0]
  ax.set_title(
    f"{first.get('cpu_model', '')} ({first.get('cpu_count', '?')} cores), batch 1", fontsize=9
  )
  ax.legend(fontsize=7)
  return save_figure(fig, path)
