"""How well a sequential block drafter's confidence head predicts acceptance: per block
position and per bin of the estimate, predicted against measured (a reliability
diagram's data), as JSON.

  python -m experiments.calibrate_confidence [--head=runs/dspark] [--data_dir=runs/data] \
      [--out=experiments/results/block/dspark_calibration.json]

Teacher-forced on `--num_windows` windows of the data directory's validation split
(the stdlib corpus, encoded into --data_dir on first use; `specjax.heads.dspark.
calibration`): at each block position the drafter's corrected argmax is kept when it
is the target's own argmax there, which is what greedy verification decides once the
drafts before it were kept. --head names a run or an export ("" = the bundled head).
"""

from __future__ import annotations

import json
import os
import time

from absl import app, flags

from experiments import common


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  import jax.numpy as jnp

  import specjax.hf
  from configs.train_dspark import get_config
  from specjax import pretrained
  from specjax.bench.timing import environment_info
  from specjax.data.dataset import TokenDataset
  from specjax.heads.dspark import calibration
  from specjax.training.trainer import prepare_data

  f = flags.FLAGS
  for name in ("num_windows", "seq_len", "num_anchors", "bins"):
    if f[name].value < 1:
      raise app.UsageError(f"--{name} must be >= 1, got {f[name].value}.")
  config = get_config()
  config.data.dir = config.data.corpus_dir = f.data_dir
  if f.data_root:
    config.data.root = f.data_root
  _, paths = prepare_data(config, f.data_dir, log=lambda _: None)
  target, _, _ = pretrained.load_pair()
  if f.seq_len >= target.cfg.max_seq_len:
    raise app.UsageError(f"--seq_len must be < {target.cfg.max_seq_len}, got {f.seq_len}.")
  if f.head:  # a run or an export of a sequential block drafter
    head = specjax.hf.load_head(f.head, target)
    if head.cfg.kind != "dspark":
      raise app.UsageError(f"--head={f.head} holds a {head.cfg.kind} head, not a dspark head.")
  else:
    head = pretrained.load_head("dspark", target)
  data = TokenDataset(paths["validation"])
  batch = jnp.asarray(data.batch(0, f.num_windows, f.seq_len, seed=0))
  start = time.perf_counter()
  report = calibration(head, target, batch, num_anchors=f.num_anchors, bins=f.bins)
  report["settings"] = {
    "head": f.head or "bundled",
    "data": paths["validation"],
    "windows": f.num_windows,
    "seq_len": f.seq_len,
    "num_anchors": f.num_anchors,
    "seconds": round(time.perf_counter() - start, 1),
  }
  report["environment"] = environment_info()
  text = json.dumps(report, indent=2)
  print(text)
  if f.out:
    os.makedirs(os.path.dirname(f.out) or ".", exist_ok=True)
    with open(f.out, "w") as out:
      out.write(text + "\n")


def define_flags() -> None:
  """Defines this launcher's flags (called only when run as a script; see experiments.common)."""
  flags.DEFINE_string("head", "", "A sequential block drafter's run or export; '' = bundled.")
  flags.DEFINE_string("data_dir", "runs/data", "Data directory (its validation split).")
  flags.DEFINE_string("data_root", "", "Corpus root to encode (default: the standard library).")
  flags.DEFINE_integer("num_windows", 32, "Validation windows.")
  flags.DEFINE_integer("seq_len", 256, "Tokens per window.")
  flags.DEFINE_integer("num_anchors", 32, "Blocks per window.")
  flags.DEFINE_integer("bins", 10, "Bins of the estimate.")
  flags.DEFINE_string("out", "", "Also write the JSON here.")


if __name__ == "__main__":
  define_flags()
  common.run(main)
