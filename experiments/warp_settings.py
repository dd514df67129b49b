"""Speedups with each sampling setting on and off, on the bundled pair (issue 65, req. 5).

  python -m experiments.warp_settings [--prompts=2] [--max_new_tokens=48]
      [--settings=off,min_p] [--temperatures=0,1] [--gamma=4] [--num_runs=3]
      [--output_json=PATH] [--output_md=PATH]

Each setting alone (presence, frequency and repetition penalties, logit_bias,
min_p, min_tokens, stop_token_ids) and all of them together, against all off,
plain and speculative (the bundled draft model), each held-out prompt alone
(`specjax.bench.warps.setting_speedups`). Prints the JSON (with the machine and
date), then a markdown table.
"""

from __future__ import annotations

import json

from absl import flags

from experiments import common
from specjax import pretrained
from specjax.bench import warps
from specjax.bench.timing import environment_info
from specjax.data.prompts import encode_prompts, held_out_prompts
from specjax.hf import generation_settings
from specjax.results import markdown_table, write_json, write_text
from specjax.validation import check_output_path, check_positive_int


def main(argv):
  common.check_no_args(argv)
  f = flags.FLAGS
  output_json = check_output_path("--output_json", f.output_json)
  output_md = check_output_path("--output_md", f.output_md)
  try:
    temperatures = tuple(float(t) for t in f.temperatures.split(","))
  except ValueError:
    raise ValueError(f"--temperatures must be numbers >= 0, got {f.temperatures!r}.") from None
  count = check_positive_int("--prompts", f.prompts)
  names = (*warps.SETTINGS, "logit_bias", "stop_token_ids", "all")
  chosen = [n for n in f.settings.split(",") if n] or list(names)
  unknown = [n for n in chosen if n not in names]
  if unknown:
    raise ValueError(f"--settings must name some of {', '.join(names)}; got {unknown}.")
  target, draft, tokenizer = pretrained.load_pair()
  eos = tuple(generation_settings(pretrained.TARGET_DIR).eos_ids) or None
  # Token ids for the id-valued settings: a newline favoured, a common word banned.
  newline, word = tokenizer.encode("\n")[-1], tokenizer.encode(" self")[-1]
  settings = dict(warps.SETTINGS)
  settings["logit_bias"] = {"logit_bias": {newline: 2.0, word: -100.0}}
  settings["stop_token_ids"] = {"stop_token_ids": (word,)}
  settings["all"] = {
    k: v for name, fields in settings.items() if name != "stop_token_ids" for k, v in fields.items()
  }
  settings = {n: settings[n] for n in chosen}
  prompts, lengths = encode_prompts(tokenizer, held_out_prompts(count), name="--prompts")
  rows = warps.setting_speedups(
    target, draft, prompts, lengths, settings, temperatures=temperatures,
    gamma=check_positive_int("--gamma", f.gamma),
    max_new_tokens=check_positive_int("--max_new_tokens", f.max_new_tokens),
    eos_id=eos, num_runs=check_positive_int("--num_runs", f.num_runs),
  )  # fmt: skip
  for row in rows:  # JSON keys must be strings
    if "logit_bias" in row:
      row["logit_bias"] = {str(k): v for k, v in row["logit_bias"].items()}
  result = {"drafter": "bundled draft model", "rows": rows, **environment_info()}
  print(json.dumps(result, indent=2))
  table = markdown_table(rows, warps.SETTING_COLUMNS)
  print(table)
  write_json(output_json, result)
  write_text(output_md, table)


def define_flags() -> None:
  """Defines this launcher's flags (called only when run as a script; see experiments.common)."""
  flags.DEFINE_integer("prompts", 2, "Held-out prompts, each decoded alone.")
  flags.DEFINE_string("settings", "", "Comma list of the settings to run (default: all).")
  flags.DEFINE_string("temperatures", "0,1", "Comma list of temperatures (0: greedy).")
  flags.DEFINE_integer("gamma", 4, "Draft length.")
  flags.DEFINE_integer("max_new_tokens", 48, "Token budget per prompt.")
  flags.DEFINE_integer("num_runs", 3, "Timed runs of each setting (median).")
  common.define_output_flags(markdown=True)


if __name__ == "__main__":
  define_flags()
  common.run(main)
