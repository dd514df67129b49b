"""Hugging Face `config.json` pieces that both directions and the draft heads share:
RoPE settings read from a config, and the Llama config of a `ModelConfig`.

Below `specjax.hf` (the checkpoint reader `specjax.hf.config`, the exporter
`specjax.hf.export`) and `specjax.heads` (whose hub layouts read and write Llama
configs of their layers).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from specjax.models.config import ModelConfig, RopeScaling


class UnsupportedConfigError(ValueError):
  """The checkpoint asks for something specjax does not implement."""


def rope(
  hf: dict[str, Any], source: str, params: dict | None = None, theta: float = 10_000.0
) -> tuple[float, RopeScaling | None]:
  """(rope_theta, scaling) from transformers 5's `rope_parameters` (or `params`,
  one layer type's entry) or the older top-level keys; `theta` is the default base."""
  params = (hf.get("rope_parameters") or {}) if params is None else params
  legacy = hf.get("rope_scaling") or {}
  theta = params.get("rope_theta", hf.get("rope_theta", theta))
  spec = params if params.get("rope_type") not in (None, "default") else legacy
  kind = spec.get("rope_type", spec.get("type", "default")) if spec else "default"
  if kind in (None, "default"):
    return float(theta), None
  if kind not in ("llama3", "linear"):
    raise UnsupportedConfigError(
      f"{source}: rope scaling type {kind!r} is not supported (supported: default, llama3, linear)."
    )
  try:
    if kind == "linear":
      return float(theta), RopeScaling(factor=float(spec["factor"]), kind="linear")
    return float(theta), RopeScaling(
      factor=float(spec["factor"]),
      low_freq_factor=float(spec["low_freq_factor"]),
      high_freq_factor=float(spec["high_freq_factor"]),
      original_max_len=int(spec["original_max_position_embeddings"]),
    )
  except KeyError as e:
    raise ValueError(f"{source}: the {kind} rope scaling lacks the field {e}.") from e


# ModelConfig fields a Llama config.json cannot hold unless they keep their defaults.
BEYOND_LLAMA = (
  "sliding_window",
  "local_layers",
  "rope_local_theta",
  "rope_scaling",
  "qk_norm",
  "norm_offset",
  "sandwich_norms",
  "scale_embeddings",
  "attn_scale",
  "attn_softcap",
  "logit_softcap",
)


def llama_config(
  cfg: ModelConfig,
  dtype: str,
  bos_id: int | None = None,
  eos_id: int | None = None,
  pad_id: int | None = None,
) -> dict:
  """The `config.json` dict of a Llama checkpoint equivalent to `cfg`, its weights in
  `dtype` (a `specjax.dtypes` name); ValueError for what a Llama config cannot say."""
  if (cfg.norm, cfg.mlp, cfg.positions) != ("rmsnorm", "swiglu", "rope"):
    raise ValueError(
      "save_model exports Llama-style models only (norm='rmsnorm', "
      f"mlp='swiglu', positions='rope'); got {cfg.norm!r}, {cfg.mlp!r}, "
      f"{cfg.positions!r}."
    )
  if cfg.qkv_bias != cfg.out_bias:
    raise ValueError("save_model cannot express qkv_bias != out_bias in a Llama config.")
  defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
  beyond = [f"{f}={getattr(cfg, f)!r}" for f in BEYOND_LLAMA if getattr(cfg, f) != defaults[f]]
  if beyond:
    raise ValueError(f"save_model cannot express {', '.join(beyond)} in a Llama config.")
  return {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": cfg.vocab_size,
    "hidden_size": cfg.d_model,
    "intermediate_size": cfg.d_ff,
    "num_hidden_layers": cfg.n_layers,
    "num_attention_heads": cfg.n_heads,
    "num_key_value_heads": cfg.n_kv_heads,
    "head_dim": cfg.head_dim,
    "max_position_embeddings": cfg.max_seq_len,
    "rms_norm_eps": cfg.norm_eps,
    "rope_theta": cfg.rope_theta,
    "hidden_act": "silu",
    "tie_word_embeddings": cfg.tie_embeddings,
    "attention_bias": cfg.qkv_bias,
    "mlp_bias": cfg.mlp_bias,
    "initializer_range": cfg.init_std,
    "bos_token_id": bos_id,
    "eos_token_id": eos_id,
    "pad_token_id": pad_id,
    "torch_dtype": dtype,
  }
