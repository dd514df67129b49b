"""A load test's report: a sweep's rows pooled, compared, tabulated and plotted.

  rows = load.sweep({"plain": plain_engine, "adaptive": engine}, requests, rates=(2, 4, 8))
  print(sweep_table(rows))             # markdown: per load and mode, then adaptive vs the best
  plot_sweep(rows, "load_sweep.png")   # throughput, p99 TTFT and TPOT against offered load

The rows are `specjax.bench.serving.load.sweep`'s (or a saved report's `runs`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from specjax.results import markdown_table
from specjax.serving.metrics import percentiles


def aggregate(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
  """One entry per (mode, rate) of a sweep's rows, its rounds pooled.

  Returns:
    `[{"mode", "rate", "rounds", "throughput_tok_s": [one per round],
    "acceptance_rate", "ttft_s", "tpot_s", "e2e_s"}]` in the rows' order of
    first appearance: the mean of the rounds' acceptance rates (None without
    drafting) and `percentiles` of every round's completed requests.
  """
  groups: dict[tuple[str, float], list[Mapping[str, Any]]] = {}
  for r in rows:
    groups.setdefault((r["mode"], r["rate"]), []).append(r)
  out = []
  for (mode, rate), runs in groups.items():
    done = [q for r in runs for q in r["requests"] if q["finish_reason"] in ("stop", "length")]
    alphas = [r["summary"]["acceptance_rate"] for r in runs]
    drafted = [a for a in alphas if a is not None]
    out.append(
      {
        "mode": mode,
        "rate": rate,
        "rounds": len(runs),
        "throughput_tok_s": [r["summary"]["throughput_tok_s"] for r in runs],
        "acceptance_rate": sum(drafted) / len(drafted) if drafted else None,
        **{k: percentiles([q[k] for q in done]) for k in ("ttft_s", "tpot_s", "e2e_s")},
      }
    )
  return out


def compare_modes(
  rows: Sequence[Mapping[str, Any]],
  mode: str = "adaptive",
  others: Sequence[str] = ("plain", "always"),
) -> list[dict[str, Any]]:
  """`mode`'s throughput against the better of `others`, paired round by round.

  The better one is the mode of `others` with the higher mean throughput over
  the rounds where every mode completed something: the better fixed policy at
  that load. (The largest of `others` in each round would not do: where two
  modes are about even, it picks each round's luckier run, and the largest of
  two noisy throughputs is biased high by about half a run's spread.)

  Returns:
    Per rate with every one of these modes measured, `{"rate", "best": its
    name, "ratios": [per round: mode's throughput / best's in that round],
    "mean", "stderr" (of the mean; 0 for one round), "low": mean - 2 stderr,
    "median", "min"}`; [] when a mode never ran.
  """
  wanted = (mode, *others)
  if not set(wanted) <= {r["mode"] for r in rows}:
    return []
  # A report from before rounds existed has one round a rate.
  by_run = {
    (r["rate"], r.get("round", 0), r["mode"]): r["summary"]["throughput_tok_s"] for r in rows
  }
  out = []
  for rate in sorted({r["rate"] for r in rows}):
    rounds = [
      round_
      for round_ in sorted({r.get("round", 0) for r in rows if r["rate"] == rate})
      if all((by_run.get((rate, round_, m)) or 0) > 0 for m in wanted)
    ]
    if not rounds:
      continue
    best = max(others, key=lambda m: np.mean([by_run[rate, r, m] for r in rounds]))
    ratios = np.array([by_run[rate, r, mode] / by_run[rate, r, best] for r in rounds])
    stderr = float(ratios.std(ddof=1) / np.sqrt(len(ratios))) if len(ratios) > 1 else 0.0
    out.append(
      {
        "rate": rate,
        "best": best,
        "ratios": ratios.tolist(),
        "mean": float(ratios.mean()),
        "stderr": stderr,
        "low": float(ratios.mean()) - 2 * stderr,
        "median": float(np.median(ratios)),
        "min": float(ratios.min()),
      }
    )
  return out


def _pyplot():
  try:
    import matplotlib
  except ImportError as e:
    raise ImportError(
      "the load sweep's figure needs matplotlib: pip install 'specjax[plots]'"
    ) from e
  matplotlib.use("Agg")  # files only, no display
  import matplotlib.pyplot as plt

  return plt


def plot_sweep(rows: Sequence[Mapping[str, Any]], path: str) -> str:
  """Three panels against offered load (requests/s), one line per mode:
  throughput (output tokens/s; the median round, bars from the slowest to the
  fastest when a rate ran several), p99 TTFT and median TPOT (of every
  round's requests). Writes a PNG to `path`."""
  plt = _pyplot()
  fig, axes = plt.subplots(1, 3, figsize=(14, 4))
  labels = (
    "throughput (output tokens/s)",
    "p99 time to first token (s)",
    "median time per output token (s)",
  )
  groups = aggregate(rows)
  rates = sorted({g["rate"] for g in groups})
  for mode in dict.fromkeys(g["mode"] for g in groups):
    mine = sorted((g for g in groups if g["mode"] == mode), key=lambda g: g["rate"])
    x = [g["rate"] for g in mine]
    # None (nothing completed) becomes NaN: a gap in the line.
    middle, low, high = (
      np.array([_nan(_middle(g["throughput_tok_s"], f)) for g in mine])
      for f in (np.median, min, max)
    )
    line = axes[0].plot(x, middle, marker="o", label=mode)[0]
    if any(g["rounds"] > 1 for g in mine):
      axes[0].errorbar(
        x, middle, yerr=[middle - low, high - middle], fmt="none", color=line.get_color(), capsize=3
      )
    axes[1].plot(x, [_nan(g["ttft_s"]["p99"]) for g in mine], marker="o", label=mode)
    axes[2].plot(x, [_nan(g["tpot_s"]["p50"]) for g in mine], marker="o", label=mode)
  for ax, label in zip(axes, labels):
    if rates and rates[-1] > 8 * rates[0]:  # a sweep over decades reads best on a log axis
      ax.set_xscale("log", base=2)
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)
  return path


def _middle(values, reduce):
  values = [v for v in values if v is not None]
  return float(reduce(values)) if values else None


def sweep_table(rows: Sequence[Mapping[str, Any]]) -> str:
  """A markdown table of a sweep: per offered load and mode, throughput (the
  median round, and the range when a rate ran several), TTFT and TPOT (p50 /
  p99 of every round's requests, milliseconds) and the acceptance rate; then,
  when plain, always and adaptive all ran, the adaptive policy's throughput
  against the better of the other two, round by round (`compare_modes`)."""
  groups = sorted(aggregate(rows), key=lambda g: g["rate"])
  text = markdown_table(groups, _SWEEP_COLUMNS)
  comparison = compare_modes(rows)
  if comparison:
    text += "\n\n" + markdown_table(comparison, _COMPARISON_COLUMNS)
  return text


def _ms(value) -> str:
  return "–" if value is None else f"{1e3 * value:.0f}"


def _tok_s(values) -> str:
  middle = _middle(values, np.median)
  if middle is None:
    return "–"
  if len(values) == 1:
    return f"{middle:.0f}"
  return f"{middle:.0f} ({_middle(values, min):.0f}–{_middle(values, max):.0f})"


def _p50_p99(field: str):
  return lambda g: f"{_ms(g[field]['p50'])} / {_ms(g[field]['p99'])}"


_SWEEP_COLUMNS = (
  ("load (req/s)", "{rate:g}"),
  ("mode", "{mode}"),
  ("throughput (tok/s)", lambda g: _tok_s(g["throughput_tok_s"])),
  ("TTFT p50 / p99 (ms)", _p50_p99("ttft_s")),
  ("TPOT p50 / p99 (ms)", _p50_p99("tpot_s")),
  ("acceptance", lambda g: "–" if g["acceptance_rate"] is None else f"{g['acceptance_rate']:.2f}"),
)
_COMPARISON_COLUMNS = (
  ("load (req/s)", "{rate:g}"),
  ("better fixed mode", "{best}"),
  ("adaptive / it, per round", lambda c: ", ".join(f"{x:.3f}" for x in c["ratios"])),
  ("mean ± s.e.", "{mean:.3f} ± {stderr:.3f}"),
  ("mean − 2 s.e.", "{low:.3f}"),
  ("lowest", "{min:.3f}"),
)


def _nan(value) -> float:
  return math.nan if value is None else float(value)
