"""An early-exit adapter (Kangaroo, Liu et al. 2024) on the bundled target: the
bundled `heads/early_exit`.

  python -m experiments.train --config=configs/train_early_exit.py --workdir=runs/early_exit \
      --config.data.dir=runs/data
  # phase 2: resume on the target's own continuations (experiments.generate_data)
  python -m experiments.train --config=configs/train_early_exit.py --workdir=runs/early_exit \
      --config.data.dir=runs/data_gen --config.num_steps=1000

One decoder layer (d_ff 256, 0.66M parameters) after the target's first 2 of 6
layers, trained toward the full target's law (forward KL) and its last-layer
features (smooth L1): first on the stdlib corpus, then on the target's own
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
  c = head_base_config("early_exit")
  c.head.exit_layer = 2
  c.head.d_ff = 256
  c.head.feature_weight = 0.1
  c.num_steps = 320
  c.warmup_steps = 30
  c.eval_every = 320
  return c
