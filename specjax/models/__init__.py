"""Models: the configuration, the transformer and its KV cache; function-preserving
expansion to larger shapes (`expand`, `specjax/models/expand.py`)."""

from specjax.models import eagle3
from specjax.models.config import ModelConfig
from specjax.models.expand import (
  check_expansion,
  expand,
  expand_head,
  expanded_config,
  expanded_layer_count,
  layer_map,
)
from specjax.models.kv_cache import KVCache
from specjax.models.transformer import Transformer

__all__ = [
  "eagle3",
  "ModelConfig",
  "KVCache",
  "Transformer",
  "check_expansion",
  "expand",
  "expand_head",
  "expanded_config",
  "expanded_layer_count",
  "layer_map",
]
