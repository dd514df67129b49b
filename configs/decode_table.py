"""Configuration of `experiments/decode_table.py`: several decode runs, one table.

  python -m experiments.decode_table                                # bundled pair, T = 0 and 1
  python -m experiments.decode_table --config=configs/decode_table.py:1b \
      --output_json=runs/table_1b.json --output_md=runs/table_1b.md

`decode` is the main job's configuration (configs/decode.py) shared by every
row; `rows` are the fields each row changes. The `1b` preset is the scaled
pair's memory-bound table (docs/performance.md): the bundled pair grown to a
TinyLlama-1.1B-shaped target and a 68M-shaped draft, in float32 and bfloat16,
at temperature 0 and 1, with the EAGLE head, at batch 4 and 16, and beside
transformers' generate on the same weights. It needs about 10 GB of memory and
about 40 minutes on a 2-core CPU. The `sizes` preset decodes the pair as trained,
grown to 160m and to 1b (float32, a bfloat16 draft, T = 0); `--output_plot=PATH` draws speedup
against target size with Leviathan's prediction (docs/performance.md). The
`coupling` preset sets the coupled verifier beside the token rule (draft model
and EAGLE head, T = 0.7 and 1) on the bundled pair, `coupling_1b` at the 1b
shape with a bfloat16 draft (docs/usage.md, "Same seed, same text"). The
`constrained` preset decodes the bundled signature task (a def described as
JSON, `specjax.jobs.structured`) with and without its schema, draft model and
EAGLE head, T = 0 and 1: speedup, acceptance and the mask's cost under the
constraint beside the same prompts unconstrained (about 6 minutes here).
"""

from __future__ import annotations

import ml_collections

from configs import decode

PRESETS = ("1b", "sizes", "coupling", "coupling_1b", "constrained")


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
  """The table's configuration; `preset` "1b" gives the scaled pair's table,
  "sizes" the same pair at three sizes (bundled, 160m, 1b) for the plot of
  speedup against target size (`--output_plot`)."""
  if preset and preset not in PRESETS:
    raise ValueError(f"preset must be one of {PRESETS} (or none), got {preset!r}.")
  c = ml_collections.ConfigDict()
  c.decode = decode.get_config()
  c.rows = (dict(temperature=0.0), dict(temperature=1.0))
  c.num_rows = 0  # decode only the first N rows (0: all of them)
  if preset == "1b":
    c.decode.scale = "1b"
    mixed = dict(dtype="float32", draft_dtype="bfloat16")  # half the draft's bytes
    c.rows = (
      dict(dtype="float32", temperature=0.0),  # = python -m experiments.decode --config.scale=1b
      dict(dtype="float32", temperature=1.0),
      dict(mixed, temperature=0.0),
      dict(mixed, temperature=1.0),
      dict(mixed, temperature=0.0, drafter="eagle"),
      dict(mixed, temperature=1.0, drafter="eagle"),
      dict(dtype="bfloat16", temperature=0.0, compare_transformers=True, stop_at_eos=False),
      dict(dtype="bfloat16", temperature=1.0),
      dict(mixed, temperature=0.0, batch_size=4),
      dict(mixed, temperature=0.0, batch_size=16),
    )
  if preset == "sizes":
    c.rows = tuple(dict(scale=scale, draft_dtype="bfloat16") for scale in ("", "160m", "1b"))
  if preset in ("coupling", "coupling_1b"):
    # The coupled verifier (Gumbel-max; the text a function of the seed) against
    # the token rule, with the draft model and the EAGLE head, at T = 0.7 and 1.
    # 256 tokens: acceptance over one prompt's text is noisy at 64.
    c.decode.max_new_tokens = 256
    if preset == "coupling_1b":
      c.decode.scale = "1b"
      c.decode.draft_dtype = "bfloat16"
      c.decode.max_new_tokens = 128
    c.rows = tuple(
      dict(temperature=t, drafter=d, verifier=v)
      for d in ("model", "eagle")
      for t in (0.7, 1.0)
      for v in ("token", "coupled")
    )
  if preset == "constrained":
    # The first signature prompt at batch 1, as the main job decodes (at batch 4,
    # gamma 4 makes this CPU-bound target slower than plain decoding), each row
    # with and without the schema; 64 tokens hold every schema text (at most
    # about 70 characters) before its EOS.
    c.decode.prompt_set = "signature"
    c.decode.num_runs = 5
    c.decode.report_floor = False
    c.rows = tuple(
      dict(temperature=t, drafter=d, constraint=constraint)
      for d in ("model", "eagle")
      for t in (0.0, 1.0)
      for constraint in ("", "signature")
    )
  return c
