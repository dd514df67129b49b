"""The bundled draft: configs/train_draft.py's model distilled toward the target.

  python -m experiments.train --config=configs/distill_draft.py \
      --workdir=runs/draft_distill --config.data.dir=runs/data --config.teacher=runs/target

Same model, data, batches and steps as train_draft.py; only the objective
differs: a divergence between the frozen target's next-token distribution p
and the draft's q at every position of corpus windows.
"""

from configs import train_draft


def get_config():
  c = train_draft.get_config()
  c.loss = "kl"
  c.teacher = ""  # required: the target's run directory
  return c
