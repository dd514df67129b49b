"""Paper reproduction: the papers' tables and figures regenerated on the bundled models.

  run.py       reproduce(config, output_dir): every section, report.md/json, PNGs
  measure.py   measured alpha, tokens/iteration, acceptance by position, c, speedups
  examples.py  worked examples and Sun et al.'s toy, sampled through the verifiers
  papers.py    the published numbers ours are put next to
  report.py    sections of tables with verdicts; markdown rendering
  figures.py   the closed forms as curves, our measurements as points (matplotlib)

The launcher is `python -m experiments.reproduce --output_dir=DIR [--quick]`.
"""
