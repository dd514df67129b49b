"""An early-exit adapter (Kangaroo, Liu et al. 2024) on the bundled target: the
bundled `heads/early_exit`.

  python -m experiments.train --config=configs/train_early_exit.py --workdir=runs/early_exit

One decoder layer (d_ff 256, 0.66M parameters) after the target's first 2 of
6 layers, trained toward the full target's law (forward KL) and its last-layer
features (smooth L1) on the stdlib corpus. Add `--config.data.dir=runs/data`
to share the token files of the pair's runs.
"""

from specjax.training.config import head_base_config


def get_config():
  c = head_base_config("early_exit")
  c.head.exit_layer = 2
  c.head.d_ff = 256
  c.head.feature_weight = 0.1
  c.num_steps = 320
  c.warmup_steps = 30
  c.eval_every = 320
  return c
