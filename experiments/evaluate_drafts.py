"""Compare drafts against one target: teacher-forced α and α in real decoding.

  python -m experiments.evaluate_drafts --target=runs/target \
      --drafts=runs/draft_ce,runs/draft_kl,runs/draft_tv --data_dir=runs/data

For each draft run: teacher-forced α at temperature 0 and 1 and cross-entropy
on validation windows; acceptance rate and tokens/iteration of speculative
decoding (γ=--gamma) on --num_prompts held-out test-split prompts at
temperature 0 and 1. Prints JSON and a markdown table.
"""

from __future__ import annotations

import json
import os

from absl import flags

from experiments import common
from specjax.data import TokenDataset, Tokenizer
from specjax.data.dataset import check_data_dir, check_tokenizer
from specjax.data.prompts import encode_prompts, held_out_prompts
from specjax.results import markdown_table, write_json
from specjax.training import evaluate
from specjax.training.checkpoint import check_run, load_trained_model
from specjax.validation import check_output_path, check_positive_int

COLUMNS = (
  ("draft", lambda r: os.path.basename(r["draft"].rstrip("/"))),
  ("val CE", "{draft_ce:.3f}"),
  ("α T=0 (teacher-forced)", "{alpha_t0:.3f}"),
  ("α T=1 (teacher-forced)", "{alpha_t1:.3f}"),
  ("α T=0 (decode)", "{decode_alpha_t0:.3f}"),
  ("α T=1 (decode)", "{decode_alpha_t1:.3f}"),
  ("tokens/iter T=0", "{decode_tokens_per_iter_t0:.2f}"),
  ("tokens/iter T=1", "{decode_tokens_per_iter_t1:.2f}"),
)


def compare(
  target_run: str,
  draft_runs: list[str],
  data_dir: str,
  gamma: int = 4,
  num_prompts: int = 8,
  max_new_tokens: int = 64,
  num_batches: int = 8,
) -> list[dict]:
  """One result dict per draft run.

  Every run and the data directory are checked first (a missing one is one
  line naming its flag), before any model loads.
  """
  check_run(target_run, "--target")
  for run in draft_runs:
    check_run(run, "--drafts")
  check_data_dir(data_dir, "--data_dir", ("tokenizer.json", "validation.bin", "validation.json"))
  target, _ = load_trained_model(target_run, dtype="float32")
  tokenizer = Tokenizer.from_file(os.path.join(data_dir, "tokenizer.json"))
  validation_path = os.path.join(data_dir, "validation.bin")
  check_tokenizer(validation_path, tokenizer)  # token files of another tokenizer: an error
  validation = TokenDataset(validation_path)
  prompts, lengths = encode_prompts(tokenizer, held_out_prompts(num_prompts))
  rows = []
  for run in draft_runs:
    draft, step = load_trained_model(run, dtype="float32")
    row = {
      "draft": run,
      "step": step,
      "draft_params": draft.num_params,
      **evaluate.teacher_forced_agreement(target, draft, validation, num_batches=num_batches),
    }
    for temperature in (0.0, 1.0):
      r = evaluate.decoding_acceptance(
        target, draft, prompts, lengths, temperature, gamma, max_new_tokens
      )
      row[f"decode_alpha_t{temperature:g}"] = r["acceptance_rate"]
      row[f"decode_tokens_per_iter_t{temperature:g}"] = r["tokens_per_iteration"]
    rows.append(row)
  return rows


def markdown(rows: list[dict]) -> str:
  """The rows as a markdown table, one line per draft."""
  return markdown_table(rows, COLUMNS)


def main(argv):
  common.check_no_args(argv)
  f = flags.FLAGS
  output_json = check_output_path("--output_json", f.output_json)
  for name in ("gamma", "num_prompts", "max_new_tokens"):
    check_positive_int(f"--{name}", f[name].value)
  rows = compare(f.target, f.drafts, f.data_dir, f.gamma, f.num_prompts, f.max_new_tokens)
  print(json.dumps(rows, indent=2))
  print(markdown(rows))
  write_json(output_json, rows)


def define_flags() -> None:
  """Defines this launcher's flags (called only when run as a script; see experiments.common)."""
  flags.DEFINE_string("target", None, "Run directory of the target.", required=True)
  flags.DEFINE_list("drafts", None, "Run directories of the drafts.", required=True)
  flags.DEFINE_string("data_dir", None, "Data directory (tokenizer.json, *.bin).", required=True)
  flags.DEFINE_integer("gamma", 4, "Draft length.")
  flags.DEFINE_integer("num_prompts", 8, "Test-split prompts decoded as one batch.")
  flags.DEFINE_integer("max_new_tokens", 64, "Tokens generated per prompt.")
  common.define_output_flags()


if __name__ == "__main__":
  define_flags()
  common.run(main)
