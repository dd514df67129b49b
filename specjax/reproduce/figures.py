"""The reproduction's figures (PNG, matplotlib: `pip install specjax[plots]`).

Each function draws one figure from `measure`'s rows into `path`: the closed
forms as curves, our measurements as points.
"""

from __future__ import annotations

import numpy as np

from specjax import theory


def pyplot():
  try:
    import matplotlib
  except ImportError as e:
    raise ImportError(
      "specjax's figures (the reproduction's, the decode table's plot) need matplotlib: "
      "pip install 'specjax[plots]' (the reproduction: or --config.figures=False for tables only)"
    ) from e
  matplotlib.use("Agg")  # files only, no display
  import matplotlib.pyplot as plt

  return plt


_MARKERS = {0.0: "o", 1.0: "^"}


def save_figure(fig, path: str) -> str:
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  fig.clf()
  return path


def tokens_per_iteration(rows: list[dict], drafter: str, path: str) -> str:
  """Leviathan Figure 2: E(α, γ) over α for several γ, with measured points."""
  plt = pyplot()
  fig, ax = plt.subplots(figsize=(6, 4.2))
  alphas = np.linspace(0, 0.99, 100)
  gammas = sorted({r["gamma"] for r in rows if r["drafter"] == drafter} | {1, 3, 5, 7, 10})
  colors = plt.cm.viridis(np.linspace(0, 0.9, len(gammas)))
  for g, color in zip(gammas, colors):
    ax.plot(
      alphas,
      [theory.expected_tokens_per_iteration(a, g) for a in alphas],
      color=color,
      label=f"γ = {g}",
    )
    for r in rows:
      if r["drafter"] == drafter and r["gamma"] == g and r["verifier"] == "auto":
        ax.plot(
          r["alpha"],
          r["tokens_per_iteration"],
          _MARKERS.get(r["temperature"], "s"),
          color=color,
          markeredgecolor="black",
          markersize=8,
        )
  ax.set_xlabel("α (acceptance rate)")
  ax.set_ylabel("tokens per iteration")
  ax.set_title(f"E(α, γ): curves; {drafter}: ○ T=0, △ T=1")
  ax.legend(fontsize=7, ncol=2)
  return save_figure(fig, path)


def speedup_vs_gamma(rows: list[dict], drafter: str, path: str) -> str:
  """Leviathan Figure 3: predicted speedup against γ for several c (at the
  measured α, T = 0, verification costing one step as in the paper), with the
  measured speedups and the prediction from measured α, c and verify cost."""
  plt = pyplot()
  fig, ax = plt.subplots(figsize=(6, 4.2))
  mine = [r for r in rows if r["drafter"] == drafter and r["verifier"] == "auto"]
  greedy = [r for r in mine if r["temperature"] == 0] or mine
  alpha = float(np.mean([r["alpha"] for r in greedy])) if greedy else 0.8
  gammas = np.arange(1, 11)
  cs = [0.01, 0.05, 0.1, 0.2, 0.5]
  if greedy:
    cs.append(round(float(np.mean([r["c"] for r in greedy])), 3))
  for c in cs:
    ax.plot(
      gammas,
      [theory.predicted_speedup(alpha, int(g), c) for g in gammas],
      label=f"c = {c:g}" + (" (ours)" if c == cs[-1] and greedy else ""),
    )
  for t in sorted({r["temperature"] for r in mine}):
    at = sorted((r for r in mine if r["temperature"] == t), key=lambda r: r["gamma"])
    ax.plot(
      [r["gamma"] for r in at], [r["speedup"] for r in at], _MARKERS.get(t, "s"), color="black"
    )
    # The prediction with every input measured: α, c and the verify cost v(γ).
    ax.plot(
      [r["gamma"] for r in at],
      [r["predicted_speedup"] for r in at],
      "k:",
      marker=_MARKERS.get(t, "s"),
      fillstyle="none",
      label=f"predicted, measured α, c, v (T = {t:g})",
    )
  ax.set_xlabel("γ")
  ax.set_ylabel("walltime improvement")
  ax.set_title(f"S(γ) at α = {alpha:.2f}; measured ({drafter}): ● T=0, ▲ T=1")
  ax.legend(fontsize=7)
  return save_figure(fig, path)


def ops_factor(path: str) -> str:
  """Leviathan Figure 4: the arithmetic-operations factor against γ (ĉ = 0)."""
  plt = pyplot()
  fig, ax = plt.subplots(figsize=(6, 4.2))
  gammas = np.arange(1, 11)
  for alpha in (0.5, 0.6, 0.7, 0.8, 0.9):
    ax.plot(
      gammas,
      [theory.arithmetic_ops_factor(alpha, int(g), 0.0) for g in gammas],
      label=f"α = {alpha}",
    )
  ax.set_xlabel("γ")
  ax.set_ylabel("arithmetic operations factor")
  ax.legend(fontsize=7)
  return save_figure(fig, path)


def predicted_vs_measured(rows: list[dict], path: str, band: float = 0.3) -> str:
  """Leviathan Table 4 as a scatter: measured against predicted, the ±band region."""
  plt = pyplot()
  fig, ax = plt.subplots(figsize=(5, 5))
  top = max([r["predicted_speedup"] for r in rows] + [r["speedup"] for r in rows] + [2.0]) * 1.1
  line = np.array([0, top])
  ax.plot(line, line, "k-", lw=1)
  ax.fill_between(
    line, line * (1 - band), line * (1 + band), color="grey", alpha=0.2, label=f"±{band:.0%}"
  )
  names = list(dict.fromkeys(r["drafter"] for r in rows))
  colors = dict(zip(names, plt.cm.tab10(np.arange(len(names)) % 10)))
  for r in rows:
    label = r["drafter"] if r["temperature"] == rows[0]["temperature"] else None
    ax.plot(
      r["predicted_speedup"],
      r["speedup"],
      _MARKERS.get(r["temperature"], "s"),
      color=colors[r["drafter"]],
      label=label,
    )
  ax.set_title("● T=0, ▲ T=1")
  ax.set_xlim(0, top)
  ax.set_ylim(0, top)
  ax.set_xlabel("predicted speedup")
  ax.set_ylabel("measured speedup")
  ax.legend(fontsize=7)
  return save_figure(fig, path)


def acceptance_by_position(rows: list[dict], drafter: str, path: str) -> str:
  """Chen et al.: P(token i accepted | token i - 1 accepted) by position."""
  plt = pyplot()
  fig, ax = plt.subplots(figsize=(6, 4.2))
  deepest = max((r["gamma"] for r in rows if r["drafter"] == drafter), default=1)
  for r in rows:
    if r["drafter"] == drafter and r["gamma"] == deepest and r["verifier"] == "auto":
      positions = np.arange(1, len(r["accepted_given_previous"]) + 1)
      ax.plot(
        positions,
        r["accepted_given_previous"],
        marker=_MARKERS.get(r["temperature"], "s"),
        label=f"T = {r['temperature']:g}, given the previous",
      )
      ax.plot(
        positions, r["accepted_through"], ls="--", label=f"T = {r['temperature']:g}, through it"
      )
  ax.set_xlabel("position in the draft")
  ax.set_ylabel("acceptance")
  ax.set_ylim(0, 1)
  ax.legend(fontsize=7)
  return save_figure(fig, path)


def speedup_vs_k(rows: list[dict], drafter: str, path: str) -> str:
  """Chen et al.: measured speedup against K (= γ)."""
  plt = pyplot()
  fig, ax = plt.subplots(figsize=(6, 4.2))
  for t in sorted({r["temperature"] for r in rows}):
    mine = sorted(
      (
        r
        for r in rows
        if r["drafter"] == drafter and r["temperature"] == t and r["verifier"] == "auto"
      ),
      key=lambda r: r["gamma"],
    )
    ax.plot(
      [r["gamma"] for r in mine],
      [r["speedup"] for r in mine],
      marker=_MARKERS.get(t, "s"),
      label=f"T = {t:g}",
    )
  ax.axhline(1.0, color="grey", lw=1)
  ax.set_xlabel("K (drafted tokens)")
  ax.set_ylabel("speedup over plain decoding")
  ax.legend(fontsize=7)
  return save_figure(fig, path)
