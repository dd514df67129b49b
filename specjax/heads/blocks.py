"""What the block drafters' training shares (`specjax.heads.dflash`, `dspark`): a batch
laid out as blocks at anchors (`block_batch`), the block loss with its per-position
metrics (`block_loss`), warm starts that carry a drafter's parameters onto a wider one
(`transfer`), and the checks of a run's real-valued settings (`check_reals`)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from specjax import losses
from specjax.validation import is_real


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


class BlockBatch(NamedTuple):
  """A training batch laid out as a block drafter's blocks (`block_batch`).

  Attributes:
    inputs: `[B, T]` the window's inputs; features `[B, T, F]` the target's at them.
    anchors: `[B, A]` the blocks' anchors.
    labels: `[B, A, m]` the corpus token a block's k-th draft drafts (at a + k; m
      the head's `drafts_per_call`).
    previous: `[B, A, m]` the token before it (at a + k - 1; k = 1: the anchor's).
    p_logits: `[B, A, m, V]` the target's logits of that token.
    valid: `[B, A, m]` whether a + k lies in the window.
    weights: `[B, A, m]` exp(-(k - 1) / loss_decay) where valid, else 0.
  """

  inputs: jax.Array
  features: jax.Array
  anchors: jax.Array
  labels: jax.Array
  previous: jax.Array
  p_logits: jax.Array
  valid: jax.Array
  weights: jax.Array


def block_batch(head, target, batch, key, settings) -> BlockBatch:
  """The blocks of windows `batch [B, T + 1]`: up to `num_anchors` distinct anchors a
  per window drawn from `key` in [1, T - 1] (evenly spaced without a key: evaluation),
  the block's k-th draft (k = 1..`head.drafts_per_call`) the corpus token at a + k."""
  inputs = batch[:, :-1]
  (b, t), m = inputs.shape, head.drafts_per_call
  if settings.num_anchors < 1:
    raise ValueError(f"a block drafter needs num_anchors >= 1, got {settings.num_anchors}.")
  p_logits, features = losses.target_outputs(target, inputs, head.cfg.target_features)
  anchors = block_anchors(key, b, t, settings.num_anchors)  # [B, A]
  a = anchors.shape[1]
  k = jnp.arange(1, m + 1, dtype=jnp.int32)
  where = anchors[:, :, None] + k  # [B, A, m]: the drafted token's index in batch
  valid = where <= t
  flat = jnp.minimum(where, t).reshape(b, a * m)
  labels = jnp.take_along_axis(batch, flat, axis=1).reshape(b, a, m)
  previous = jnp.take_along_axis(batch, flat - 1, axis=1).reshape(b, a, m)
  # The target's law of the token at index i is its output at i - 1.
  p_logits = jnp.take_along_axis(p_logits, (flat - 1)[..., None], axis=1)
  p_logits = p_logits.reshape(b, a, m, -1)
  weights = jnp.exp(-(k - 1) / settings.loss_decay) * valid
  return BlockBatch(inputs, features, anchors, labels, previous, p_logits, valid, weights)


def block_loss(q_logits, blocks: BlockBatch, loss, settings):
  """The block drafter's loss and metrics for its logits `q_logits [B, A, n - 1, V]`
  of `blocks`' tokens (see `dflash.dflash_objective`): the acceptance-shaped mix
  (1 - l1_mix) * decayed cross-entropy + l1_mix * decayed L1, plus `distill_weight`
  times the decayed divergence `loss`. L1 = sum |p - q| = 2 TV(p, q), and 1 - TV is
  token verification's chance of keeping a draft, so the L1 term maximises acceptance
  itself; the cross-entropy on the text keeps the argmax on the target's tokens."""
  valid, weights, p_logits, labels = blocks.valid, blocks.weights, blocks.p_logits, blocks.labels
  total, count = jnp.maximum(weights.sum(), 1e-9), jnp.maximum(valid.sum(), 1)

  def decayed(x):  # the weighted mean over scored positions
    return jnp.sum(x * weights) / total

  def mean(x):  # the plain mean over scored positions
    return jnp.sum(x * valid) / count

  log_q = jax.nn.log_softmax(q_logits)
  log_p = jax.nn.log_softmax(p_logits)
  p, q = jnp.exp(log_p), jnp.exp(log_q)
  nll = -jnp.take_along_axis(log_q, labels[..., None], axis=-1)[..., 0]
  l1 = jnp.abs(p - q).sum(-1)
  div = 0.0
  if "kl" in loss:
    div = div + (p * (log_p - log_q)).sum(-1)
  if "tv" in loss:
    div = div + 0.5 * l1
  same = q_logits.argmax(-1) == p_logits.argmax(-1)  # [B, A, n - 1]
  whole = valid.all(-1)  # blocks whose every output is scored
  metrics = {
    "block_ce": decayed(nll),
    "block_l1": decayed(l1),
    "distill": decayed(div),
    "ce": mean(nll),
    "alpha_t0": mean(same),
    "alpha_t1": mean(1.0 - 0.5 * l1),
    "block_accept": jnp.sum(_leading_run(same) * whole) / jnp.maximum(whole.sum(), 1),
    **position_metrics("alpha_t0", same, valid),
    **position_metrics("alpha_t1", 1.0 - 0.5 * l1, valid),
  }
  mix = settings.l1_mix
  value = (1.0 - mix) * metrics["block_ce"] + mix * metrics["block_l1"]
  if settings.distill_weight:
    value = value + settings.distill_weight * metrics["distill"]
  return value, metrics


def position_metrics(name: str, x: jax.Array, valid: jax.Array) -> dict[str, jax.Array]:
  """`x [..., m]`'s mean over `valid` rows at each block position k (1-based):
  `{name}_pos{k}`, every position of blocks up to 16 drafts, else powers of two and m."""
  m = x.shape[-1]
  positions = range(1, m + 1) if m <= 16 else sorted({*(2**j for j in range(7) if 2**j < m), m})
  out = {}
  for k in positions:
    ok = valid[..., k - 1]
    out[f"{name}_pos{k}"] = jnp.sum(x[..., k - 1] * ok) / jnp.maximum(ok.sum(), 1)
  return out


def check_reals(head, fields: dict) -> None:
  """`config.head`'s real-valued `fields` ({name: (default, low, high)}), each finite and
  in its range: ValueError naming the field and the range."""
  for name, (default, low, high) in fields.items():
    value = head.get(name, default)
    top = float("inf") if high is None else high
    if not is_real(value) or not low <= value <= top or value == float("inf"):
      allowed = f"in [{low}, {high}]" if high is not None else f">= {low}"
      raise ValueError(f"config.head.{name} must be a finite number {allowed}, got {value!r}.")


def transfer(head: nnx.Module, source: nnx.Module, where: str) -> nnx.Module:
  """`head` (a `dflash.DFlashHead`) with `source`'s parameters at the same paths (a block
  drafter's; a sequential one's Markov and confidence heads too where `head` has them);
  `fc`'s input blocks go to the source's feature layers among `head`'s, zero for the
  layers it did not read, so the warm-started head drafts what `source` drafts. `where`
  names the source in errors: ValueError naming the `config.head` field that differs."""
  hc, sc = head.cfg, source.cfg
  for name in ("block_size", "draft_layers", "mask_token_id", "d_ff"):
    if getattr(hc, name) != getattr(sc, name):
      raise ValueError(
        f"config.head.{name} is {getattr(hc, name)!r}, but {where} has {getattr(sc, name)!r}."
      )
  have, want = sorted(sc.feature_layers), sorted(hc.feature_layers)
  if not set(have) <= set(want):
    raise ValueError(
      f"config.head.feature_layers {tuple(want)} must include the layers {where} reads, "
      f"{tuple(have)}."
    )
  hc.check_target(sc.target, f"{where}'s target")
  d = head.layer_config.d_model
  params = dict(nnx.to_flat_state(nnx.state(head, nnx.Param)))
  for path, variable in nnx.to_flat_state(nnx.state(source, nnx.Param)):
    if path not in params:
      continue  # a sequential drafter's own heads, into a block drafter
    value = jnp.asarray(variable.get_value())
    if path == ("fc", "kernel"):
      spread = jnp.zeros((len(want) * d, d), value.dtype)
      for i, layer in enumerate(have):
        j = want.index(layer)
        spread = spread.at[j * d : (j + 1) * d].set(value[i * d : (i + 1) * d])
      value = spread
    own = params[path].get_value()
    if value.shape != own.shape:
      raise ValueError(
        f"{where}'s {'.'.join(map(str, path))} has shape {value.shape}, the head's {own.shape} "
        "(another markov_rank or head setting)."
      )
    params[path] = params[path].replace(value.astype(own.dtype))
  nnx.update(head, nnx.from_flat_state(list(params.items())))
  return head
