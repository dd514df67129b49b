"""An EAGLE head (Li et al. 2024) on the bundled target: the bundled `heads/eagle`.

  python -m experiments.train --config=configs/train_eagle.py --workdir=runs/eagle

One decoder layer (d_ff 320, 0.92M parameters) over the target's last-layer
features, trained on the stdlib corpus with forward KL to the target's law
plus a smooth-L1 feature regression, the input features jittered with
Gaussian noise (EAGLE's robustness to its own drafted features). Add
`--config.data.dir=runs/data` to share the token files of the pair's runs.
"""

from specjax.training.config import head_base_config


def get_config():
  c = head_base_config("eagle")
  c.head.d_ff = 320
  c.head.feature_weight = 0.1
  c.head.feature_noise = 0.2  # the last-layer features have an rms of ~9.5
  c.num_steps = 720
  c.warmup_steps = 50
  c.eval_every = 360
  return c
