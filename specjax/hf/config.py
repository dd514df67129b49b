"""Hugging Face `config.json` -> `specjax.ModelConfig`.

Supported `model_type`s: llama (and Llama-architecture models such as SmolLM),
mistral, qwen2, qwen3 (q/k norms), phi3 (fused projections), gpt2. Anything the one decode
path cannot reproduce exactly is refused with the key that asks for it.
"""

from __future__ import annotations

from typing import Any

from specjax.models.config import ModelConfig, RopeScaling
from specjax.validation import check_positive_int

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gpt2")


class UnsupportedConfigError(ValueError):
  """The checkpoint asks for something specjax does not implement."""


def _int(hf: dict[str, Any], key: str, source: str, required: bool = True) -> int | None:
  """`hf[key]` as a positive int; None for an absent (or null) optional key.

  Raises ValueError naming `source` and `key` when a required key is missing or
  a value is not a positive integer.
  """
  value = hf.get(key)
  if value is None:
    if required:
      raise ValueError(
        f"{source} lacks the required field {key!r} (model_type {hf.get('model_type')!r})."
      )
    return None
  return check_positive_int(f"{source}: field {key!r}", value)


def _rope(hf: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
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
      f"{source}: rope scaling type {kind!r} is not supported (supported: default, llama3)."
    )
  try:
    return float(theta), RopeScaling(
      factor=float(spec["factor"]),
      low_freq_factor=float(spec["low_freq_factor"]),
      high_freq_factor=float(spec["high_freq_factor"]),
      original_max_len=int(spec["original_max_position_embeddings"]),
    )
  except KeyError as e:
    raise ValueError(f"{source}: the llama3 rope scaling lacks the field {e}.") from e


def model_config(hf: dict[str, Any], dtype: str, source: str = "config.json") -> ModelConfig:
  """Translates a parsed `config.json` into a `ModelConfig` computing in `dtype`.

  Args:
    hf: the parsed `config.json`.
    dtype: "float32", "bfloat16" or "float16".
    source: what error messages call the file (its path when read from disk).

  Raises:
    UnsupportedConfigError: a model_type or feature specjax does not implement.
    ValueError: a required field is missing or not a positive integer.
  """
  model_type = hf.get("model_type")
  if model_type not in SUPPORTED:
    raise UnsupportedConfigError(
      f"{source}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED)}."
    )
  if model_type == "gpt2":
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
      raise UnsupportedConfigError(
        f"{source}: gpt2 activation_function {act!r} is not "
        "supported (gelu_new, gelu_pytorch_tanh)."
      )
    for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
      if hf.get(key):
        raise UnsupportedConfigError(f"{source}: gpt2 {key}=true is not supported.")
    if hf.get("scale_attn_weights") is False:
      raise UnsupportedConfigError(f"{source}: gpt2 scale_attn_weights=false is not supported.")
    d = _int(hf, "n_embd", source)
    n_heads = _int(hf, "n_head", source)
    return ModelConfig(
      vocab_size=_int(hf, "vocab_size", source),
      d_model=d,
      n_layers=_int(hf, "n_layer", source),
      n_heads=n_heads,
      n_kv_heads=n_heads,
      d_ff=_int(hf, "n_inner", source, required=False) or 4 * d,
      max_seq_len=_int(hf, "n_positions", source),
      norm_eps=hf.get("layer_norm_epsilon", 1e-5),
      norm="layernorm",
      mlp="gelu",
      positions="learned",
      qkv_bias=True,
      out_bias=True,
      mlp_bias=True,
      tie_embeddings=True,
      dtype=dtype,
      param_dtype=dtype,
    )

  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise UnsupportedConfigError(
      f"{source}: {model_type} hidden_act {act!r} is not supported (silu)."
    )
  sliding_window = None
  if model_type in ("mistral", "phi3"):
    sliding_window = _int(hf, "sliding_window", source, required=False)
  if model_type in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
    raise UnsupportedConfigError(
      f"{source}: {model_type} use_sliding_window=true (per-layer windows) is not supported."
    )
  if model_type == "phi3" and hf.get("partial_rotary_factor", 1.0) != 1.0:
    raise UnsupportedConfigError(
      f"{source}: phi3 partial_rotary_factor={hf['partial_rotary_factor']!r} is not "
      "supported (1.0: RoPE on the whole head)."
    )
  theta, scaling = _rope(hf, source)
  n_heads = _int(hf, "num_attention_heads", source)
  attention_bias = bool(hf.get("attention_bias", False))
  return ModelConfig(
    vocab_size=_int(hf, "vocab_size", source),
    d_model=_int(hf, "hidden_size", source),
    n_layers=_int(hf, "num_hidden_layers", source),
    n_heads=n_heads,
    n_kv_heads=_int(hf, "num_key_value_heads", source, required=False) or n_heads,
    d_ff=_int(hf, "intermediate_size", source),
    max_seq_len=_int(hf, "max_position_embeddings", source),
    head_dim=_int(hf, "head_dim", source, required=False),
    rope_theta=theta,
    rope_scaling=scaling,
    sliding_window=sliding_window,
    norm_eps=hf.get("rms_norm_eps", 1e-6),
    qkv_bias=model_type == "qwen2" or attention_bias,
    qk_norm=model_type == "qwen3",
    out_bias=attention_bias,
    mlp_bias=bool(hf.get("mlp_bias", False)),
    tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    dtype=dtype,
    param_dtype=dtype,
  )
