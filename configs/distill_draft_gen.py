"""Second distillation phase of the bundled draft: the target's own continuations.

  python -m experiments.generate_data --target=runs/target --data_dir=runs/data \
      --out=runs/data_gen
  python -m experiments.train --config=configs/distill_draft_gen.py \
      --workdir=runs/draft_gen --config.data.dir=runs/data_gen \
      --config.teacher=runs/target --config.init_from=runs/draft_kl

Starts from the corpus-distilled draft (configs/distill_draft.py) and goes on
with the same forward-KL objective on windows of text the target generated
itself (half greedy, half sampled): the distribution the draft meets when it
drafts for that target. runs/data_gen must exist: only the corpus directory
(config.data.corpus_dir, runs/data) is encoded on first use.
"""

from configs import distill_draft


def get_config():
  c = distill_draft.get_config()
  c.num_steps = 600
  c.warmup_steps = 50
  c.learning_rate = 1e-3
  c.init_from = ""  # required: the corpus-distilled draft's run directory
  # Only the corpus is encoded on first use (into runs/data): a missing
  # --config.data.dir (runs/data_gen) is an error naming generate_data.
  c.data.corpus_dir = "runs/data"
  c.eval_every = 200
  return c
