"""Models: the configuration, the transformer and its KV cache; function-preserving
expansion to larger shapes (`expand`, `specjax/models/expand.py`). Draft heads are
`specjax.heads`'."""

from specjax.models.config import ModelConfig
from specjax.models.expand import (
  check_expansion,
  expand,
  expanded_config,
  expanded_layer_count,
  layer_map,
)
from specjax.models.kv_cache import KVCache
from specjax.models.transformer import Transformer

__all__ = [
  "ModelConfig",
  "KVCache",
  "Transformer",
  "check_expansion",
  "expand",
  "expanded_config",
  "expanded_layer_count",
  "layer_map",
]
