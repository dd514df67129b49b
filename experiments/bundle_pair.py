"""Export trained target and draft runs into the package as the bundled pair.

  python -m experiments.bundle_pair --target=runs/target --draft=runs/draft_kl \
      --data_dir=runs/data [--out=specjax/pretrained/stdlib_pair]

Writes bfloat16 Hugging Face Llama checkpoints `target/` and `draft/`, the
shared `tokenizer.json`, and `card.json`: each run's train config, steps,
tokens seen, final validation perplexity and wall time, plus the corpus
statistics, so the model card (docs/bundled_pair.md) can be checked against the files, and
the sha256 of every bundled file, which `specjax.pretrained.load_pair` verifies.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

from absl import flags

from experiments import common
from specjax import pretrained
from specjax.data import SPLITS, Tokenizer
from specjax.data.dataset import check_data_dir
from specjax.hf.export import save_model
from specjax.training.checkpoint import (
  CHECKPOINT_DIR,
  HEAD_CONFIG_FILE,
  MODEL_CONFIG_FILE,
  check_run,
  load_trained_model,
)


def run_record(run: str) -> dict:
  """What the card says about one training run, read from its directory."""
  with open(os.path.join(run, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  evals = [r for r in records if "val_ce" in r]
  steps = [r for r in records if "tokens_seen" in r]
  last_step = max(int(d) for d in os.listdir(os.path.join(run, CHECKPOINT_DIR)) if d.isdigit())
  with open(os.path.join(run, CHECKPOINT_DIR, str(last_step), "meta", "metadata")) as f:
    meta = json.load(f)
  # The run's config file (model_config.json, or head_config.json for a head) is
  # written when a run starts (again at each resume: a resumed run's first logged
  # step is earlier), the last checkpoint when it ends.
  config_file = os.path.join(run, MODEL_CONFIG_FILE)
  if not os.path.exists(config_file):
    config_file = os.path.join(run, HEAD_CONFIG_FILE)
  started = min([os.path.getmtime(config_file), *(r["time"] for r in records if "time" in r)])
  ended = os.path.getmtime(os.path.join(run, CHECKPOINT_DIR, str(last_step)))
  return {
    "steps": last_step,
    "tokens_seen": meta["tokens_seen"],
    "config": meta["config"],
    "final_eval": evals[-1] if evals else None,
    "tokens_per_second": steps[-1].get("tokens_per_second") if steps else None,
    "wall_seconds": round(ended - started, 1),
  }


def run_lineage(run: str) -> dict:
  """`run_record(run)` with "run", and for a fine-tuned run the runs it started
  from, phase by phase, under "init_from"."""
  record = {"run": run, **run_record(run)}
  entry = record
  while entry["config"].get("init_from"):
    parent = entry["config"]["init_from"]
    entry["init_from"] = {"run": parent, **run_record(parent)}
    entry = entry["init_from"]
  return record


def bundle(target_run: str, draft_run: str, data_dir: str, out: str) -> dict:
  """Writes the pair of `target_run` and `draft_run` into `out`; returns its card.

  The runs and the data directory are checked first, each error naming its flag.
  """
  check_run(target_run, "--target")
  check_run(draft_run, "--draft")
  check_data_dir(data_dir, "--data_dir", ("tokenizer.json", *(f"{split}.json" for split in SPLITS)))
  os.makedirs(out, exist_ok=True)
  tokenizer = Tokenizer.from_file(os.path.join(data_dir, "tokenizer.json"))
  card = {"python": sys.version.split()[0], "corpus": {}}
  for split in SPLITS:
    with open(os.path.join(data_dir, f"{split}.json")) as f:
      card["corpus"][split] = json.load(f)
  for name, run in (("target", target_run), ("draft", draft_run)):
    model, _ = load_trained_model(run, dtype="float32")
    save_model(
      model,
      os.path.join(out, name),
      dtype="bfloat16",
      bos_id=tokenizer.bos_id,
      eos_id=tokenizer.eos_id,
      pad_id=tokenizer.pad_id,
    )
    card[name] = {"params": model.num_params, **run_lineage(run)}
    os.chmod(os.path.join(out, name, "model.safetensors"), 0o644)  # safetensors writes 0600
  shutil.copyfile(os.path.join(data_dir, "tokenizer.json"), os.path.join(out, "tokenizer.json"))
  return write_card(out, card)


def write_card(out: str, card: dict, files: tuple[str, ...] = pretrained.BUNDLED_FILES) -> dict:
  """Writes `out/card.json`: `card` plus the sha256 of every bundled file under `out`.

  `specjax.pretrained.load_pair` checks the files against these sums before loading.
  """
  card = {**card, "sha256": pretrained.file_sums(out, files)}
  with open(os.path.join(out, "card.json"), "w") as f:
    json.dump(card, f, indent=2)
  return card


def main(argv):
  del argv
  f = flags.FLAGS
  card = bundle(f.target, f.draft, f.data_dir, f.out)
  print(json.dumps({k: card[k] for k in ("target", "draft")}, indent=2, default=str))


def define_flags() -> None:
  """Defines this launcher's flags (called only when run as a script; see experiments.common)."""
  flags.DEFINE_string("target", None, "Run directory of the target.", required=True)
  flags.DEFINE_string("draft", None, "Run directory of the draft.", required=True)
  flags.DEFINE_string(
    "data_dir", None, "Data directory (tokenizer.json, <split>.json).", required=True
  )
  flags.DEFINE_string("out", pretrained.PAIR_DIR, "Output directory.")


if __name__ == "__main__":
  define_flags()
  common.run(main)
