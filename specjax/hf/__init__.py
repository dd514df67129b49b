"""Hugging Face checkpoints: load Llama, Mistral, Qwen2 and GPT-2 from a local
directory or the local Hugging Face cache.

  model, tokenizer = specjax.hf.load_model("/path/to/dir", dtype=jnp.bfloat16)
  model, tokenizer = specjax.hf.load_model("Qwen/Qwen2.5-0.5B")   # cached repo id
  settings = specjax.hf.generation_settings("Qwen/Qwen2.5-0.5B")  # EOS ids, sampling
  head = specjax.hf.load_head("yuhuili/EAGLE-Vicuna-7B-v1.3", target)  # a hub head's module
  drafter = specjax.hf.load_drafter("yuhuili/EAGLE-Vicuna-7B-v1.3", target)  # its drafter
  specjax.hf.save_head(drafter, "out")  # EAGLE-3 as vLLM / SGLang load it (`specjax.hf.heads`)

No network access unless asked for (`allow_download`): the directory or cached
snapshot must hold config.json and safetensors weights.
"""

from specjax.hf.config import SUPPORTED, UnsupportedConfigError, model_config
from specjax.hf.generation import GenerationSettings, generation_settings, sampling_from_checkpoint
from specjax.hf.hub import resolve_checkpoint
from specjax.hf.loader import check_same_tokenizer, load_model, load_tokenizer, read_config
from specjax.hf.pairs import PairReport, check_pair


def __getattr__(name: str):
  # The head loaders sit above `specjax.heads` (every kind): imported on first use, so
  # loading a model does not import the head kinds.
  if name in ("load_drafter", "load_head", "save_head"):
    from specjax.hf import heads

    return getattr(heads, name)
  raise AttributeError(f"module 'specjax.hf' has no attribute {name!r}")


__all__ = [
  "GenerationSettings",
  "PairReport",
  "SUPPORTED",
  "UnsupportedConfigError",
  "check_pair",
  "check_same_tokenizer",
  "generation_settings",
  "load_drafter",
  "load_head",
  "load_model",
  "load_tokenizer",
  "model_config",
  "read_config",
  "resolve_checkpoint",
  "sampling_from_checkpoint",
  "save_head",
]
