"""Early exit (Kangaroo, Liu et al. 2024, arXiv 2404.18911), everything it is: settings
(`EarlyExitConfig`), module (`ExitAdapter`), drafter (`EarlyExitDrafter`), training
objective, growth rule and record. It has no hub layout.

The draft is the target's first `exit_layer` layers, a trained `ExitAdapter` (one
decoder layer) and the target's final norm and head: no second model. Its two caches
follow a draft model's invariant (`specjax.drafting.model`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx, struct

from specjax import losses
from specjax.drafting.base import VocabSubset, check_confidence
from specjax.drafting.model import CachedDrafting
from specjax.heads.base import (
  HeadConfig,
  HeadConfigError,
  HeadKind,
  LossSettings,
  TrainingRules,
  one_layer_cache,
)
from specjax.models.kv_cache import KVCache, check_capacity
from specjax.models.transformer import Block, Transformer, run_blocks
from specjax.validation import is_int
from specjax.vocab import fit_ids


@dataclasses.dataclass(frozen=True)
class EarlyExitConfig(HeadConfig):
  """An early-exit adapter's settings (besides `HeadConfig`'s; `d_ff` is its layer's
  MLP width).

  Attributes:
    exit_layer: exit after this many target layers, in [1, n_layers).
  """

  kind = "early_exit"

  exit_layer: int = 2

  def check_settings(self, layers):
    n = self.target.n_layers
    if not is_int(self.exit_layer) or not 1 <= self.exit_layer < n:
      raise HeadConfigError(
        f"exit_layer must be an int in [1, {n - 1}] (the target has {n} layers), "
        f"got {self.exit_layer!r}."
      )
    return layers

  @property
  def target_features(self) -> bool:
    return False  # the drafter runs the target's first layers itself

  def moved_to(self, target, move):
    moved = super().moved_to(target, move)
    return dataclasses.replace(moved, exit_layer=move(self.exit_layer))


class ExitAdapter(nnx.Module):
  """Early exit: one decoder layer maps the residual stream after the target's
  first `exit_layer` layers to an estimate of its last-layer features."""

  def __init__(self, cfg: EarlyExitConfig, *, rngs: nnx.Rngs):
    if not isinstance(cfg, EarlyExitConfig):
      raise ValueError(f"ExitAdapter needs an EarlyExitConfig, got {type(cfg).__name__}.")
    self.cfg = cfg
    self.block = Block(cfg.block_config, rngs=rngs)

  def init_cache(self, batch: int, capacity: int) -> KVCache:
    """An empty cache of its one decoder layer."""
    return one_layer_cache(self.cfg, batch, capacity)

  def __call__(self, features: jax.Array) -> jax.Array:
    """Training form: `[B, T, D]` layer-k features -> `[B, T, D]`, causal, no cache."""
    b, t, _ = features.shape
    return self.forward_cached(features, self.init_cache(b, t))[0]

  def forward_cached(self, features: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
    x, cache, _ = run_blocks([self.block], features, cache)
    return x, cache


# -- drafting


@struct.dataclass
class EarlyExitDrafter(CachedDrafting, VocabSubset):
  """The target's first layers + an `ExitAdapter` + the target's head.

  Attributes:
    target: the target (its first `adapter.cfg.exit_layer` layers run here).
    adapter: the trained `ExitAdapter`.
    confidence: stop drafting a row below this top probability.
    vocab_subset: None, or `[K]` ids to draft among (FR-Spec).

  """

  target: Transformer
  adapter: ExitAdapter
  confidence: float = struct.field(pytree_node=False, default=0.0)
  vocab_subset: jax.Array | None = None

  # Its draft step costs a large share of a target step (2 of 6 target layers + the
  # adapter + the head): it pays off at gamma 1, not 4 (the comparison in docs/heads.md).
  preferred_gamma = 1

  def __post_init__(self):
    self.adapter.cfg.check_target(self.target.cfg)
    check_confidence(self.confidence)

  @property
  def vocab_size(self) -> int:
    return self.target.cfg.vocab_size

  @property
  def exit_layer(self) -> int:
    return self.adapter.cfg.exit_layer

  def check_capacity(self, prompt_width: int, max_new_tokens: int, gamma: int) -> None:
    check_capacity("early exit", self.target.cfg.max_seq_len, prompt_width, max_new_tokens, gamma)

  def _new_state(self, batch: int, capacity: int) -> tuple[KVCache, KVCache]:
    layers = self.target.init_cache(batch, capacity, num_layers=self.exit_layer)
    return layers, self.adapter.init_cache(batch, capacity)

  feeds_forced = True

  def _with_lengths(self, state, lengths):
    return tuple(cache.with_lengths(lengths) for cache in state)

  def _lengths(self, state):
    return state[0].lengths

  def _forward(self, tokens, state, logit_indices=None):
    layers, adapter = state
    b = tokens.shape[0]
    # The first layers' own logits are never used: ask for none of them.
    _, layers, features = self.target.forward_cached(
      fit_ids(tokens, self.vocab_size),
      layers,
      logit_indices=jnp.zeros((b, 0), jnp.int32),
      num_layers=self.exit_layer,
      return_hidden=True,
    )
    x, adapter = self.adapter.forward_cached(features, adapter)  # every position: its cache
    if logit_indices is not None:
      x = jnp.take_along_axis(x, logit_indices[:, :, None], axis=1)
    return self._logits(x), (layers, adapter)


# -- training


def early_exit_objective(head, target, batch, key, *, loss, settings):
  """Early exit: the adapter on the features after `exit_layer` layers against the full
  target's law at every position, plus feature_weight * smooth-L1 toward the last-layer
  features."""
  del key
  inputs = batch[:, :-1]
  d, k = target.cfg.d_model, head.cfg.exit_layer
  # One target call gives the law and both feature sets: layer k, then the last.
  p_logits, features = losses.target_outputs(target, inputs, (k, target.cfg.n_layers))
  pred = head(features[..., :d])
  metrics = losses.law_metrics(loss, p_logits, target.features_to_logits(pred), batch[:, 1:])
  metrics["feature"] = losses.smooth_l1(pred, features[..., d:])
  return metrics["distill"] + settings.feature_weight * metrics["feature"], metrics


def _check_training(config) -> None:
  exit_layer = config.head.exit_layer
  if not is_int(exit_layer) or exit_layer < 1:
    raise ValueError(f"config.head.exit_layer must be an int >= 1, got {exit_layer!r}.")


@dataclasses.dataclass(frozen=True)
class EarlyExitLoss(LossSettings):
  """The early-exit adapter's objective settings (`config.head`).

  Attributes:
    feature_weight: weight of the smooth-L1 regression toward the target's last-layer
      features.
  """

  feature_weight: float = 0.0

  @classmethod
  def from_config(cls, head) -> EarlyExitLoss:
    return cls(feature_weight=float(head.get("feature_weight", cls.feature_weight)))


KIND = HeadKind(
  name="early_exit",
  title="early exit",
  config=EarlyExitConfig,
  make=ExitAdapter,
  drafter=EarlyExitDrafter,
  holds="adapter",
  objective=early_exit_objective,
  training=TrainingRules(fields=("exit_layer", "d_ff"), check=_check_training, loss=EarlyExitLoss),
)
