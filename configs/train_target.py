"""The bundled target: 8.7M parameters, trained on the stdlib train split.

  python -m experiments.train --config=configs/train_target.py \
      --workdir=runs/target --config.data.dir=runs/data
"""

from specjax.training.config import base_config, model_fields


def get_config():
  c = base_config()
  c.model = model_fields(
    vocab_size=4096, d_model=320, n_layers=6, n_heads=5, d_ff=864, max_seq_len=512
  )
  c.num_steps = 1000
  c.learning_rate = 2e-3
  c.warmup_steps = 100
  return c
