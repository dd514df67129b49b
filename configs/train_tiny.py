"""A tiny run for tests and smoke checks, small enough for a CPU."""

from specjax.training.config import base_config, model_fields


def get_config():
  c = base_config()
  c.data.vocab_size = 512
  c.model = model_fields(vocab_size=512, d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=64)
  c.batch_size = 4
  c.seq_len = 32
  c.num_steps = 6
  c.warmup_steps = 1
  c.log_every = 1
  c.eval_every = 3
  c.eval_batches = 2
  c.checkpoint_every = 2
  return c
