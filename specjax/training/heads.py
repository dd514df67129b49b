"""Training draft heads (any registered kind, `specjax.heads`) on a frozen target.

  python -m experiments.train --config=configs/train_eagle.py --workdir=runs/eagle

`config.head.kind` switches `specjax.training.train` (the same loop, optimizer,
checkpoints and metrics as for models) from training `config.model` to
training `heads.make_head(heads.config(kind, target.cfg, ...))` on the frozen
target named by `config.head.target`. Only the head's parameters train and are
checkpointed; the run directory records `head_config.json`.

Every objective runs the target once per batch of int32 `[B, T + 1]` windows
(inputs `[:, :-1]`) for its logits `[B, T, V]` and features, under
`stop_gradient`, and distils the target's law into the head's through the
target's own final norm and head (`Transformer.features_to_logits`). Each kind's
objective is its record's (`specjax.heads.kind(name).objective`, in
`specjax/heads/<kind>.py`, whose docstring says what it compares); this module
dispatches to it and holds what every head run shares. The objective's settings
beyond the divergence (EAGLE's feature weight and noise, the block drafter's anchors
and decay, ...) are the kind's own `LossSettings` subclass, in the same file
(`TrainingRules.loss`), read from `config.head` by `loss_settings`; its `keyed` says
whether the trainer passes the objective a PRNG key.

The divergence is `config.loss` ("kl" = forward KL(p_target || q_head), "tv",
"kl+tv"), plus `config.ce_weight` times the head's cross-entropy on the corpus.
Metrics: `distill`, `ce` (the head's next-token cross-entropy on the corpus),
`alpha_t0` (argmax agreement) and `alpha_t1` (1 - TV) as `losses.agreement`
computes them, `feature` (the smooth-L1 term, where there is one), and for
Medusa the alphas of each head (`alpha_t0_head0`, ...) besides their mean.
Kinds add their own (Medusa's per head, the block drafter's per block position).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from specjax import heads, losses
from specjax.heads import HeadConfig, HeadConfigError
from specjax.models.config import ModelConfig
from specjax.models.transformer import Transformer
from specjax.validation import is_int, is_real


def loss_settings(config: ml_collections.ConfigDict) -> heads.LossSettings:
  """The objective settings `config.head` gives its kind: an instance of the kind's
  `LossSettings` subclass (`TrainingRules.loss`), the base for a kind without any."""
  return heads.kind(config.head.kind).training.loss.from_config(config.head)


def head_kind(config: ml_collections.ConfigDict) -> str:
  """`config.head.kind`, or "" for a config without a `head` section (a model run)."""
  head = config.get("head")
  return head.kind if head else ""


def check_config(config: ml_collections.ConfigDict) -> None:
  """The checks of a head run that need no target: ValueError naming the field."""
  head = config.head
  if head.kind not in heads.names():
    raise ValueError(f"config.head.kind must be '' or one of {heads.names()}, got {head.kind!r}.")
  if config.loss not in losses.DISTILL_LOSSES:
    raise ValueError(
      f"config.loss must be one of {losses.DISTILL_LOSSES} when training a head "
      f"(the head learns the target's law), got {config.loss!r}."
    )
  for name, value in (("teacher", config.teacher), ("init_from", config.get("init_from"))):
    if value:
      raise ValueError(
        f"config.{name} must be empty when training a head (the frozen target is "
        f"config.head.target), got {value!r}."
      )
  layers = tuple(head.feature_layers)
  if any(not is_int(i) or i < 1 for i in layers) or len(set(layers)) != len(layers):
    raise ValueError(
      f"config.head.feature_layers must be distinct layer counts >= 1, got {head.feature_layers!r}."
    )
  if not is_int(head.d_ff) or head.d_ff < 0:
    raise ValueError(f"config.head.d_ff must be an int >= 0 (0: the target's), got {head.d_ff!r}.")
  for name in ("feature_weight", "feature_noise"):
    value = head[name]
    if not is_real(value) or not 0 <= value < float("inf"):
      raise ValueError(f"config.head.{name} must be a finite number >= 0, got {value!r}.")
  if config.seq_len < 2:
    raise ValueError(f"config.seq_len must be >= 2 to train a head, got {config.seq_len}.")
  rules = heads.kind(head.kind).training
  if head.get("warm_start") and not rules.warm_start:
    raise ValueError(f"config.head.warm_start must be False: a {head.kind} head has none.")
  if rules.check:
    rules.check(config)


def target_dir(config: ml_collections.ConfigDict) -> str:
  """The directory of the frozen target: `config.head.target` (a directory, or a hub
  repo id in the local Hugging Face cache: FileNotFoundError naming the field when
  absent) or the bundled pair's."""
  target = config.head.target
  if target and (os.path.isabs(target) or os.path.isdir(target.split("/")[0])):
    return target  # a path: `check_target_dir` names it when missing
  if target:
    from specjax.hf.hub import resolve_checkpoint

    return resolve_checkpoint(target, flag="config.head.target")
  from specjax import pretrained  # imported here: only the default needs it

  return pretrained.TARGET_DIR


def _is_run(path: str) -> bool:
  from specjax.training.checkpoint import MODEL_CONFIG_FILE

  return os.path.isfile(os.path.join(path, MODEL_CONFIG_FILE))


def check_target_dir(path: str, name: str = "config.head.target") -> None:
  """Raises FileNotFoundError, naming `name` (the flag or field that gave `path`),
  unless `path` is a training run of a model (with a checkpoint) or a Hugging
  Face checkpoint directory (config.json): what a frozen target may be."""
  if not os.path.isdir(path):
    raise FileNotFoundError(
      f"{name}: the target directory {path} does not exist (name a training run or a "
      "Hugging Face checkpoint directory)"
    )
  from specjax.training.checkpoint import check_run

  if _is_run(path) or os.path.isfile(os.path.join(path, heads.CONFIG_FILE)):
    check_run(path, name)
  elif not os.path.isfile(os.path.join(path, "config.json")):
    raise FileNotFoundError(
      f"{name}: {path} is neither a training run (no model_config.json) nor a Hugging Face "
      "checkpoint directory (no config.json)"
    )


def target_config(path: str, name: str = "config.head.target") -> ModelConfig:
  """The float32 `ModelConfig` of the target at `path`, from its JSON alone (no weights).

  `path` is a Hugging Face checkpoint directory (config.json + safetensors) or
  a specjax run directory (model_config.json + checkpoints); anything else is
  a FileNotFoundError naming `name` (`check_target_dir`).
  """
  check_target_dir(path, name)
  if _is_run(path):
    from specjax.training.checkpoint import load_model_config

    return load_model_config(path).replace(dtype="float32", param_dtype="float32")
  from specjax.hf.config import model_config
  from specjax.hf.loader import read_config

  return model_config(read_config(path), "float32", source=os.path.join(path, "config.json"))


def load_target(path: str) -> Transformer:
  """The target at `path` (see `target_config`) in float32."""
  if _is_run(path):
    from specjax.training.checkpoint import load_trained_model

    return load_trained_model(path, dtype="float32")[0]
  from specjax.hf.loader import load_model

  return load_model(path, dtype=jnp.float32)[0]


def head_config(config: ml_collections.ConfigDict, target: ModelConfig) -> HeadConfig:
  """The config `config.head` asks for on `target` (its kind's `TrainingRules.fields`);
  ValueError naming the field."""
  head, n = config.head, target.n_layers
  if any(i > n for i in head.feature_layers):
    raise ValueError(
      f"config.head.feature_layers must be layer counts in [1, {n}] (the target has {n} "
      f"layers), got {head.feature_layers!r}."
    )
  if config.seq_len > target.max_seq_len:
    raise ValueError(
      f"config.seq_len must be <= the target's max_seq_len={target.max_seq_len}, "
      f"got {config.seq_len}."
    )
  settings = {}
  for name in heads.kind(head.kind).training.fields:
    if name in head:
      value = head[name]
      settings[name] = tuple(int(i) for i in value) if isinstance(value, tuple | list) else value
  try:
    return heads.config(head.kind, target, **settings)
  except HeadConfigError as e:  # its messages start with the field's name
    raise ValueError(f"config.head.{e}") from e


def prepare(cfg: HeadConfig, workdir: str, tokens=None) -> HeadConfig:
  """`cfg` with what the data decides filled in by its kind (`TrainingRules.prepare`:
  EAGLE-3's draft ids, a resumed run's own or counted on `tokens`); else `cfg`."""
  prepare = heads.of(cfg).training.prepare
  return prepare(cfg, saved_config(workdir), tokens) if prepare else cfg


def saved_config(workdir: str) -> HeadConfig | None:
  """The head config run `workdir` saved (`head_config.json`) when it has a checkpoint
  to resume from; None for a fresh run."""
  from specjax.training.checkpoint import has_checkpoints

  if has_checkpoints(workdir) and os.path.isfile(os.path.join(workdir, heads.CONFIG_FILE)):
    return heads.read_config(workdir)
  return None


def objective(
  params: nnx.State,
  batch: jax.Array,
  target: Transformer,
  key: jax.Array | None = None,
  *,
  graphdef: nnx.GraphDef,
  loss: str = "kl",
  ce_weight: float = 0.0,
  settings: heads.LossSettings | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The training loss of the head `nnx.merge(graphdef, params)` on `batch`.

  Args:
    params: the head's `nnx.Param` state.
    batch: int32 `[B, T + 1]` windows: inputs `[:, :-1]`.
    target: the frozen target the head reads (never differentiated).
    key: PRNG key of the objective's draws where `settings.keyed` (EAGLE's feature
      noise, the block drafters' anchors); None adds no noise and spaces anchors
      evenly (evaluation).
    graphdef: the head's graph definition (`nnx.split(head, nnx.Param)[0]`).
    loss: the divergence, one of `losses.DISTILL_LOSSES`.
    ce_weight: weight of the head's cross-entropy on the corpus.
    settings: the kind's objective settings (`loss_settings`); None: its defaults.

  Returns:
    (scalar loss, metrics), the metrics of the module docstring.

  Raises:
    ValueError: `loss` is not a divergence, or the head was built for a target
      of another shape (at trace time, before anything compiles).
  """
  if loss not in losses.DISTILL_LOSSES:
    raise ValueError(f"loss must be one of {losses.DISTILL_LOSSES} for a head, got {loss!r}.")
  head = nnx.merge(graphdef, params)
  head.cfg.check_target(target.cfg)
  if settings is None:
    settings = heads.of(head.cfg).training.loss()
  value, metrics = heads.of(head.cfg).objective(
    head, target, batch, key, loss=loss, settings=settings
  )
  if ce_weight:
    value = value + ce_weight * metrics["ce"]
  return value, metrics


def load_head_from(where: str, kind: str, target: Transformer) -> nnx.Module:
  """The head a warm start reads (`TrainingRules.warm_start`'s `load`): "bundled" for
  `specjax.pretrained`'s head of `kind`, else a run or export directory
  (`specjax.hf.load_head`), in float32 for `target`."""
  if where == "bundled":
    from specjax import pretrained

    return pretrained.load_head(kind, target)
  import specjax.hf

  return specjax.hf.load_head(where, target)


def num_params(module: nnx.Module) -> int:
  """Number of parameter scalars of any module (a head has no `num_params`)."""
  return sum(x.size for x in jax.tree.leaves(nnx.state(module, nnx.Param)))
