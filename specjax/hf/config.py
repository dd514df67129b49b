"""Hugging Face `config.json` -> `specjax.ModelConfig`.

Supported `model_type`s: llama (and Llama-architecture models such as SmolLM),
mistral, qwen2, qwen3 (q/k norms), phi3 (fused projections), gemma2, gemma3_text
and gemma3 (the text model of the multimodal checkpoint), gpt2. Anything the one
decode path cannot reproduce exactly is refused with the key that asks for it.
"""

from __future__ import annotations

from typing import Any

from specjax.models.config import ModelConfig, RopeScaling
from specjax.models.hub_config import UnsupportedConfigError as UnsupportedConfigError
from specjax.models.hub_config import rope
from specjax.validation import check_positive_int

SUPPORTED = (
  "llama",
  "mistral",
  "qwen2",
  "qwen3",
  "phi3",
  "gemma2",
  "gemma3_text",
  "gemma3",
  "gpt2",
)
GEMMA = ("gemma2", "gemma3_text", "gemma3")


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


def text_config(hf: dict[str, Any], source: str = "config.json") -> dict[str, Any]:
  """The language model's config: `text_config` of a multimodal Gemma 3
  checkpoint (model_type "gemma3"), else `hf` itself."""
  if hf.get("model_type") != "gemma3":
    return hf
  text = hf.get("text_config")
  if not isinstance(text, dict):
    raise ValueError(f"{source}: a gemma3 (multimodal) config needs a 'text_config' object.")
  text = dict(text, model_type="gemma3_text")
  if "tie_word_embeddings" not in text and "tie_word_embeddings" in hf:
    text["tie_word_embeddings"] = hf["tie_word_embeddings"]
  return text


_LAYER_TYPES = ("sliding_attention", "full_attention")


def _gemma_local_layers(
  hf: dict[str, Any], n_layers: int, gemma2: bool, source: str
) -> tuple[int, ...]:
  """The indices of a Gemma's sliding-window layers: from `layer_types`, else
  every layer but each 2nd (Gemma 2) or each `sliding_window_pattern`-th (Gemma 3)."""
  types = hf.get("layer_types")
  if types is None:
    every = 2 if gemma2 else _int(hf, "sliding_window_pattern", source, required=False) or 6
    types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n_layers)]
  allowed = _LAYER_TYPES
  if not isinstance(types, list) or len(types) != n_layers or any(t not in allowed for t in types):
    raise UnsupportedConfigError(
      f"{source}: layer_types must list {n_layers} entries of {allowed}, got {types!r}."
    )
  return tuple(i for i, t in enumerate(types) if t == "sliding_attention")


def _gemma_rope(
  hf: dict[str, Any], gemma2: bool, source: str
) -> tuple[float, RopeScaling | None, float | None]:
  """`(theta, scaling, local_theta)`: the global layers' RoPE base and scaling and,
  for Gemma 3, the sliding-window layers' own base (None for Gemma 2: one base)."""
  if gemma2:
    return (*rope(hf, source), None)
  params = hf.get("rope_parameters") or {}
  if set(params) <= set(_LAYER_TYPES):  # one entry per layer type
    params, local_params = params.get("full_attention", {}), params.get("sliding_attention")
  else:  # one set for the global layers; the local base is its own key
    local_params = None
  theta, scaling = rope(hf, source, params, 1_000_000.0)
  local_params = local_params or {}
  if local_params.get("rope_type", "default") != "default":
    raise UnsupportedConfigError(
      f"{source}: rope_parameters.sliding_attention.rope_type "
      f"{local_params['rope_type']!r} is not supported (default)."
    )
  local_theta = float(local_params.get("rope_theta", hf.get("rope_local_base_freq", 10_000.0)))
  return theta, scaling, local_theta


def _gemma_softcaps(hf: dict[str, Any], gemma2: bool, source: str) -> dict[str, float | None]:
  """`attn_logit_softcapping` and `final_logit_softcapping` (transformers' defaults:
  50 and 30 for Gemma 2, None for Gemma 3), each checked to be null or > 0.

  transformers' Gemma 3 ignores attn_logit_softcapping (QK norms replaced it, as
  in the Gemma 3 reference), and its multimodal model final_logit_softcapping
  too: both are checked here but, there, not applied (Google's are null anyway).
  """
  softcaps = {
    key: hf.get(key, default)
    for key, default in (
      ("attn_logit_softcapping", 50.0 if gemma2 else None),
      ("final_logit_softcapping", 30.0 if gemma2 else None),
    )
  }
  for key, value in softcaps.items():
    if value is not None and not (isinstance(value, (int, float)) and value > 0):
      raise ValueError(f"{source}: field {key!r} must be null or a number > 0, got {value!r}.")
  return softcaps


def _gemma(hf: dict[str, Any], dtype: str, source: str, multimodal: bool = False) -> ModelConfig:
  """Gemma 2 and Gemma 3 text models (transformers' defaults for absent keys);
  `multimodal` for the text model of Gemma3ForConditionalGeneration."""
  model_type = hf["model_type"]
  gemma2 = model_type == "gemma2"
  act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
  if act != "gelu_pytorch_tanh":
    raise UnsupportedConfigError(
      f"{source}: {model_type} hidden_activation {act!r} is not supported (gelu_pytorch_tanh)."
    )
  if hf.get("use_bidirectional_attention"):
    raise UnsupportedConfigError(
      f"{source}: {model_type} use_bidirectional_attention=true (an encoder, not a decoder) "
      "is not supported."
    )
  n_layers = _int(hf, "num_hidden_layers", source)
  local = _gemma_local_layers(hf, n_layers, gemma2, source)
  window = (_int(hf, "sliding_window", source, required=False) or 4096) if local else None
  theta, scaling, local_theta = _gemma_rope(hf, gemma2, source)
  softcaps = _gemma_softcaps(hf, gemma2, source)
  scalar = hf.get("query_pre_attn_scalar", 256)
  if not (isinstance(scalar, (int, float)) and scalar > 0):
    raise ValueError(f"{source}: field 'query_pre_attn_scalar' must be > 0, got {scalar!r}.")
  n_heads = _int(hf, "num_attention_heads", source)
  bias = bool(hf.get("attention_bias", False))
  return ModelConfig(
    vocab_size=_int(hf, "vocab_size", source),
    d_model=_int(hf, "hidden_size", source),
    n_layers=n_layers,
    n_heads=n_heads,
    n_kv_heads=_int(hf, "num_key_value_heads", source, required=False) or n_heads,
    d_ff=_int(hf, "intermediate_size", source),
    max_seq_len=_int(hf, "max_position_embeddings", source),
    head_dim=_int(hf, "head_dim", source, required=False) or 256,
    rope_theta=theta,
    rope_scaling=scaling,
    sliding_window=window,
    local_layers=local if window else None,
    rope_local_theta=local_theta if window else None,
    norm_eps=hf.get("rms_norm_eps", 1e-6),
    norm_offset=1.0,
    sandwich_norms=True,
    scale_embeddings=True,
    mlp="geglu",
    qkv_bias=bias,
    out_bias=bias,
    qk_norm=not gemma2,
    attn_scale=float(scalar) ** -0.5,
    attn_softcap=softcaps["attn_logit_softcapping"] if gemma2 else None,
    logit_softcap=None if multimodal else softcaps["final_logit_softcapping"],
    tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
    dtype=dtype,
    param_dtype=dtype,
  )


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
  if model_type in GEMMA:
    return _gemma(text_config(hf, source), dtype, source, multimodal=model_type == "gemma3")
  if model_type == "gpt2":
    return _gpt2(hf, dtype, source)
  return _llama_like(hf, dtype, source)


def _gpt2(hf: dict[str, Any], dtype: str, source: str) -> ModelConfig:
  """GPT-2: LayerNorm, GELU MLP, learned positions, biases everywhere, tied embeddings."""
  act = hf.get("activation_function", "gelu_new")
  if act not in ("gelu_new", "gelu_pytorch_tanh"):
    raise UnsupportedConfigError(
      f"{source}: gpt2 activation_function {act!r} is not supported (gelu_new, gelu_pytorch_tanh)."
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


def _llama_like(hf: dict[str, Any], dtype: str, source: str) -> ModelConfig:
  """Llama, Mistral, Qwen 2/3 and Phi-3: RMSNorm, SwiGLU, RoPE (transformers'
  defaults for absent keys)."""
  model_type = hf["model_type"]
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
  theta, scaling = rope(hf, source)
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
