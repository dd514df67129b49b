"""Drafts the grammar forces, measured on the bundled JSON task (issue 65, req. 3).

  python -m experiments.forced_drafts [--drafters=model,eagle,ngram]
      [--temperatures=0,1] [--gamma=4] [--max_new_tokens=64] [--num_runs=3]
      [--output_json=PATH] [--output_md=PATH]

The bundled pair under the signature schema (`specjax.jobs.structured`), its four
prompts as one batch of 4 (or --batch rows of them), each drafter with forced
drafts off and on against plain constrained decoding
(`specjax.bench.forced.forced_drafts_rows`). Prints the JSON (with the machine
and date), then a markdown table.
"""

from __future__ import annotations

import json

from absl import flags

from experiments import common
from specjax import pretrained
from specjax.bench import forced
from specjax.bench.timing import environment_info
from specjax.data.prompts import encode_prompts
from specjax.hf import generation_settings
from specjax.jobs import structured
from specjax.results import write_json, write_text
from specjax.validation import check_output_path, check_positive_int

DRAFTERS = ("model", "eagle", "ngram")


def main(argv):
  common.check_no_args(argv)
  f = flags.FLAGS
  output_json = check_output_path("--output_json", f.output_json)
  output_md = check_output_path("--output_md", f.output_md)
  names = [n for n in f.drafters.split(",") if n]
  if not names or any(n not in DRAFTERS for n in names):
    raise ValueError(f"--drafters must be a comma list of {DRAFTERS}, got {f.drafters!r}.")
  try:
    temperatures = [float(t) for t in f.temperatures.split(",")]
  except ValueError:
    raise ValueError(f"--temperatures must be numbers >= 0, got {f.temperatures!r}.") from None
  batch = check_positive_int("--batch", f.batch)
  target, draft, tokenizer = pretrained.load_pair()
  drafters = {n: draft if n == "model" else pretrained.load_drafter(n, target) for n in names}
  eos = list(generation_settings(pretrained.TARGET_DIR).eos_ids)
  schema = structured.parse("signature")
  rules, states, eos = structured.compile_rows(schema, tokenizer, eos, target.cfg.vocab_size, batch)
  texts = structured.prompts("signature", "signature", batch)
  prompts, lengths = encode_prompts(tokenizer, texts)
  rows = forced.forced_drafts_rows(
    target, drafters, prompts, lengths, rules, eos, temperatures=temperatures,
    gamma=check_positive_int("--gamma", f.gamma),
    max_new_tokens=check_positive_int("--max_new_tokens", f.max_new_tokens),
    num_runs=check_positive_int("--num_runs", f.num_runs),
  )  # fmt: skip
  result = {"task": "signature schema", "automaton_states": states, "rows": rows}
  result.update(environment_info())
  print(json.dumps(result, indent=2))
  table = forced.markdown(rows)
  print(table)
  write_json(output_json, result)
  write_text(output_md, table)


def define_flags() -> None:
  """Defines this launcher's flags (called only when run as a script; see experiments.common)."""
  flags.DEFINE_string("drafters", ",".join(DRAFTERS), f"Comma list of {DRAFTERS}.")
  flags.DEFINE_string("temperatures", "0,1", "Comma list of temperatures (0: greedy).")
  flags.DEFINE_integer("gamma", 4, "Draft length.")
  flags.DEFINE_integer("batch", 4, "Rows (the signature prompts, cycled).")
  flags.DEFINE_integer("max_new_tokens", 64, "Token budget per row.")
  flags.DEFINE_integer("num_runs", 3, "Timed runs of each setting (median).")
  common.define_output_flags(markdown=True)


if __name__ == "__main__":
  define_flags()
  common.run(main)
