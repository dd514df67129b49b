"""Hugging Face safetensors -> the parameters of a `specjax.Transformer`.

Each Hugging Face tensor name maps to one or more parameter paths with a
transform (PyTorch `Linear` weights are `[out, in]`, ours `[in, out]`; GPT-2's
`Conv1D` already is `[in, out]`) and, for our fused projections, the `Part` of
the parameter it fills (`specjax.models.fused`): Llama's q_proj, k_proj and
v_proj fill parts of one `qkv_proj`, gate_proj and up_proj of one `gate_up_proj`;
Phi-3's fused `qkv_proj` / `gate_up_proj` and GPT-2's `c_attn` are cut into
their projections, which go to their parts in our column order.

Shards are read one tensor at a time and converted straight into the requested
dtype, so at most one full copy of the weights (the result) plus one tensor is
held, and the fused parameters whose parts have not all been read yet (one
layer's, as a layer's tensors lie together in name order). Reading, checking
and converting happen in NumPy on memory-mapped files: jax ops here would
compile a program per tensor shape (56 for the bundled pair), seconds of every
launcher's start.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.config import ModelConfig
from specjax.models.fused import Part, gate_up_parts, qkv_parts
from specjax.tensor_files import read_tensors as read_tensors  # re-exported: the loaders' reader

Path = tuple
Transform = Callable[[np.ndarray], np.ndarray]
# Where a Hugging Face tensor goes: a parameter path, the transform into our
# layout and the part of the parameter it fills (None: all of it).
Target = tuple[Path, Transform, Part | None]

# Buffers some checkpoints carry that are not parameters.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")


def _same(x):
  return x


def _transpose(x):
  return x.T


def _split(index: int, parts: int, axis: int) -> Transform:
  return lambda x: np.split(x, parts, axis=axis)[index]


def _rows(start: int, stop: int) -> Transform:
  """Rows start:stop of a fused `[out, in]` weight, as a `[in, out]` kernel."""
  return lambda x: x[start:stop].T


def _llama_names(cfg: ModelConfig, fused: bool = False) -> dict[str, list[Target]]:
  """Llama-family names (Mistral, Qwen2/3, SmolLM, Gemma 2/3); `fused` for Phi-3's
  `qkv_proj` and `gate_up_proj`."""
  names = {
    "model.embed_tokens.weight": [(("embed", "embedding"), _same, None)],
    "model.norm.weight": [(("final_norm", "scale"), _same, None)],
  }
  if not cfg.tie_embeddings:
    names["lm_head.weight"] = [(("lm_head",), _transpose, None)]
  qkv, gate_up = qkv_parts(cfg), gate_up_parts(cfg.d_ff)

  def linear(hf_name: str, module: Path, bias: bool, part: Part | None = None):
    """A PyTorch Linear's weight (and bias) -> our module's kernel (and bias)."""
    names[f"{hf_name}.weight"] = [(module + ("kernel",), _transpose, part)]
    if bias:
      names[f"{hf_name}.bias"] = [(module + ("bias",), _same, part)]

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
      names[f"{hf}{norm}.weight"] = [(ours + (target, "scale"), _same, None)]
    if cfg.qk_norm:
      for norm in ("q_norm", "k_norm"):
        names[f"{hf}self_attn.{norm}.weight"] = [(attn + (norm, "scale"), _same, None)]
    if fused:  # Phi-3: rows [q; k; v] and [gate; up], each cut out and put in its part
      for hf_name, module, ours_name, parts in (
        ("self_attn.qkv_proj", attn, "qkv_proj", qkv),
        ("mlp.gate_up_proj", mlp, "gate_up_proj", gate_up),
      ):
        starts = [sum(p.width for p in parts[:j]) for j in range(len(parts))]
        names[f"{hf}{hf_name}.weight"] = [
          (module + (ours_name, "kernel"), _rows(start, start + part.width), part)
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


def _gpt2_names(cfg: ModelConfig) -> dict[str, list[Target]]:
  names = {
    "wte.weight": [(("embed", "embedding"), _same, None)],
    "wpe.weight": [(("pos_embed", "embedding"), _same, None)],
    "ln_f.weight": [(("final_norm", "scale"), _same, None)],
    "ln_f.bias": [(("final_norm", "bias"), _same, None)],
  }
  qkv = qkv_parts(cfg)
  for i in range(cfg.n_layers):
    hf, ours = f"h.{i}.", ("layers", i)
    for norm, target in (("ln_1", "attn_norm"), ("ln_2", "mlp_norm")):
      names[f"{hf}{norm}.weight"] = [(ours + (target, "scale"), _same, None)]
      names[f"{hf}{norm}.bias"] = [(ours + (target, "bias"), _same, None)]
    for kind, axis in (("weight", 1), ("bias", 0)):
      leaf = "kernel" if kind == "weight" else "bias"
      # c_attn's columns are [q | k | v]: each third goes to its part of qkv_proj.
      names[f"{hf}attn.c_attn.{kind}"] = [
        (ours + ("attn", "qkv_proj", leaf), _split(j, 3, axis), part) for j, part in enumerate(qkv)
      ]
      names[f"{hf}attn.c_proj.{kind}"] = [(ours + ("attn", "o_proj", leaf), _same, None)]
      names[f"{hf}mlp.c_fc.{kind}"] = [(ours + ("mlp", "up_proj", leaf), _same, None)]
      names[f"{hf}mlp.c_proj.{kind}"] = [(ours + ("mlp", "down_proj", leaf), _same, None)]
  return names


def tensor_map(model_type: str, cfg: ModelConfig) -> dict[str, list[Target]]:
  """Hugging Face tensor name -> [(parameter path, transform, part)] for
  `model_type`; a `Part` says which columns of a fused parameter the transformed
  tensor fills (None: the whole parameter)."""
  if model_type == "gpt2":
    return _gpt2_names(cfg)
  return _llama_names(cfg, fused=model_type == "phi3")


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


def _canonical(model_type: str, name: str) -> str | None:
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


def shard_files(directory: str) -> list[str]:
  """The safetensors files of a checkpoint directory, from its index when sharded."""
  index = os.path.join(directory, "model.safetensors.index.json")
  single = os.path.join(directory, "model.safetensors")
  if os.path.exists(index):
    try:
      with open(index, encoding="utf-8") as f:
        weight_map = json.load(f)["weight_map"]
      names = sorted(set(weight_map.values()))
    except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError for binary bytes
      raise ValueError(f"{index} is not valid JSON: {e}") from e
    except (KeyError, TypeError, AttributeError) as e:
      raise ValueError(
        f"{index} must hold a JSON object with a 'weight_map' of tensor name -> shard file name."
      ) from e
    if not names or not all(isinstance(name, str) for name in names):
      raise ValueError(f"{index}: 'weight_map' must map tensor names to shard file names.")
    files = [os.path.join(directory, name) for name in names]
    missing = [f for f in files if not os.path.exists(f)]
    if missing:
      raise FileNotFoundError(f"{index} lists shard files that do not exist: {missing}")
    return files
  if os.path.exists(single):
    return [single]
  raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {directory}")


def _check_values(path: str, name: str, tensor: np.ndarray) -> None:
  """Raises ValueError naming `path` and `name` unless `tensor` holds finite floats.

  An integer dtype in a weights file means a corrupt header (the float bytes
  would be reinterpreted); NaN or inf would silently poison every logit.
  """
  if not jnp.issubdtype(tensor.dtype, jnp.floating):
    raise ValueError(
      f"{path}: tensor {name!r} has dtype {tensor.dtype}, not a float "
      "dtype; the file is corrupt or not a model checkpoint."
    )
  bad = int(np.count_nonzero(~np.isfinite(tensor)))
  if bad:
    raise ValueError(f"{path}: tensor {name!r} holds {bad} non-finite values (NaN or inf).")


def load_params(
  model_type: str,
  cfg: ModelConfig,
  abstract: dict[Path, jax.ShapeDtypeStruct],
  files: list[str],
  place: Callable[[Path, np.ndarray], jax.Array] | None = None,
) -> dict[Path, jax.Array]:
  """Reads every tensor of `files` into the parameter paths of `abstract`.

  Args:
    abstract: parameter path -> expected shape and dtype.
    place: optional (path, host array) -> array that puts each converted tensor
      where it belongs (its shards on a mesh) before the next tensor is read.

  Returns:
    parameter path -> array in the expected dtype.

  Raises:
    ValueError: an unreadable file, a tensor name the architecture does not
      have, a shape that does not match the config, a tensor that is not finite
      floats, or parameters no file provided.
  """
  names = tensor_map(model_type, cfg)
  params: dict[Path, jax.Array] = {}
  # A fused parameter is assembled on the host from its parts' tensors, then
  # placed: parameter path -> (buffer, parts still to come).
  parts_of: dict[Path, int] = {}
  for targets in names.values():
    for target, _, part in targets:
      if part is not None:
        parts_of[target] = parts_of.get(target, 0) + 1
  assembling: dict[Path, tuple[np.ndarray, int]] = {}
  seen = set()

  def skip(raw_name):
    return _canonical(model_type, raw_name) is None

  for path, raw_name, tensor in read_tensors(files, skip):
    name = _canonical(model_type, raw_name)
    if name not in names:
      if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and cfg.tie_embeddings):
        continue
      raise ValueError(
        f"{path}: tensor {raw_name!r} does not belong to a "
        f"{model_type} model with this config.json."
      )
    _check_values(path, raw_name, tensor)
    seen.add(name)
    for target, transform, part in names[name]:
      value = transform(tensor)
      expected = abstract[target]
      shape = expected.shape if part is None else (*expected.shape[:-1], part.width)
      if value.shape != shape:
        where = "/".join(map(str, target)) + ("" if part is None else f" (its {part.name} part)")
        raise ValueError(
          f"{path}: tensor {raw_name!r} has shape {tuple(tensor.shape)}, which gives "
          f"{tuple(value.shape)} for {where}; config.json implies {tuple(shape)}."
        )
      if part is not None:
        buffer, left = assembling.get(target, (None, parts_of[target]))
        if buffer is None:
          buffer = np.empty(expected.shape, expected.dtype)
        part.put(buffer, value)  # converts into the buffer: no view of the mapped file
        if left > 1:
          assembling[target] = (buffer, left - 1)
          continue
        assembling.pop(target, None)
        value = buffer
      else:
        value = value.astype(expected.dtype)  # a copy: never a view of the mapped file
      params[target] = place(target, value) if place is not None else jax.device_put(value)
      del value
    del tensor
  missing = [n for n in names if n not in seen]
  if missing:
    raise ValueError(
      f"checkpoint {os.path.dirname(files[0])} lacks tensors: "
      f"{missing[:8]}{' ...' if len(missing) > 8 else ''}"
    )
  return params
