"""`save_model`: a Llama-style `specjax.Transformer` -> a Hugging Face checkpoint directory.

The inverse of `load_model` for the default architecture (RMSNorm, RoPE,
SwiGLU): writes `config.json` (model_type "llama") and `model.safetensors`, so
the result loads back with `specjax.hf.load_model` and with transformers'
`LlamaForCausalLM.from_pretrained`. The fused projections are written as
Llama's separate `q_proj`, `k_proj`, `v_proj`, `gate_proj` and `up_proj`.
"""

from __future__ import annotations

import json
import os

from flax import nnx

from specjax.dtypes import to_dtype
from specjax.models import hub_names
from specjax.models.hub_config import llama_config
from specjax.models.scan import unscan_model
from specjax.models.transformer import Transformer


def hf_config(
  model: Transformer,
  dtype: str,
  bos_id: int | None = None,
  eos_id: int | None = None,
  pad_id: int | None = None,
) -> dict:
  """The `config.json` dict of a Llama checkpoint equivalent to `model.cfg`
  (`specjax.models.hub_config.llama_config`)."""
  return llama_config(model.cfg, dtype, bos_id, eos_id, pad_id)


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
  for name, entries in hub_names.tensor_map("llama", model.cfg).items():
    ((param_path, transform, part),) = entries
    value = params[param_path]
    if part is not None:  # q_proj, k_proj, ... out of the fused qkv_proj / gate_up_proj
      value = part.take(value)
    tensors[name] = (value.T if transform is hub_names.transpose else value).astype(weight_dtype)
  os.makedirs(path, exist_ok=True)
  save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
