"""Export trained draft-head runs into the package as the bundled heads.

  python -m experiments.bundle_heads --eagle=runs/eagle --medusa=runs/medusa \
      --early_exit=runs/early_exit [--out=specjax/pretrained/stdlib_pair/heads]

Writes `<kind>/head_config.json` and `<kind>/model.safetensors` (bfloat16) for
each run given (`--dflash` may name a sequential block drafter's run: its backbone is
bundled as the block drafter, and `--dspark` given later stores only its own heads),
and `card.json`: each run's train config, steps, tokens seen,
final validation metrics, wall time and training data (its train split's record,
when the data directory is there), plus the sha256 of every bundled head
file, which `specjax.pretrained.load_head` verifies. Kinds not given keep
their files and card entries. Each head must fit the bundled target.
"""

from __future__ import annotations

import json
import os

import numpy as np
from absl import app, flags, logging

from experiments import common
from experiments.bundle_pair import run_record
from specjax import heads as head_kinds
from specjax import pretrained
from specjax.heads import dspark
from specjax.heads.files import head_tensors
from specjax.training.checkpoint import check_run, load_trained_head
from specjax.training.heads import num_params, target_config
from specjax.validation import read_json_object


def _portable(value):
  """`value` with paths into the installed package written relative to the repository,
  so the card reads the same on every machine."""
  package = os.path.dirname(os.path.dirname(pretrained.PAIR_DIR))  # .../specjax
  if isinstance(value, dict):
    return {k: _portable(v) for k, v in value.items()}
  if isinstance(value, str) and value.startswith(package + os.sep):
    return os.path.join("specjax", os.path.relpath(value, package))
  return value


def bundle(runs: dict[str, str], out: str) -> dict:
  """Writes the heads of `runs` ({kind: run directory}) into `out`; returns the card."""
  from safetensors.flax import save_file  # imported here: only exporting needs it

  for kind, run in runs.items():  # each missing run is one line naming its flag
    check_run(run, f"--{kind}", kind="head")
  target = target_config(pretrained.TARGET_DIR)
  loaded = {}
  for kind, run in runs.items():  # every run is checked before anything is written
    head, _ = load_trained_head(run)
    if kind == "dflash" and head.cfg.kind == "dspark":  # its backbone: a block drafter
      head = dspark.backbone(head)
    if head.cfg.kind != kind:
      raise ValueError(f"--{kind}={run} holds a {head.cfg.kind} head, not a {kind} head.")
    head.cfg.check_target(target, name="bundled target")
    loaded[kind] = head
  card_path = os.path.join(out, "card.json")
  card = read_json_object(card_path) if os.path.exists(card_path) else {}
  heads = dict(card.get("heads", {}))
  for kind, run in runs.items():
    head = loaded[kind]
    directory = os.path.join(out, kind)
    os.makedirs(directory, exist_ok=True)
    tensors = {k: v.astype("bfloat16") for k, v in head_tensors(head).items()}
    tensors, shares = _shared(tensors, kind, out, runs)
    save_file(tensors, os.path.join(directory, head_kinds.WEIGHTS_FILE))
    os.chmod(os.path.join(directory, head_kinds.WEIGHTS_FILE), 0o644)  # safetensors writes 0600
    head_kinds.write_config(directory, head.cfg)
    record = run_record(run)
    heads[kind] = _portable(
      {"params": num_params(head), "run": run, **record, **_data_record(record["config"])}
    )
    if shares:
      heads[kind]["shares"] = shares
  # The target weights the heads were trained on, as the pair's card records them.
  target_sum = pretrained.model_card().get("sha256", {}).get("target/model.safetensors")
  card = {"target": {"dir": "../target", "model.safetensors sha256": target_sum}, "heads": heads}
  card["sha256"] = pretrained.head_file_sums(out, [k for k in head_kinds.names() if k in heads])
  with open(card_path, "w") as f:
    json.dump(card, f, indent=2)
  return card


def _shared(tensors: dict, kind: str, out: str, runs: dict) -> tuple[dict, dict]:
  """`tensors` less those equal (in bfloat16, name for name) to another bundled
  head's in `out` that this bundling leaves as it is, and {that kind: its weights'
  sha256}: a head trained on another's frozen layers (the sequential block drafter on
  the block drafter's) stores only its own. `load_head` reads them back from there."""
  from specjax.tensor_files import read_tensors

  kept, shares = dict(tensors), {}
  for other in head_kinds.names():
    path = os.path.join(out, other, head_kinds.WEIGHTS_FILE)
    if other == kind or other in runs or not os.path.isfile(path):
      continue
    same = [
      name
      for _, name, value in read_tensors([path])
      if name in kept
      and kept[name].shape == value.shape
      and np.array_equal(np.asarray(kept[name]).view(np.uint16), np.asarray(value).view(np.uint16))
    ]
    if same:
      for name in same:
        del kept[name]
      shares[other] = pretrained.file_sha256(path)
  return kept, shares


def _data_record(config: dict) -> dict:
  """{"data": the train split's record} (`specjax.data.dataset.read_meta`: for the
  target's continuations their samples, tokens and generation settings), when the
  run's data directory is still there; else {}."""
  from specjax.data.dataset import read_meta

  directory = config.get("data", {}).get("dir")
  meta = read_meta(os.path.join(directory, "train.bin")) if directory else None
  return {"data": meta} if meta else {}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)  # orbax logs every file it reads at INFO
  f = flags.FLAGS
  runs = {kind: f[kind].value for kind in head_kinds.names() if f[kind].value}
  if not runs:
    raise app.UsageError(f"give at least one of --{', --'.join(head_kinds.names())}")
  card = bundle(runs, f.out)
  summary = {
    kind: {k: card["heads"][kind][k] for k in ("params", "steps", "final_eval", "wall_seconds")}
    for kind in runs
  }
  print(json.dumps(summary, indent=2))


def define_flags() -> None:
  """Defines this launcher's flags (called only when run as a script; see experiments.common)."""
  for kind in head_kinds.names():
    flags.DEFINE_string(kind, None, f"Run directory of a {kind} head (experiments.train).")
  flags.DEFINE_string("out", pretrained.HEADS_DIR, "Output directory.")


if __name__ == "__main__":
  define_flags()
  common.run(main)
