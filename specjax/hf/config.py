"""Hugging Face `config.json` -> `specjax.ModelConfig`.

Supported `model_type`s: llama, mistral, qwen2, gpt2. Anything the one decode
path cannot reproduce exactly is refused with the key that asks for it.
"""

from __future__ import annotations

from typing import Any

from specjax.models.config import ModelConfig, RopeScaling

SUPPORTED = ("llama", "mistral", "qwen2", "gpt2")


class UnsupportedConfigError(ValueError):
  """The checkpoint asks for something specjax does not implement."""


def _rope(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
  """(rope_theta, scaling) from transformers 5's `rope_parameters` or the older keys."""
  params = hf.get("rope_parameters") or {}
  legacy = hf.get("rope_scaling") or {}
  theta = params.get("rope_theta", hf.get("rope_theta", 10_000.0))
  spec = params if params.get("rope_type") not in (None, "default") else legacy
  kind = spec.get("rope_type", spec.get("type", "default")) if spec else "default"
  if kind in (None, "default"):
    return float(theta), None
  if kind != "llama3":
    raise UnsupportedConfigError(
        f"rope scaling type {kind!r} is not supported (supported: default, llama3).")
  return float(theta), RopeScaling(
      factor=float(spec["factor"]), low_freq_factor=float(spec["low_freq_factor"]),
      high_freq_factor=float(spec["high_freq_factor"]),
      original_max_len=int(spec["original_max_position_embeddings"]))


def model_config(hf: dict[str, Any], dtype: str) -> ModelConfig:
  """Translates a parsed `config.json` into a `ModelConfig` computing in `dtype`."""
  model_type = hf.get("model_type")
  if model_type not in SUPPORTED:
    raise UnsupportedConfigError(
        f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED)}.")
  if model_type == "gpt2":
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
      raise UnsupportedConfigError(
          f"gpt2 activation_function {act!r} is not supported (gelu_new, gelu_pytorch_tanh).")
    for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
      if hf.get(key):
        raise UnsupportedConfigError(f"gpt2 {key}=true is not supported.")
    if hf.get("scale_attn_weights") is False:
      raise UnsupportedConfigError("gpt2 scale_attn_weights=false is not supported.")
    d = hf["n_embd"]
    return ModelConfig(
        vocab_size=hf["vocab_size"], d_model=d, n_layers=hf["n_layer"],
        n_heads=hf["n_head"], n_kv_heads=hf["n_head"], d_ff=hf.get("n_inner") or 4 * d,
        max_seq_len=hf["n_positions"], norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        norm="layernorm", mlp="gelu", positions="learned", qkv_bias=True, out_bias=True,
        mlp_bias=True, tie_embeddings=True, dtype=dtype, param_dtype=dtype)

  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise UnsupportedConfigError(f"{model_type} hidden_act {act!r} is not supported (silu).")
  sliding_window = None
  if model_type == "mistral":
    sliding_window = hf.get("sliding_window")
  if model_type == "qwen2" and hf.get("use_sliding_window"):
    raise UnsupportedConfigError(
        "qwen2 use_sliding_window=true (per-layer windows) is not supported.")
  theta, scaling = _rope(hf)
  n_heads = hf["num_attention_heads"]
  attention_bias = bool(hf.get("attention_bias", False))
  return ModelConfig(
      vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
      n_layers=hf["num_hidden_layers"], n_heads=n_heads,
      n_kv_heads=hf.get("num_key_value_heads") or n_heads, d_ff=hf["intermediate_size"],
      max_seq_len=hf["max_position_embeddings"], head_dim=hf.get("head_dim"),
      rope_theta=theta, rope_scaling=scaling, sliding_window=sliding_window,
      norm_eps=hf.get("rms_norm_eps", 1e-6),
      qkv_bias=model_type == "qwen2" or attention_bias, out_bias=attention_bias,
      mlp_bias=bool(hf.get("mlp_bias", False)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      dtype=dtype, param_dtype=dtype)
