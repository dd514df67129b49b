"""A sequential block drafter (DSpark: specjax.heads.dspark) on the bundled target: the
block drafter's backbone plus a low-rank Markov head (each drafted law corrected by
the token drafted before it) and a confidence head (each draft's chance of being
kept), trained on the target's own continuations:

  python -m experiments.generate_data --target=specjax/pretrained/stdlib_pair/target \
      --data_dir=runs/data --out=runs/data_gen
  python -m experiments.train --config=configs/train_dspark.py --workdir=runs/dspark \
      --config.data.dir=runs/data_gen

The recipe (issue 74, docs/heads.md "Training the block drafters"): the drafter reads
the target's features from five depths, shallow to the last (`feature_layers=()`);
the loss is acceptance-shaped, 0.1 cross-entropy + 0.9 L1 between its law and the
target's (`l1_mix`), position k weighted exp(-(k - 1) / loss_decay), on the corrected
laws and (`base_weight`) on the backbone's own, so the backbone stays a block drafter
(the bundled DFlash head is this one's backbone); the confidence head learns 1 - TV
(`confidence_target="sampled"`); the data are the target's own continuations, greedy
and at T = 1; and everything trains, warm-started from the bundled sequential drafter
(`head.warm_start`, `head.backbone="bundled"`; fc's blocks for the layers it did not
read start at zero, so step 0 drafts what it drafted). Each window draws up to
`num_anchors` blocks (many anchors per sequence, as the reference does).

For another target train everything from scratch (`--config.head.warm_start=False
--config.head.target=DIR_OR_REPO_ID`), or start from a block drafter of yours
(`--config.head.backbone=runs/dflash`: its backbone; the two heads start fresh).
`--config.head.train_backbone=False` trains the two heads alone on a frozen backbone
(the bundled drafter's first recipe), `train_only` naming backbone parameters that
still train.
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
