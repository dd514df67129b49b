"""A block drafter (DFlash, arXiv 2602.06036) on the bundled target, trained with the
published recipe (specjax.heads.dflash, specjax.training.heads):

  python -m experiments.train --config=configs/train_dflash.py --workdir=runs/dflash \
      --config.data.dir=runs/data_gen

The drafter's two layers read the target's residual stream after layers 2 to 6 of
6 (`block_feature_layers`: up to five, shallow to the last; DFlash's own rule,
`dflash_feature_layers`, reads 2 and 4 here and never the last), fused by fc, as
cached context keys and values; a block is [s[-1], m, ..., m] (m a learned mask
embedding: the bundled tokenizer has no spare id; `--config.head.mask_token_id=ID`
names a spare id of another target's tokenizer), and one call drafts its B - 1
tokens. The target is frozen. Each step draws up to `num_anchors` anchors per
window from the training text (the reference uses up to 512 per sequence); block
position k is weighted exp(-(k - 1) / loss_decay) (the reference: 7 at B = 16; 4
here at B = 8) and scored by the acceptance-shaped mix 0.1 cross-entropy on the
text + 0.9 L1 from the target's law (`l1_mix`; 0 is DFlash's loss);
`distill_weight` > 0 adds a divergence (config.loss), weighted alike. The text
should be the target's own (experiments.generate_data), greedy and at T = 1, as
the reference's is: the block learns what the target writes.

`--config.head.target=DIR_OR_REPO_ID` trains one for another target (a Hugging
Face checkpoint or a specjax run; feature layers follow its depth) and
`--config.data.files=PATH[,PATH...]` on your own data (docs/train_your_drafter.md).
For a large target use the reference's shape: block_size 16, loss_decay 7,
draft_layers 5 (or more), num_anchors as many as fit (e.g. 512 at seq_len 4096).
Decoding drafts gamma <= block_size - 1 tokens per call (decode's default: the
fastest of 1, 2, 4 and B - 1, measured at start-up).
"""

from specjax.training.config import head_base_config


def get_config():
  c = head_base_config("dflash")
  # B = 8: verifying 8 rows costs about one target step on a CPU (batch 1), and a
  # 6-layer target's continuations are predictable only a few tokens ahead.
  c.head.block_size = 8
  c.head.draft_layers = 2
  c.head.d_ff = 320
  c.head.mask_token_id = -1  # -1: a learned mask embedding (no spare id in the vocabulary)
  c.head.num_anchors = 64  # blocks per window, at most seq_len - 1
  c.head.loss_decay = 4.0  # position k weighs exp(-(k - 1) / loss_decay)
  # () reads the default layers: up to five, shallow to the last ((2, 3, 4, 5, 6) here).
  c.head.feature_layers = ()
  # The acceptance-shaped loss: 0.1 cross-entropy + 0.9 L1 (2 TV) from the target's law
  # (0: DFlash's own, cross-entropy alone).
  c.head.l1_mix = 0.9
  # > 0: adds this times the decayed divergence (config.loss) from the target's law.
  c.head.distill_weight = 0.0
  # True: start from a block drafter (`backbone`: "bundled" or a run/export directory;
  # fc's blocks for layers it did not read start at zero). The bundled one is the
  # sequential drafter's backbone (configs/train_dspark.py trains both at once).
  c.head.warm_start = False
  c.head.backbone = "bundled"
  c.num_steps = 3000
  c.warmup_steps = 50
  c.eval_every = 500
  return c
