"""A sequential block drafter (DSpark: specjax.heads.dspark) on the bundled target: the
block drafter's backbone plus a low-rank Markov head (each drafted law corrected by
the token drafted before it) and a confidence head (each draft's chance of being
kept), trained on the target's own continuations:

  python -m experiments.generate_data --target=specjax/pretrained/stdlib_pair/target \
      --data_dir=runs/data --out=runs/data_gen
  python -m experiments.train --config=configs/train_dspark.py --workdir=runs/dspark \
      --config.data.dir=runs/data_gen

By default the backbone is the bundled block drafter's (`head.warm_start`,
`head.backbone="bundled"`), frozen (`head.train_backbone=False`): the run trains the
two heads alone, as the bundled DSpark head was, and its file then holds only them.
For another target train everything from scratch (`--config.head.warm_start=False
--config.head.train_backbone=True --config.head.target=DIR_OR_REPO_ID`), or start
from a block drafter of yours (`--config.head.backbone=runs/dflash`). Each window
draws up to `num_anchors` blocks (self-distillation data: many anchors per
sequence, as the reference does); position k of a block is scored as the block
drafter's is (decayed cross-entropy plus `distill_weight` times the divergence) on
its corrected law, and the confidence head learns each draft's chance of being kept
given the ones before it ("greedy": the corrected argmax is the target's; "sampled":
1 - TV, token verification's chance).
"""

from specjax.training.config import head_base_config


def get_config():
  c = head_base_config("dspark")
  # The bundled block drafter's shape (configs/train_dflash.py), so its backbone fits.
  c.head.block_size = 8
  c.head.draft_layers = 2
  c.head.d_ff = 320
  c.head.mask_token_id = -1
  # () reads the default layers: up to five, shallow to the last ((2, 3, 4, 5, 6) here).
  c.head.feature_layers = ()
  c.head.num_anchors = 64
  c.head.loss_decay = 4.0
  # The acceptance-shaped loss: 0.1 cross-entropy + 0.9 L1 (2 TV) from the target's law.
  c.head.l1_mix = 0.9
  c.head.distill_weight = 0.0
  # The backbone's own laws scored too, so it stays a block drafter (the bundled DFlash).
  c.head.base_weight = 0.5
  # The two heads: rank 64 (V x 64 and 64 x V: 0.5M parameters for V = 4096).
  c.head.markov_rank = 64
  c.head.confidence_head = True
  c.head.confidence_with_markov = True
  c.head.confidence_weight = 1.0
  c.head.confidence_target = "sampled"  # 1 - TV: token verification's chance
  # Start from the bundled sequential drafter (backbone and heads; fc's blocks for the
  # layers it did not read start at zero) and train all of it.
  c.head.warm_start = True
  c.head.backbone = "bundled"
  c.head.train_backbone = True
  # With train_backbone=False: the backbone's parameters that still train (dotted path
  # prefixes, comma-separated), e.g. "layers.1,norm", stored beside the two heads.
  c.head.train_only = ""
  c.learning_rate = 1e-3
  c.num_steps = 1000
  c.warmup_steps = 20
  c.eval_every = 250
  return c
