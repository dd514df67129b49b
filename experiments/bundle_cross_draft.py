"""The bundled draft with a tokenizer of its own: its stage-2 data, and its export.

Stage 2's data: the target's own continuations (runs/data_gen, target ids)
spelled in the draft's ids exactly as `CrossTokenizerDrafter` feeds them (each
target id's expansion, `specjax.vocab_map`), so the draft learns the text it
reads at run time:

  python -m experiments.bundle_cross_draft --reencode --data_gen=runs/data_gen \
      --draft_data=runs/data_x1024 --out=runs/data_x1024_gen

Export (after configs/train_cross_draft.py's two stages):

  python -m experiments.bundle_cross_draft --draft=runs/xdraft_gen \
      --draft_data=runs/data_x1024 [--out=specjax/pretrained/stdlib_pair/cross_draft]

writes a bfloat16 Hugging Face Llama checkpoint, its `tokenizer.json` and
`card.json` (training record, the vocabulary map's report, sha256 of each file),
which `specjax.pretrained.load_cross_draft` verifies.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
from absl import app, flags

from experiments import common
from experiments.bundle_pair import run_lineage, write_card
from specjax import pretrained
from specjax.data import Tokenizer
from specjax.data.dataset import check_data_dir, check_tokenizer, tokenizer_record, write_meta
from specjax.hf.export import save_model
from specjax.training.checkpoint import check_run, load_trained_model
from specjax.vocab_map import build_vocab_map

_COPIED = ("validation.bin", "validation.json", "test.bin", "test.json", "tokenizer.json")


def reencode(data_gen: str, draft_data: str, out: str) -> dict:
  """Writes `out/train.bin`: data_gen's target ids as draft ids; returns its meta."""
  check_data_dir(data_gen, "--data_gen", ("tokenizer.json", "train.bin", "train.json"))
  check_data_dir(draft_data, "--draft_data", _COPIED)
  target_tok = Tokenizer.from_file(os.path.join(data_gen, "tokenizer.json"))
  draft_tok = Tokenizer.from_file(os.path.join(draft_data, "tokenizer.json"))
  source = os.path.join(data_gen, "train.bin")
  check_tokenizer(source, target_tok)
  vocab_map = build_vocab_map(draft_tok, target_tok)
  tokens = np.fromfile(source, np.uint16).astype(np.int64)
  lengths = vocab_map.expansion_lengths[tokens]
  keep = np.arange(vocab_map.max_expansion)[None, :] < lengths[:, None]
  ids = vocab_map.expansion[tokens][keep]  # row-major: each target id's expansion in order
  os.makedirs(out, exist_ok=True)
  path = os.path.join(out, "train.bin")
  ids.astype(np.uint16).tofile(path)
  meta = {
    "split": "train",
    "source": f"{source} spelled in draft ids (specjax.vocab_map expansion)",
    "target_tokens": int(tokens.size),
    "tokens": int(ids.size),
    "vocab_map": vocab_map.report(),
    **tokenizer_record(draft_tok),
  }
  write_meta(path, meta)
  for name in _COPIED:
    shutil.copyfile(os.path.join(draft_data, name), os.path.join(out, name))
  return meta


def bundle(draft_run: str, draft_data: str, out: str) -> dict:
  """Writes the draft of `draft_run` with its tokenizer into `out`; returns its card."""
  check_run(draft_run, "--draft")
  check_data_dir(draft_data, "--draft_data", ("tokenizer.json",))
  os.makedirs(out, exist_ok=True)
  tokenizer = Tokenizer.from_file(os.path.join(draft_data, "tokenizer.json"))
  model, _ = load_trained_model(draft_run, dtype="float32")
  save_model(
    model,
    out,
    dtype="bfloat16",
    bos_id=tokenizer.bos_id,
    eos_id=tokenizer.eos_id,
    pad_id=tokenizer.pad_id,
  )
  os.chmod(os.path.join(out, "model.safetensors"), 0o644)
  shutil.copyfile(os.path.join(draft_data, "tokenizer.json"), os.path.join(out, "tokenizer.json"))
  record = {"params": model.num_params, **run_lineage(draft_run)}
  target_tok = Tokenizer.from_file(pretrained.TOKENIZER_FILE)
  card = {"draft": record, "vocab_map": build_vocab_map(tokenizer, target_tok).report()}
  return write_card(out, card, pretrained.CROSS_FILES)


def main(argv):
  del argv
  f = flags.FLAGS
  if f.reencode:
    print(json.dumps(reencode(f.data_gen, f.draft_data, f.out), indent=2))
  else:
    if not f.draft:
      raise app.UsageError("--draft (the draft's run directory) is required to export.")
    card = bundle(f.draft, f.draft_data, f.out or pretrained.CROSS_DRAFT_DIR)
    print(json.dumps({k: card[k] for k in ("vocab_map",)}, indent=2))


def define_flags() -> None:
  """Defines this launcher's flags (called only when run as a script)."""
  flags.DEFINE_bool("reencode", False, "Write stage 2's data instead of exporting.")
  flags.DEFINE_string("data_gen", "runs/data_gen", "Target continuations (target ids).")
  flags.DEFINE_string(
    "draft_data", None, "The draft's data directory (its tokenizer.json).", required=True
  )
  flags.DEFINE_string("draft", "", "Run directory of the draft (export).")
  flags.DEFINE_string("out", "", "Output directory.")


if __name__ == "__main__":
  define_flags()
  common.run(main)
