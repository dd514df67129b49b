"""An EAGLE head (Li et al. 2024) on the bundled target: the bundled `heads/eagle`.

  python -m experiments.train --config=configs/train_eagle.py --workdir=runs/eagle \
      --config.data.dir=runs/data
  # phase 2: resume on the target's own continuations (experiments.generate_data)
  python -m experiments.train --config=configs/train_eagle.py --workdir=runs/eagle \
      --config.data.dir=runs/data_gen --config.num_steps=4000

One decoder layer (d_ff 320, 0.92M parameters) over the target's last-layer
features, trained with forward KL to the target's law plus a smooth-L1 feature
regression, the input features jittered with Gaussian noise (EAGLE's robustness to
its own drafted features): first on the stdlib corpus, then on the target's own
continuations (runs/data_gen, from
`python -m experiments.generate_data --target=specjax/pretrained/stdlib_pair/target
--data_dir=runs/data --out=runs/data_gen`: 1.3M tokens, half greedy, half sampled
at T = 1). Phase 2 resumes the run with a longer cosine schedule: the learning
rate restarts near its peak and decays to the new end. Only phase 1's corpus
directory (config.data.corpus_dir, runs/data) is encoded on first use: a missing
runs/data_gen is an error naming the generate_data command above.
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
