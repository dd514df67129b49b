"""Medusa-1 heads (Cai et al. 2024) on the bundled target: the bundled `heads/medusa`.

  python -m experiments.train --config=configs/train_medusa.py --workdir=runs/medusa \
      --config.data.dir=runs/data
  # phase 2: resume on the target's own continuations (experiments.generate_data)
  python -m experiments.train --config=configs/train_medusa.py --workdir=runs/medusa \
      --config.data.dir=runs/data_gen --config.num_steps=900

Four residual heads (0.41M parameters) on the target's last-layer feature, head k
trained toward the target's law k + 1 positions later (forward KL): first on the
stdlib corpus, then on the target's own continuations (runs/data_gen, from
`python -m experiments.generate_data --target=specjax/pretrained/stdlib_pair/target
--data_dir=runs/data --out=runs/data_gen`: 1.3M tokens, half greedy, half sampled
at T = 1). Phase 2 resumes the run with a longer cosine schedule: the learning
rate restarts near its peak and decays to the new end. Only phase 1's corpus
directory (config.data.corpus_dir, runs/data) is encoded on first use: a missing
runs/data_gen is an error naming the generate_data command above.
"""

from specjax.training.config import head_base_config


def get_config():
  c = head_base_config("medusa")
  c.head.num_heads = 4
  c.num_steps = 300
  c.warmup_steps = 20
  c.eval_every = 300
  return c
