"""Medusa-1 heads (Cai et al. 2024) on the bundled target: the bundled `heads/medusa`.

  python -m experiments.train --config=configs/train_medusa.py --workdir=runs/medusa

Four residual heads (0.41M parameters) on the target's last-layer feature,
head k trained toward the target's law k + 1 positions later (forward KL), on
the stdlib corpus. Add `--config.data.dir=runs/data` to share the token files
of the pair's runs.
"""

from specjax.training.config import head_base_config


def get_config():
  c = head_base_config("medusa")
  c.head.num_heads = 4
  c.num_steps = 300
  c.warmup_steps = 20
  c.eval_every = 300
  return c
