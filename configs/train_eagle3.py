"""An EAGLE-3 head (Li et al. 2025) on the bundled target, trained with the
training-time test (specjax.heads.eagle3, specjax.training.heads):

  python -m experiments.train --config=configs/train_eagle3.py --workdir=runs/eagle3 \
      --config.data.dir=runs/data

fc fuses the target's residual stream after layers 1, 3 and 6 of 6 (the rule for
targets under 7 layers; vLLM's (2, L//2, L-3) above), one decoder layer (d_ff 320,
as the bundled EAGLE-1 head) reads [embedding; h] 2D wide, and its own head
drafts over the whole 4,096-id vocabulary: on a vocabulary this small a reduced
one cost alpha (docs/heads.md's table); for a target with a large vocabulary set
`--config.head.draft_vocab_size=K` (e.g. 32000 for Llama 3's 128k, as SpecForge):
the head then drafts among the K ids most frequent in the training split, q is 0
on the others, and verification stays exact. The head is unrolled for
ttt_steps = 7 steps on its own outputs (SpecForge's default), losses weighted
0.8**j. `--config.head.target=DIR_OR_REPO_ID` trains one for another target (a
Hugging Face checkpoint or a specjax run) and `--config.data.files=PATH[,PATH...]`
on your own data (docs/train_your_drafter.md).
"""

from specjax.training.config import head_base_config


def get_config():
  c = head_base_config("eagle3")
  c.head.d_ff = 320
  c.head.ttt_steps = 7  # training-time test: steps unrolled on the head's own outputs
  c.head.draft_vocab_size = 0  # K > 0: draft among the K ids most frequent in the training split
  # The head's norm and lm_head start as the target's (at the draft ids), fc passing
  # the highest feature layer on: it starts from the target's own law (eagle3.warm_start).
  c.head.warm_start = True
  c.num_steps = 720
  c.warmup_steps = 50
  c.eval_every = 360
  return c
