"""Hugging Face checkpoints: load Llama, Mistral, Qwen2 and GPT-2 from a local directory.

  model, tokenizer = specjax.hf.load_model("/path/to/dir", dtype=jnp.bfloat16)

No network access: the directory must hold config.json and safetensors weights.
"""

from specjax.hf.config import SUPPORTED, UnsupportedConfigError, model_config
from specjax.hf.loader import check_same_tokenizer, load_model, load_tokenizer, read_config

__all__ = [
  "SUPPORTED",
  "UnsupportedConfigError",
  "check_same_tokenizer",
  "load_model",
  "load_tokenizer",
  "model_config",
  "read_config",
]
