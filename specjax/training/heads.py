"""Training draft heads (EAGLE, Medusa, early exit) on a frozen target.

  python -m experiments.train --config=configs/train_eagle.py --workdir=runs/eagle

`config.head.kind` switches `specjax.training.train` (the same loop, optimizer,
checkpoints and metrics as for models) from training `config.model` to
training `make_head(HeadConfig(kind, target=target.cfg, ...))` on the frozen
target named by `config.head.target`. Only the head's parameters train and are
checkpointed; the run directory records `head_config.json`.

Every objective runs the target once per batch of int32 `[B, T + 1]` windows
(inputs `[:, :-1]`) for its logits `[B, T, V]` and features, under
`stop_gradient`, and distils the target's law into the head's through the
target's own final norm and head (`Transformer.features_to_logits`):

  eagle       f = feature_space(features) (+ N(0, feature_noise^2) in training);
              the head reads (f_t, x_{t+1}) and predicts the feature at t + 1,
              whose law is compared with the target's at t + 1 (t = 0..T-2),
              plus feature_weight * smooth-L1 toward the target's last-layer
              feature there (one feature layer only: fused features have no
              regression target).
  medusa      head k (0-based) at position t against the target's law at
              t + k + 1 (positions whose target lies past the window are left
              out); heads weigh equally.
  eagle3      the training-time test, `ttt_steps` steps: step j's law over the
              draft ids (`ttt_unroll`) against the target's at t + 1 + j gathered
              on them and renormalised, positions whose target argmax lies off
              them left out (SpecForge); loss sum_j 0.8**j * divergence_j;
              alpha_t0_step{j}, alpha_t1_step{j} against the full law.
  early_exit  the adapter on the features after `exit_layer` layers against the
              full target's law at every position, plus feature_weight *
              smooth-L1 toward the last-layer features.
  dflash      the block drafter (DFlash's recipe): up to `num_anchors` anchors
              a per window, distinct, drawn from the key in [1, T - 1] (evenly
              spaced without a key: evaluation); block a reads the context
              before a and its output k (k = 1..B-1) is scored by its
              cross-entropy on the corpus token at a + k, weighted by
              exp(-(k - 1) / loss_decay) and normalised by the weights of the
              positions inside the window (a + k <= T). On target-generated
              data (experiments.generate_data) the corpus tokens are the
              target's own draws, as in the reference.

The divergence is `config.loss` ("kl" = forward KL(p_target || q_head), "tv",
"kl+tv"), plus `config.ce_weight` times the head's cross-entropy on the corpus.
Metrics: `distill`, `ce` (the head's next-token cross-entropy on the corpus),
`alpha_t0` (argmax agreement) and `alpha_t1` (1 - TV) as `losses.agreement`
computes them, `feature` (the smooth-L1 term, where there is one), and for
Medusa the alphas of each head (`alpha_t0_head0`, ...) besides their mean.
The block drafter trains on its decayed cross-entropy (`block_ce`) plus
`config.head.distill_weight` (0: the reference's loss) times `distill`,
`config.loss`'s divergence from the target's law decayed alike; `ce` is the
plain mean cross-entropy, the alphas are over every scored position and per
block position (`alpha_t0_pos1`, ..., powers of two and B - 1), and
`block_accept` is the mean leading run of positions whose argmax is the
target's (the drafts a greedy block keeps on the target's greedy text).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx

from specjax import heads as head_kinds
from specjax.models.config import ModelConfig
from specjax.models.heads import HeadConfig
from specjax.models.transformer import Transformer
from specjax.training import losses
from specjax.validation import is_int, is_real


@dataclasses.dataclass(frozen=True)
class HeadLoss:
  """The weights of a head objective beyond the divergence (hashable: a jit static argument).

  Attributes:
    feature_weight: weight of the smooth-L1 regression toward the target's
      last-layer features (EAGLE with one feature layer, early exit).
    feature_noise: standard deviation of the Gaussian noise added to EAGLE's
      input features in training (EAGLE's robustness to its own errors);
      never added without a key (evaluation).
    ttt_steps: EAGLE-3's training-time test steps.
    num_anchors: the block drafter's anchors per window (at most T - 1 are drawn
      from the key); 0 for the other kinds (they draw no anchors).
    loss_decay: gamma of the block drafter's position weights exp(-(k - 1) / gamma).
    distill_weight: weight of the block drafter's decayed divergence from the
      target's law, added to its decayed cross-entropy (0: the reference's loss).
  """

  feature_weight: float = 0.0
  feature_noise: float = 0.0
  ttt_steps: int = 7
  num_anchors: int = 0
  loss_decay: float = 7.0
  distill_weight: float = 0.0

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict) -> HeadLoss:
    head = config.head
    return cls(
      float(head.feature_weight),
      float(head.feature_noise),
      head.get("ttt_steps", 7),
      int(head.get("num_anchors", BLOCK_FIELDS["num_anchors"][0])) if head.kind == "dflash" else 0,
      float(head.get("loss_decay", 7.0)),
      float(head.get("distill_weight", 0.0)),
    )


def head_kind(config: ml_collections.ConfigDict) -> str:
  """`config.head.kind`, or "" for a config without a `head` section (a model run)."""
  head = config.get("head")
  return head.kind if head else ""


def check_config(config: ml_collections.ConfigDict) -> None:
  """The checks of a head run that need no target: ValueError naming the field."""
  head = config.head
  if head.kind not in head_kinds.NAMES:
    raise ValueError(
      f"config.head.kind must be '' or one of {head_kinds.NAMES}, got {head.kind!r}."
    )
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
  if not is_int(head.num_heads) or not 1 <= head.num_heads <= 16:
    raise ValueError(f"config.head.num_heads must be an int in [1, 16], got {head.num_heads!r}.")
  if head.kind == "medusa" and not head.num_heads < config.seq_len:
    raise ValueError(
      f"config.head.num_heads must be < config.seq_len={config.seq_len} (the last head needs "
      f"a target position in the window), got {head.num_heads!r}."
    )
  if not is_int(head.exit_layer) or head.exit_layer < 1:
    raise ValueError(f"config.head.exit_layer must be an int >= 1, got {head.exit_layer!r}.")
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
  ttt = head.get("ttt_steps", 7)
  if head.kind == "eagle3" and (not is_int(ttt) or not 1 <= ttt <= min(16, config.seq_len - 1)):
    raise ValueError(
      f"config.head.ttt_steps must be an int in [1, {min(16, config.seq_len - 1)}], got {ttt!r}."
    )
  if config.seq_len < 2:
    raise ValueError(f"config.seq_len must be >= 2 to train a head, got {config.seq_len}.")
  if head.kind == "dflash":
    _check_block_drafter(config)


# The block drafter's settings, {field: (default, low, high)} (inclusive; the mask id's
# upper bound is the target's vocabulary, checked in `head_config`).
BLOCK_FIELDS = {
  "block_size": (16, 2, 64),
  "draft_layers": (1, 1, 16),
  "mask_token_id": (-1, -1, None),
  "num_anchors": (32, 1, 1024),
}


def _check_block_drafter(config: ml_collections.ConfigDict) -> None:
  """The block drafter's fields: ValueError naming the field and its range."""
  head = config.head
  for name, (default, low, high) in BLOCK_FIELDS.items():
    value = head.get(name, default)
    if not is_int(value) or value < low or (high is not None and value > high):
      allowed = f"in [{low}, {high}]" if high is not None else f">= {low}"
      raise ValueError(f"config.head.{name} must be an int {allowed}, got {value!r}.")
  block = head.get("block_size", 16)
  if not config.seq_len > block:
    raise ValueError(
      f"config.seq_len must be > config.head.block_size={block} (a block needs its context "
      f"and targets in the window), got {config.seq_len}."
    )
  decay = head.get("loss_decay", 7.0)
  if not is_real(decay) or not 0 < decay < float("inf"):
    raise ValueError(f"config.head.loss_decay must be a finite number > 0, got {decay!r}.")
  weight = head.get("distill_weight", 0.0)
  if not is_real(weight) or not 0 <= weight < float("inf"):
    raise ValueError(f"config.head.distill_weight must be a finite number >= 0, got {weight!r}.")


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
  from specjax.training.checkpoint import HEAD_CONFIG_FILE, check_run

  if _is_run(path) or os.path.isfile(os.path.join(path, HEAD_CONFIG_FILE)):
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
  """The `HeadConfig` `config.head` asks for on `target`; ValueError naming the field."""
  head, n = config.head, target.n_layers
  if head.kind == "early_exit" and not head.exit_layer < n:
    raise ValueError(
      f"config.head.exit_layer must be in [1, {n - 1}] (the target has {n} layers), "
      f"got {head.exit_layer!r}."
    )
  if any(i > n for i in head.feature_layers):
    raise ValueError(
      f"config.head.feature_layers must be layer counts in [1, {n}] (the target has {n} "
      f"layers), got {head.feature_layers!r}."
    )
  mask_id = head.get("mask_token_id", -1)
  if head.kind == "dflash" and not mask_id < target.vocab_size:
    raise ValueError(
      f"config.head.mask_token_id must be -1 (a learned mask embedding) or an id in "
      f"[0, {target.vocab_size}) (the target's vocabulary), got {mask_id!r}."
    )
  if config.seq_len > target.max_seq_len:
    raise ValueError(
      f"config.seq_len must be <= the target's max_seq_len={target.max_seq_len}, "
      f"got {config.seq_len}."
    )
  return HeadConfig(
    kind=head.kind,
    target=target,
    num_heads=int(head.num_heads),
    exit_layer=int(head.exit_layer),
    feature_layers=tuple(int(i) for i in head.feature_layers),
    d_ff=int(head.d_ff),
    draft_vocab_size=head.get("draft_vocab_size", 0) if head.kind == "eagle3" else 0,
    **(_block_settings(head) if head.kind == "dflash" else {}),
  )


def _block_settings(head: ml_collections.ConfigDict) -> dict[str, int]:
  """The block drafter's `HeadConfig` fields from `config.head`."""
  return {name: int(head.get(name, BLOCK_FIELDS[name][0])) for name in BLOCK_HEAD_FIELDS}


BLOCK_HEAD_FIELDS = ("block_size", "draft_layers", "mask_token_id")  # the module's; the rest: loss


def with_draft_ids(cfg: HeadConfig, workdir: str, tokens=None) -> HeadConfig:
  """`cfg` with EAGLE-3's draft ids where it lacks them: a resumed run's own, else
  `draft_vocab_ids` of the first 2**26 `tokens` (the training split's)."""
  if cfg.kind != "eagle3" or cfg.draft_ids or cfg.draft_vocab == cfg.target.vocab_size:
    return cfg
  from specjax.training import checkpoint as ckpt

  if ckpt.has_checkpoints(workdir) and os.path.isfile(os.path.join(workdir, ckpt.HEAD_CONFIG_FILE)):
    saved = ckpt.load_head_config(workdir)
    if saved.kind == "eagle3" and saved.draft_vocab == cfg.draft_vocab:
      return dataclasses.replace(cfg, draft_ids=saved.draft_ids)
  if tokens is None:
    return cfg
  from specjax.models.eagle3 import draft_vocab_ids

  ids = draft_vocab_ids(tokens[: 1 << 26], cfg.target.vocab_size, cfg.draft_vocab)
  return dataclasses.replace(cfg, draft_ids=ids)


def smooth_l1(pred: jax.Array, target: jax.Array) -> jax.Array:
  """Mean smooth-L1 (Huber with delta 1) over all elements, as EAGLE's feature loss."""
  return optax.huber_loss(pred.astype(jnp.float32), target.astype(jnp.float32), delta=1.0).mean()


def _target_outputs(target: Transformer, inputs: jax.Array, return_hidden):
  """The frozen target on `inputs [B, T]`: (logits `[B, T, V]`, features `[B, T, F]`)."""
  b, t = inputs.shape
  logits, _, features = target.forward_cached(
    inputs, target.init_cache(b, t), return_hidden=return_hidden
  )
  return jax.lax.stop_gradient(logits), jax.lax.stop_gradient(features)


def _law_metrics(loss: str, p_logits, q_logits, labels) -> dict[str, jax.Array]:
  """Divergence, the head's cross-entropy on `labels` and the agreement of p and q."""
  return {
    "distill": losses.distill_loss(loss, p_logits, q_logits),
    "ce": losses.cross_entropy(q_logits, labels),
    **losses.agreement(p_logits, q_logits),
  }


def eagle_objective(head, target, batch, key, *, loss, settings):
  """EAGLE: the head's next feature from (feature, next token); see the module docstring."""
  inputs = batch[:, :-1]
  p_logits, features = _target_outputs(target, inputs, head.cfg.target_features)
  f = head.feature_space(features)
  if key is not None and settings.feature_noise > 0:
    f = f + settings.feature_noise * jax.random.normal(key, f.shape, f.dtype)
  pred = head(target, f[:, :-1], inputs[:, 1:])  # [B, T - 1, D]: positions 1..T-1
  metrics = _law_metrics(loss, p_logits[:, 1:], target.features_to_logits(pred), batch[:, 2:])
  value = metrics["distill"]
  if head.cfg.num_features == 1:  # fused features have no regression target
    metrics["feature"] = smooth_l1(pred, features[:, 1:])
    value = value + settings.feature_weight * metrics["feature"]
  return value, metrics


def medusa_objective(head, target, batch, key, *, loss, settings):
  """Medusa-1: head k at position t against the target's law at t + k + 1."""
  del key, settings  # no noise, no feature target
  inputs = batch[:, :-1]
  t = inputs.shape[1]
  p_logits, features = _target_outputs(target, inputs, True)
  drafted = head(features)  # [B, T, K, D]
  per_head = []
  for k in range(head.cfg.num_heads):
    # Positions 0..T-k-2 have their target law (at t + k + 1) inside the window;
    # the vocabulary projection runs on those only.
    n = t - k - 1
    q_logits = target.features_to_logits(drafted[:, :n, k])
    per_head.append(_law_metrics(loss, p_logits[:, k + 1 :], q_logits, batch[:, k + 2 :]))
  metrics = {name: jnp.mean(jnp.stack([m[name] for m in per_head])) for name in per_head[0]}
  for k, m in enumerate(per_head):
    metrics[f"alpha_t0_head{k}"] = m["alpha_t0"]
    metrics[f"alpha_t1_head{k}"] = m["alpha_t1"]
  return metrics["distill"], metrics


def early_exit_objective(head, target, batch, key, *, loss, settings):
  """Early exit: the adapter on layer-`exit_layer` features against the full target."""
  del key
  inputs = batch[:, :-1]
  d, k = target.cfg.d_model, head.cfg.exit_layer
  # One target call gives the law and both feature sets: layer k, then the last.
  p_logits, features = _target_outputs(target, inputs, (k, target.cfg.n_layers))
  pred = head(features[..., :d])
  metrics = _law_metrics(loss, p_logits, target.features_to_logits(pred), batch[:, 1:])
  metrics["feature"] = smooth_l1(pred, features[..., d:])
  return metrics["distill"] + settings.feature_weight * metrics["feature"], metrics


def _ttt_mask(n: int, steps: int, j: int) -> jax.Array:
  """`[n - j, steps * n]`: step j's row t reads step 0's rows <= t and steps 1..j's
  row t (slot i * n + s: step i's row s), the cache drafting has."""
  t = jnp.arange(n - j)[:, None]
  step, row = jnp.arange(steps * n) // n, jnp.arange(steps * n) % n
  return ((step == 0) & (row <= t)) | ((step >= 1) & (step <= j) & (row == t))


def ttt_unroll(head, target, inputs: jax.Array, features: jax.Array, steps: int) -> list:
  """EAGLE-3's training-time test on `inputs [B, T]`, `features [B, T, 3D]`: step
  j's h' `[B, T - 1 - j, D]`; row r at position r + j, read with token r + 1 + j,
  is drafting's j-th step after position r (step 0 reads the target's features)."""
  b, n = inputs.shape[0], inputs.shape[1] - 1
  h, c = head.feature_space(features[:, :n]), head.midlayer.attn.cfg
  zeros = jnp.zeros((b, c.n_kv_heads, steps * n, c.resolved_head_dim), h.dtype)
  kv, out = (zeros, zeros), []
  for j in range(steps):
    m = n - j
    x = head.layer_input(target, h[:, :m], inputs[:, 1 + j : 1 + j + m])
    positions = jnp.broadcast_to(jnp.arange(m) + j, (b, m))
    mask = jnp.broadcast_to(_ttt_mask(n, steps, j), (b, m, steps * n))
    starts = jnp.full((b,), j * n, jnp.int32)
    h, kv = head.midlayer(x, positions, mask, kv, starts, contiguous=False)
    out.append(h)
  return out


def eagle3_objective(head, target, batch, key, *, loss, settings):
  """EAGLE-3's training-time test; see the module docstring."""
  del key
  inputs, v = batch[:, :-1], target.cfg.vocab_size
  p_logits, features = _target_outputs(target, inputs, head.cfg.target_features)
  ids = jnp.asarray(head.cfg.draft_ids or range(v), jnp.int32)  # draft id -> target id
  in_vocab = jnp.zeros(v, bool).at[ids].set(True)
  value, metrics = 0.0, {}
  for j, h in enumerate(ttt_unroll(head, target, inputs, features, settings.ttt_steps)):
    m = h.shape[1]
    log_q = jax.nn.log_softmax(head.draft_logits(h))  # [B, m, K]
    p_full = p_logits[:, 1 + j : 1 + j + m]
    log_p = jax.nn.log_softmax(p_full[..., ids])  # renormalised on the draft ids
    p, q = jnp.exp(log_p), jnp.exp(log_q)
    div = 0.0
    if "kl" in loss:
      div = div + (p * (log_p - log_q)).sum(-1)
    if "tv" in loss:
      div = div + 0.5 * jnp.abs(p - q).sum(-1)
    value = value + 0.8**j * jnp.mean(div * in_vocab[p_full.argmax(-1)])
    metrics[f"alpha_t0_step{j}"] = jnp.mean(ids[log_q.argmax(-1)] == p_full.argmax(-1))
    p_true = jax.nn.softmax(p_full)[..., ids]
    metrics[f"alpha_t1_step{j}"] = jnp.mean(jnp.minimum(p_true, q).sum(-1))
    if j == 0:  # the head's cross-entropy on the corpus, over the labels it can draft
      labels = batch[:, 2 : 2 + m]
      draft_of = jnp.zeros(v, jnp.int32).at[ids].set(jnp.arange(ids.size))
      nll = -jnp.take_along_axis(log_q, draft_of[labels][..., None], -1)[..., 0]
      ok = in_vocab[labels]
      metrics["ce"] = jnp.sum(nll * ok) / jnp.maximum(ok.sum(), 1)
  metrics.update(distill=value, alpha_t0=metrics["alpha_t0_step0"])
  metrics["alpha_t1"] = metrics["alpha_t1_step0"]
  return value, metrics


def block_anchors(key: jax.Array | None, batch: int, t: int, num: int) -> jax.Array:
  """int32 `[B, A]` distinct anchors in [1, T - 1] per row, A = min(num, T - 1): drawn
  uniformly from `key`, or evenly spaced without one (evaluation: the same every call)."""
  a = min(num, t - 1)
  if key is None:
    row = jnp.round(jnp.linspace(1, t - 1, a)).astype(jnp.int32)
    return jnp.broadcast_to(row, (batch, a))
  # The first A of a random permutation per row: A distinct positions.
  order = jnp.argsort(jax.random.uniform(key, (batch, t - 1)), axis=1)
  return (order[:, :a] + 1).astype(jnp.int32)


def _leading_run(ok: jax.Array) -> jax.Array:
  """`[..., K]` bools -> the length of each leading run of True `[...]`."""
  return jnp.cumprod(ok.astype(jnp.int32), axis=-1).sum(-1)


def dflash_objective(head, target, batch, key, *, loss, settings):
  """The block drafter: decayed cross-entropy of each block; see the module docstring."""
  inputs = batch[:, :-1]
  (b, t), n = inputs.shape, head.cfg.block_size
  if settings.num_anchors < 1:
    raise ValueError(f"a block drafter needs num_anchors >= 1, got {settings.num_anchors}.")
  p_logits, features = _target_outputs(target, inputs, head.cfg.target_features)
  anchors = block_anchors(key, b, t, settings.num_anchors)  # [B, A]
  q_logits = head(target, features, inputs, anchors)  # [B, A, n - 1, V]
  a = anchors.shape[1]
  k = jnp.arange(1, n, dtype=jnp.int32)
  where = anchors[:, :, None] + k  # [B, A, n - 1]: the drafted token's index in batch
  valid = where <= t
  flat = jnp.minimum(where, t).reshape(b, a * (n - 1))
  labels = jnp.take_along_axis(batch, flat, axis=1).reshape(b, a, n - 1)
  # The target's law of the token at index i is its output at i - 1.
  p_logits = jnp.take_along_axis(p_logits, (flat - 1)[..., None], axis=1)
  p_logits = p_logits.reshape(b, a, n - 1, -1)
  weights = jnp.exp(-(k - 1) / settings.loss_decay) * valid  # [B, A, n - 1]
  total, count = jnp.maximum(weights.sum(), 1e-9), jnp.maximum(valid.sum(), 1)

  def decayed(x):  # the weighted mean over scored positions
    return jnp.sum(x * weights) / total

  def mean(x):  # the plain mean over scored positions
    return jnp.sum(x * valid) / count

  log_q = jax.nn.log_softmax(q_logits)
  log_p = jax.nn.log_softmax(p_logits)
  p, q = jnp.exp(log_p), jnp.exp(log_q)
  nll = -jnp.take_along_axis(log_q, labels[..., None], axis=-1)[..., 0]
  tv = 0.5 * jnp.abs(p - q).sum(-1)
  div = 0.0
  if "kl" in loss:
    div = div + (p * (log_p - log_q)).sum(-1)
  if "tv" in loss:
    div = div + tv
  same = q_logits.argmax(-1) == p_logits.argmax(-1)  # [B, A, n - 1]
  whole = valid.all(-1)  # blocks whose every output is scored
  metrics = {
    "block_ce": decayed(nll),
    "distill": decayed(div),
    "ce": mean(nll),
    "alpha_t0": mean(same),
    "alpha_t1": mean(1.0 - tv),
    "block_accept": jnp.sum(_leading_run(same) * whole) / jnp.maximum(whole.sum(), 1),
  }
  for i in sorted({*(2**j for j in range(7) if 2**j < n), n - 1}):
    ok = valid[..., i - 1]
    metrics[f"alpha_t0_pos{i}"] = jnp.sum(same[..., i - 1] * ok) / jnp.maximum(ok.sum(), 1)
  value = metrics["block_ce"]
  if settings.distill_weight:
    value = value + settings.distill_weight * metrics["distill"]
  return value, metrics


OBJECTIVES: dict[str, Callable] = {
  "eagle": eagle_objective,
  "medusa": medusa_objective,
  "early_exit": early_exit_objective,
  "eagle3": eagle3_objective,
  "dflash": dflash_objective,
}
if tuple(OBJECTIVES) != head_kinds.NAMES:  # one objective per kind of the one list
  raise ImportError(f"OBJECTIVES {tuple(OBJECTIVES)} and specjax.heads.NAMES differ.")


def objective(
  params: nnx.State,
  batch: jax.Array,
  target: Transformer,
  key: jax.Array | None = None,
  *,
  graphdef: nnx.GraphDef,
  loss: str = "kl",
  ce_weight: float = 0.0,
  settings: HeadLoss = HeadLoss(),
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The training loss of the head `nnx.merge(graphdef, params)` on `batch`.

  Args:
    params: the head's `nnx.Param` state.
    batch: int32 `[B, T + 1]` windows: inputs `[:, :-1]`.
    target: the frozen target the head reads (never differentiated).
    key: PRNG key of EAGLE's feature noise and of the block drafter's anchors;
      None adds no noise and spaces anchors evenly (evaluation).
    graphdef: the head's graph definition (`nnx.split(head, nnx.Param)[0]`).
    loss: the divergence, one of `losses.DISTILL_LOSSES`.
    ce_weight: weight of the head's cross-entropy on the corpus.
    settings: feature-loss weight and noise (`HeadLoss`).

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
  value, metrics = OBJECTIVES[head.cfg.kind](head, target, batch, key, loss=loss, settings=settings)
  if ce_weight:
    value = value + ce_weight * metrics["ce"]
  return value, metrics


def num_params(module: nnx.Module) -> int:
  """Number of parameter scalars of any module (a head has no `num_params`)."""
  return sum(x.size for x in jax.tree.leaves(nnx.state(module, nnx.Param)))
