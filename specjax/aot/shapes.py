"""The model shapes an accelerator check compiles: presets, written-in families, any config.json.

`shape_configs(name, dtype)` gives `(target, draft)` ModelConfigs for:
- "bundled": the bundled pair's shapes;
- a scaled preset of the bundled pair, "160m", "1b", "7b" (`specjax.pretrained.SCALES`);
- a written-in Hugging Face shape, `FAMILIES`: Llama-3 8B and 70B with a
  Llama-3.2-1B-shaped draft, Qwen2.5 7B and 72B with a Qwen2.5-0.5B-shaped draft
  (config fields as published on each model's card; shapes only, no weights);
- a checkpoint directory or a hub id already in the local Hugging Face cache:
  its `config.json` only (no weights read, nothing downloaded), with a
  68M-shaped draft of its vocabulary (`specjax.pretrained.scales.DRAFT_68M`).
"""

from __future__ import annotations

from typing import Any

from specjax.models.config import ModelConfig

_LLAMA3 = dict(
  model_type="llama",
  vocab_size=128256,
  rms_norm_eps=1e-5,
  rope_theta=500000.0,
  max_position_embeddings=8192,
  hidden_act="silu",
  tie_word_embeddings=False,
)
_QWEN25 = dict(
  model_type="qwen2",
  vocab_size=152064,
  rms_norm_eps=1e-6,
  rope_theta=1000000.0,
  max_position_embeddings=32768,
  hidden_act="silu",
  tie_word_embeddings=False,
)


def _family(base: dict, hidden, layers, heads, kv, ff, **extra) -> dict[str, Any]:
  """A config.json of `base`'s family with these sizes."""
  sizes = dict(
    hidden_size=hidden,
    num_hidden_layers=layers,
    num_attention_heads=heads,
    num_key_value_heads=kv,
    intermediate_size=ff,
  )
  return base | sizes | extra


# name -> (target config.json fields, draft config.json fields, note)
FAMILIES: dict[str, tuple[dict, dict, str]] = {
  "llama3-8b": (
    _family(_LLAMA3, 4096, 32, 32, 8, 14336),
    _family(_LLAMA3, 2048, 16, 32, 8, 8192, tie_word_embeddings=True),
    "Llama-3-8B (meta-llama/Meta-Llama-3-8B config.json) with a Llama-3.2-1B-shaped draft",
  ),
  "llama3-70b": (
    _family(_LLAMA3, 8192, 80, 64, 8, 28672),
    _family(_LLAMA3, 2048, 16, 32, 8, 8192, tie_word_embeddings=True),
    "Llama-3-70B (meta-llama/Meta-Llama-3-70B config.json) with a Llama-3.2-1B-shaped draft",
  ),
  "qwen2.5-7b": (
    _family(_QWEN25, 3584, 28, 28, 4, 18944),
    _family(_QWEN25, 896, 24, 14, 2, 4864, tie_word_embeddings=True),
    "Qwen2.5-7B (Qwen/Qwen2.5-7B config.json) with a Qwen2.5-0.5B-shaped draft (its "
    "151,936-row vocabulary padded to the target's 152,064)",
  ),
  "qwen2.5-72b": (
    _family(_QWEN25, 8192, 80, 64, 8, 29568),
    _family(_QWEN25, 896, 24, 14, 2, 4864, tie_word_embeddings=True),
    "Qwen2.5-72B (Qwen/Qwen2.5-72B config.json) with a Qwen2.5-0.5B-shaped draft (vocabulary "
    "padded as for 7B)",
  ),
}
PRESETS = ("160m", "1b", "7b")
BUNDLED = "bundled"


def shape_configs(name: str, dtype: str = "bfloat16") -> tuple[ModelConfig, ModelConfig, str]:
  """`(target, draft, note)` of shape `name` in `dtype` (see the module's list).

  Raises:
    ValueError: an unknown name that is neither a directory nor a cached hub id
      (the allowed names listed); FileNotFoundError / UnsupportedConfigError
      from the Hugging Face config reader for a checkpoint it cannot read.
  """
  from specjax import pretrained
  from specjax.hf.config import model_config

  if name == BUNDLED:
    target, draft = pretrained.bundled_configs(dtype)
    return target, draft, "the bundled pair's shapes (8.7M target, 0.92M draft)"
  if name in PRESETS:
    target, draft = pretrained.scaled_configs(name, *pretrained.bundled_configs(), dtype)
    return target, draft, pretrained.SCALES[name].note
  if name in FAMILIES:
    target, draft, note = FAMILIES[name]
    return model_config(target, dtype, name), model_config(draft, dtype, name), note
  if "/" not in name:
    raise ValueError(
      f"--config.shape must be {BUNDLED!r}, a preset ({', '.join(PRESETS)}), a written-in shape "
      f"({', '.join(FAMILIES)}), a checkpoint directory or a cached hub id; got {name!r}."
    )
  from specjax.hf.hub import resolve_checkpoint
  from specjax.hf.loader import read_config
  from specjax.pretrained.scales import DRAFT_68M

  hf = read_config(resolve_checkpoint(name, flag="--config.shape"))
  target = model_config(hf, dtype, f"{name}/config.json")
  draft = target.replace(**DRAFT_68M, local_layers=None, sliding_window=None)
  return target, draft, f"{name} (config.json only) with a 68M-shaped draft of its vocabulary"
