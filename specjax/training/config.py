"""Defaults of every train config; the files in configs/ override what differs."""

from __future__ import annotations

import ml_collections


def model_fields(
  vocab_size: int, d_model: int, n_layers: int, n_heads: int, d_ff: int, max_seq_len: int
) -> ml_collections.ConfigDict:
  """A Llama-style `ModelConfig` as a ConfigDict (tied embeddings, float32)."""
  return ml_collections.ConfigDict(
    dict(
      vocab_size=vocab_size,
      d_model=d_model,
      n_layers=n_layers,
      n_heads=n_heads,
      n_kv_heads=n_heads,
      d_ff=d_ff,
      max_seq_len=max_seq_len,
      tie_embeddings=True,
      dtype="float32",
      param_dtype="float32",
      init_std=0.02,
    )
  )


def base_config() -> ml_collections.ConfigDict:
  """Every field `specjax.training.train` reads, with defaults."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.data = ml_collections.ConfigDict(
    dict(
      root="",  # corpus root; "" -> the running interpreter's stdlib
      dir="",  # token files + tokenizer; "" -> <workdir>/data
      # An existing tokenizer.json; "" -> <data dir>/tokenizer.json, trained if missing.
      tokenizer="",
      vocab_size=4096,
      # The directory the corpus (root) is encoded into on first use. "" -> any
      # missing `dir` is. A config whose second phase trains on data made for it
      # (the target's continuations, experiments.generate_data) names its corpus
      # directory here: a missing `dir` other than it is then an error naming
      # the command that makes it, not a corpus encoded in its place.
      corpus_dir="",
      # Your own documents instead of the corpus: "PATH[,PATH...]" of .txt, .jsonl
      # and .parquet files or directories (specjax.data.files), encoded with the
      # target's tokenizer into `dir`; every `validation_every`-th is validation.
      files="",
      validation_every=10,
    )
  )
  c.model = model_fields(4096, 128, 2, 2, 344, 512)
  c.batch_size = 16
  c.seq_len = 256
  c.num_steps = 1000
  c.learning_rate = 3e-3
  c.warmup_steps = 100
  c.min_lr_ratio = 0.1
  c.weight_decay = 0.1
  c.clip_norm = 1.0
  c.b1 = 0.9
  c.b2 = 0.95
  c.loss = "ce"  # or a distillation loss: "kl", "tv", "kl+tv"
  c.teacher = ""  # run directory of the frozen target (distillation only)
  c.ce_weight = 0.0  # weight of the corpus cross-entropy added to a distillation loss
  c.init_from = ""  # a run directory whose latest parameters start this run (fine-tuning)
  # A draft head on a frozen target instead of a model (specjax.training.heads);
  # config.model is then unused: the head's shape follows the target's.
  c.head = ml_collections.ConfigDict(
    dict(
      kind="",  # a head kind (specjax.heads.names()); "" trains config.model
      # The frozen target: a Hugging Face checkpoint directory or a specjax run
      # directory; "" -> the bundled pair's target (specjax.pretrained.TARGET_DIR).
      target="",
      num_heads=4,  # Medusa heads K
      exit_layer=2,  # early exit after this many target layers
      feature_layers=(),  # EAGLE: fuse the features after these layer counts; () = last
      d_ff=0,  # MLP width of the head's decoder layer (EAGLE, early exit); 0 = the target's
      feature_weight=0.0,  # smooth-L1 toward the last-layer features (EAGLE, early exit)
      feature_noise=0.0,  # std of Gaussian noise on EAGLE's input features in training
    )
  )
  c.mesh_shape = (-1, 1)  # (data, model) axes; -1 = the rest of the devices
  c.mesh_devices = 0  # use the first n devices; 0 = all (global) devices
  c.log_every = 20
  c.eval_every = 200
  c.eval_batches = 16
  c.checkpoint_every = 100
  c.keep_checkpoints = 2
  return c


def head_base_config(kind: str) -> ml_collections.ConfigDict:
  """What the head configs share: a `kind` head on the bundled target, trained on the
  stdlib corpus tokenized with the bundled tokenizer (encoded on first use into
  runs/data only), forward KL to the target."""
  from specjax import pretrained  # imported here: only head runs need the bundled files

  c = base_config()
  c.data.tokenizer = pretrained.TOKENIZER_FILE
  # Phase 1's corpus; phase 2's data (the target's continuations) must exist.
  c.data.corpus_dir = "runs/data"
  c.head.kind = kind
  c.loss = "kl"
  # Small batches, many updates: the heads are small, and on a CPU the frozen
  # target's forward pass dominates each step.
  c.batch_size = 4
  c.seq_len = 256
  c.learning_rate = 3e-3
  c.weight_decay = 0.0
  c.log_every = 20
  c.eval_batches = 16
  c.checkpoint_every = 100
  return c
