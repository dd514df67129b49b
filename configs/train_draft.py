"""A 0.92M-parameter draft trained on the corpus alone (the distillation baseline).

  python -m experiments.train --config=configs/train_draft.py \
      --workdir=runs/draft_ce --config.data.dir=runs/data
"""

from specjax.training.config import base_config, model_fields


def get_config():
  c = base_config()
  c.model = model_fields(
    vocab_size=4096, d_model=128, n_layers=2, n_heads=2, d_ff=344, max_seq_len=512
  )
  c.num_steps = 1000
  c.learning_rate = 3e-3
  return c
