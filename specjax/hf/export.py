"""`save_model`: a Llama-style `specjax.Transformer` -> a Hugging Face checkpoint directory.

The inverse of `load_model` for the default architecture (RMSNorm, RoPE,
SwiGLU): writes `config.json` (model_type "llama") and `model.safetensors`, so
the result loads back with `specjax.hf.load_model` and with transformers'
`LlamaForCausalLM.from_pretrained`. The fused projections are written as
Llama's separate `q_proj`, `k_proj`, `v_proj`, `gate_proj` and `up_proj`.
"""

from __future__ import annotations

import dataclasses
import json
import os

from flax import nnx

from specjax.dtypes import to_dtype
from specjax.hf import weights
from specjax.models.config import ModelConfig
from specjax.models.scan import unscan_model
from specjax.models.transformer import Transformer

# ModelConfig fields a Llama config.json cannot hold unless they keep their defaults.
_BEYOND_LLAMA = (
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


def hf_config(
  model: Transformer,
  dtype: str,
  bos_id: int | None = None,
  eos_id: int | None = None,
  pad_id: int | None = None,
) -> dict:
  """The `config.json` dict of a Llama checkpoint equivalent to `model.cfg`."""
  cfg = model.cfg
  if (cfg.norm, cfg.mlp, cfg.positions) != ("rmsnorm", "swiglu", "rope"):
    raise ValueError(
      "save_model exports Llama-style models only (norm='rmsnorm', "
      f"mlp='swiglu', positions='rope'); got {cfg.norm!r}, {cfg.mlp!r}, "
      f"{cfg.positions!r}."
    )
  if cfg.qkv_bias != cfg.out_bias:
    raise ValueError("save_model cannot express qkv_bias != out_bias in a Llama config.")
  defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
  beyond = [f"{f}={getattr(cfg, f)!r}" for f in _BEYOND_LLAMA if getattr(cfg, f) != defaults[f]]
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


def save_model(
  model: Transformer,
  path: str,
  dtype: str = "bfloat16",
  bos_id: int | None = None,
  eos_id: int | None = None,
  pad_id: int | None = None,
) -> None:
  """Writes `model` to directory `path` as a Llama checkpoint with `dtype` weights.

  `dtype` is a name from `specjax.dtypes.DTYPES` ("float32", "bfloat16", "float16").
  """
  weight_dtype = to_dtype(dtype)
  from safetensors.flax import save_file  # imported here: only exporting needs it

  config = hf_config(model, dtype, bos_id, eos_id, pad_id)
  model = unscan_model(model)  # Hugging Face names one tensor per layer
  params = {path_: v.get_value() for path_, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  tensors = {}
  for name, entries in weights.tensor_map("llama", model.cfg).items():
    ((param_path, transform, part),) = entries
    value = params[param_path]
    if part is not None:  # q_proj, k_proj, ... out of the fused qkv_proj / gate_up_proj
      value = part.take(value)
    tensors[name] = (value.T if transform is weights._transpose else value).astype(weight_dtype)
  os.makedirs(path, exist_ok=True)
  save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
