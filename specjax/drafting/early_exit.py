"""Early-exit self-speculation (Kangaroo, Liu et al. 2024, arXiv 2404.18911).

The draft is the target's first `exit_layer` layers, a trained `ExitAdapter`
(one decoder layer) and the target's final norm and head: no second model. Its
two caches follow a draft model's invariant (`specjax.drafting.model`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specjax.drafting.base import VocabSubset, check_confidence
from specjax.drafting.model import CachedDrafting
from specjax.models.heads import ExitAdapter
from specjax.models.kv_cache import KVCache, check_capacity
from specjax.models.transformer import Transformer
from specjax.vocab import fit_ids


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

  def _with_lengths(self, state, lengths):
    return tuple(cache.with_lengths(lengths) for cache in state)

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
