"""A draft with a tokenizer of its own: a 1024-id byte-level BPE and a 0.32M-parameter
model, for cross-tokenizer drafting of the bundled 4096-id target
(`specjax.drafting.CrossTokenizerDrafter`, `specjax.generation.string_level_generate`).

Stage 1, the corpus (trains the 1024-id tokenizer on the train split into the data dir):

  python -m experiments.train --config=configs/train_cross_draft.py \
      --workdir=runs/xdraft_ce --config.data.dir=runs/data_x1024

Stage 2, distillation toward the target: the target's own continuations
(runs/data_gen, see experiments/generate_data.py) re-encoded with the draft's
tokenizer (experiments/bundle_cross_draft.py --reencode), from stage 1's weights:

  python -m experiments.train --config=configs/train_cross_draft.py \
      --workdir=runs/xdraft_gen --config.data.dir=runs/data_x1024_gen \
      --config.data.tokenizer=runs/data_x1024/tokenizer.json \
      --config.init_from=runs/xdraft_ce --config.num_steps=600

Only stage 1's directory (config.data.corpus_dir, runs/data_x1024) is encoded
from the corpus on first use: a missing stage-2 directory is an error.
"""

from specjax.training.config import base_config, model_fields


def get_config():
  c = base_config()
  c.data.vocab_size = 1024
  # Stage 1's corpus, encoded on first use; stage 2's data must exist.
  c.data.corpus_dir = "runs/data_x1024"
  # max_seq_len bounds the draft's own cache, which holds the committed text in
  # the draft's tokens (more of them than the target's): RoPE, no extra weights.
  c.model = model_fields(
    vocab_size=1024, d_model=96, n_layers=2, n_heads=2, d_ff=256, max_seq_len=4096
  )
  c.num_steps = 1000
  c.learning_rate = 3e-3
  return c
