"""Hugging Face tensor names <-> the parameters of a `specjax.Transformer` (and of the
draft heads' Llama layers): the name maps, no reading.

Each Hugging Face tensor name maps to one or more parameter paths with a
transform (PyTorch `Linear` weights are `[out, in]`, ours `[in, out]`; GPT-2's
`Conv1D` already is `[in, out]`) and, for our fused projections, the `Part` of
the parameter it fills (`specjax.models.fused`): Llama's q_proj, k_proj and
v_proj fill parts of one `qkv_proj`, gate_proj and up_proj of one `gate_up_proj`;
Phi-3's fused `qkv_proj` / `gate_up_proj` and GPT-2's `c_attn` are cut into
their projections, which go to their parts in our column order.

Below `specjax.hf` (which reads and writes checkpoints by these maps) and
`specjax.heads` (whose hub layouts build on `llama_names`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from specjax.models.config import ModelConfig
from specjax.models.fused import Part, gate_up_parts, qkv_parts

Path = tuple
Transform = Callable[[np.ndarray], np.ndarray]
# Where a Hugging Face tensor goes: a parameter path, the transform into our
# layout and the part of the parameter it fills (None: all of it).
Target = tuple[Path, Transform, Part | None]


def same(x):
  """The tensor as it is."""
  return x


def transpose(x):
  """A PyTorch `Linear` weight `[out, in]` as a kernel `[in, out]`."""
  return x.T


def split(index: int, parts: int, axis: int) -> Transform:
  """Piece `index` of `parts` equal pieces along `axis` (GPT-2's `c_attn`)."""
  return lambda x: np.split(x, parts, axis=axis)[index]


def rows(start: int, stop: int) -> Transform:
  """Rows start:stop of a fused `[out, in]` weight, as a `[in, out]` kernel."""
  return lambda x: x[start:stop].T


def llama_names(cfg: ModelConfig, fused: bool = False) -> dict[str, list[Target]]:
  """Llama-family names (Mistral, Qwen2/3, SmolLM, Gemma 2/3); `fused` for Phi-3's
  `qkv_proj` and `gate_up_proj`."""
  names = {
    "model.embed_tokens.weight": [(("embed", "embedding"), same, None)],
    "model.norm.weight": [(("final_norm", "scale"), same, None)],
  }
  if not cfg.tie_embeddings:
    names["lm_head.weight"] = [(("lm_head",), transpose, None)]
  qkv, gate_up = qkv_parts(cfg), gate_up_parts(cfg.d_ff)

  def linear(hf_name: str, module: Path, bias: bool, part: Part | None = None):
    """A PyTorch Linear's weight (and bias) -> our module's kernel (and bias)."""
    names[f"{hf_name}.weight"] = [(module + ("kernel",), transpose, part)]
    if bias:
      names[f"{hf_name}.bias"] = [(module + ("bias",), same, part)]

  for i in range(cfg.n_layers):
    hf, ours = f"model.layers.{i}.", ("layers", i)
    attn, mlp = ours + ("attn",), ours + ("mlp",)
    norms = {"input_layernorm": "attn_norm"}
    if cfg.sandwich_norms:  # Gemma: post_attention_layernorm normalises the attention output
      norms |= {
        "post_attention_layernorm": "post_attn_norm",
        "pre_feedforward_layernorm": "mlp_norm",
        "post_feedforward_layernorm": "post_mlp_norm",
      }
    else:
      norms["post_attention_layernorm"] = "mlp_norm"
    for norm, target in norms.items():
      names[f"{hf}{norm}.weight"] = [(ours + (target, "scale"), same, None)]
    if cfg.qk_norm:
      for norm in ("q_norm", "k_norm"):
        names[f"{hf}self_attn.{norm}.weight"] = [(attn + (norm, "scale"), same, None)]
    if fused:  # Phi-3: rows [q; k; v] and [gate; up], each cut out and put in its part
      for hf_name, module, ours_name, parts in (
        ("self_attn.qkv_proj", attn, "qkv_proj", qkv),
        ("mlp.gate_up_proj", mlp, "gate_up_proj", gate_up),
      ):
        starts = [sum(p.width for p in parts[:j]) for j in range(len(parts))]
        names[f"{hf}{hf_name}.weight"] = [
          (module + (ours_name, "kernel"), rows(start, start + part.width), part)
          for start, part in zip(starts, parts)
        ]
      linear(f"{hf}self_attn.o_proj", attn + ("o_proj",), False)
      linear(f"{hf}mlp.down_proj", mlp + ("down_proj",), False)
      continue
    # Each projection fills its part of a fused parameter (`specjax.models.fused`).
    for part in qkv:
      linear(f"{hf}self_attn.{part.name}", attn + ("qkv_proj",), cfg.qkv_bias, part)
    linear(f"{hf}self_attn.o_proj", attn + ("o_proj",), cfg.out_bias)
    for part in gate_up:
      linear(f"{hf}mlp.{part.name}", mlp + ("gate_up_proj",), cfg.mlp_bias, part)
    linear(f"{hf}mlp.down_proj", mlp + ("down_proj",), cfg.mlp_bias)
  return names


def gpt2_names(cfg: ModelConfig) -> dict[str, list[Target]]:
  """GPT-2 names (`Conv1D` weights are already `[in, out]`)."""
  names = {
    "wte.weight": [(("embed", "embedding"), same, None)],
    "wpe.weight": [(("pos_embed", "embedding"), same, None)],
    "ln_f.weight": [(("final_norm", "scale"), same, None)],
    "ln_f.bias": [(("final_norm", "bias"), same, None)],
  }
  qkv = qkv_parts(cfg)
  for i in range(cfg.n_layers):
    hf, ours = f"h.{i}.", ("layers", i)
    for norm, target in (("ln_1", "attn_norm"), ("ln_2", "mlp_norm")):
      names[f"{hf}{norm}.weight"] = [(ours + (target, "scale"), same, None)]
      names[f"{hf}{norm}.bias"] = [(ours + (target, "bias"), same, None)]
    for kind, axis in (("weight", 1), ("bias", 0)):
      leaf = "kernel" if kind == "weight" else "bias"
      # c_attn's columns are [q | k | v]: each third goes to its part of qkv_proj.
      names[f"{hf}attn.c_attn.{kind}"] = [
        (ours + ("attn", "qkv_proj", leaf), split(j, 3, axis), part) for j, part in enumerate(qkv)
      ]
      names[f"{hf}attn.c_proj.{kind}"] = [(ours + ("attn", "o_proj", leaf), same, None)]
      names[f"{hf}mlp.c_fc.{kind}"] = [(ours + ("mlp", "up_proj", leaf), same, None)]
      names[f"{hf}mlp.c_proj.{kind}"] = [(ours + ("mlp", "down_proj", leaf), same, None)]
  return names


def tensor_map(model_type: str, cfg: ModelConfig) -> dict[str, list[Target]]:
  """Hugging Face tensor name -> [(parameter path, transform, part)] for
  `model_type`; a `Part` says which columns of a fused parameter the transformed
  tensor fills (None: the whole parameter)."""
  if model_type == "gpt2":
    return gpt2_names(cfg)
  return llama_names(cfg, fused=model_type == "phi3")


# The multimodal Gemma 3's language model, as transformers 4 and 5 name it.
_GEMMA3_TEXT_PREFIXES = {
  "language_model.model.": "model.",
  "model.language_model.": "model.",
  "language_model.lm_head.": "lm_head.",
}
# ... and the vision parts a text decoder does not need.
_GEMMA3_VISION_PREFIXES = (
  "vision_tower.",
  "multi_modal_projector.",
  "model.vision_tower.",
  "model.multi_modal_projector.",
)


def canonical(model_type: str, name: str) -> str | None:
  """`name` as the tensor map spells it; None for a tensor to skip."""
  # GPT2LMHeadModel saves "transformer.h.0...", GPT2Model "h.0...".
  if model_type == "gpt2" and name.startswith("transformer."):
    return name[len("transformer.") :]
  if model_type == "gemma3":
    if name.startswith(_GEMMA3_VISION_PREFIXES):
      return None
    for prefix, ours in _GEMMA3_TEXT_PREFIXES.items():
      if name.startswith(prefix):
        return ours + name[len(prefix) :]
  return name
