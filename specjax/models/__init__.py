"""Models: the configuration, the transformer and its KV cache."""

from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache
from specjax.models.transformer import Transformer

__all__ = ["ModelConfig", "KVCache", "Transformer"]
