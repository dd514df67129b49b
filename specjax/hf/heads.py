"""Draft heads by path: specjax's runs and exports, and the hub's layouts in and out
(EAGLE-1/2, EAGLE-3, Medusa; files, key names and their sources: docs/hf_checkpoints.md).

  head = specjax.hf.load_head("yuhuili/EAGLE-Vicuna-7B-v1.3", target)  # cached, offline
  drafter = specjax.hf.load_drafter("yuhuili/EAGLE-Vicuna-7B-v1.3", target)  # its drafter
  specjax.hf.save_head(head, "out")  # e.g. EAGLE-3 as vLLM and SGLang load it (or a drafter)

`load_head` returns the head module, as `specjax.pretrained.load_head` does for a bundled
kind; `load_drafter` returns its drafter, as `specjax.pretrained.load_drafter` does.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import heads as head_kinds
from specjax.dtypes import dtype_name
from specjax.hf import eagle3, weights
from specjax.hf.hub import resolve_checkpoint
from specjax.models.heads import HEAD_CONFIG_FILE, HEAD_WEIGHTS_FILE, HeadConfig, make_head
from specjax.validation import read_json_object

# Weight files per layout, in the order the reference loaders try them.
_LLAMA_FILES = ("model.safetensors", "pytorch_model.bin")  # heads are never sharded
_MEDUSA_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


def load_drafter(path: str, target, dtype=jnp.float32):
  """The drafter (`EagleDrafter`, `MedusaDrafter`, `EarlyExitDrafter`) of the head
  at `path` for `target`: `load_head`'s module, drafting for `target`."""
  return head_kinds.drafter(target, load_head(path, target, dtype))


def load_head(path: str, target, dtype=jnp.float32) -> nnx.Module:
  """The head at `path` (a directory or a repo id in the local Hugging Face cache,
  never downloaded) in `dtype`, for `target`: ValueError names the field that differs."""
  directory = resolve_checkpoint(path, flag="path")
  name = dtype_name(dtype)
  own = os.path.join(directory, HEAD_CONFIG_FILE)
  if os.path.exists(own):
    try:
      cfg = HeadConfig.from_dict(read_json_object(own))
    except (TypeError, KeyError) as e:
      raise ValueError(f"{own} is not a head config: {type(e).__name__}: {e}") from e
    cfg.check_target(target.cfg)
    file = os.path.join(directory, HEAD_WEIGHTS_FILE)
    if os.path.exists(file):
      from specjax.pretrained import _read_head_params

      graphdef, abstract = _abstract(cfg, name)
      return nnx.merge(graphdef, _read_head_params(file, abstract, dtype, cfg.block_config))
    from specjax.training import load_trained_head

    graphdef, _ = _abstract(cfg, name)
    state = nnx.state(load_trained_head(directory)[0])
    return nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(dtype), state))
  config_file = os.path.join(directory, "config.json")
  if not os.path.exists(config_file):
    raise FileNotFoundError(f"{directory} holds neither {HEAD_CONFIG_FILE} nor config.json.")
  config = read_json_object(config_file)
  medusa = "medusa_num_heads" in config or _first(directory, _MEDUSA_FILES)
  file, tensors = _read(directory, _MEDUSA_FILES if medusa else _LLAMA_FILES)
  keys = list(tensors)
  try:
    if medusa or "num_heads" in config and any(k.startswith(("blocks.", "medusa_")) for k in keys):
      return _medusa(config, tensors, target, name)
    if "draft_vocab_size" in config or any(k.startswith("midlayer.") for k in keys):
      return eagle3.from_hub(config, tensors, target, dtype)
    if "fc.weight" in tensors:
      return _eagle1(config, tensors, target, name)
  except ValueError as e:  # the file and the field or tensor
    raise ValueError(f"{directory} ({os.path.basename(file)}): {e}") from e
  raise ValueError(f"{file}: not a head layout specjax reads; it holds {sorted(keys)[:6]}.")


def _first(directory: str, names) -> str | None:
  paths = (os.path.join(directory, n) for n in names)
  return next((p for p in paths if os.path.exists(p)), None)


def _read(directory: str, names) -> tuple[str, dict[str, np.ndarray]]:
  """`(file, {name: array})` of the first of `names` in `directory`."""
  f = _first(directory, names)
  if f is None:
    raise FileNotFoundError(f"{directory} holds none of {list(names)}.")
  if f.endswith(".safetensors"):
    return f, {n: a for _, n, a in weights.read_tensors([f])}
  try:
    import torch
  except ImportError as e:
    raise ImportError(f"reading the torch pickle {f} needs torch.") from e
  state = torch.load(f, map_location="cpu", weights_only=True)
  return f, {n: (t.float() if t.is_floating_point() else t).numpy() for n, t in state.items()}


def _abstract(cfg: HeadConfig, name: str = "float32"):
  cfg = dataclasses.replace(cfg, target=cfg.target.replace(dtype=name, param_dtype=name))
  return nnx.split(nnx.eval_shape(lambda: make_head(cfg, rngs=nnx.Rngs(0))))


def _build(cfg: HeadConfig, name: str, names: dict, tensors: dict, copies: dict) -> nnx.Module:
  """The head of `cfg` in dtype `name` from hub `tensors` by `names` (hub name ->
  [(path, transform, part)]) and `copies` (path -> array): every tensor used, its
  shape checked (errors name it); absent biases are zeros."""
  graphdef, abstract = _abstract(cfg, name)
  flat = [(tuple(p), v) for p, v in nnx.to_flat_state(abstract)]
  values = {p: np.zeros(v.get_value().shape, np.float32) for p, v in flat} | copies
  for hub, targets in names.items():
    if hub not in tensors:
      if hub.endswith(".bias"):
        continue
      raise ValueError(f"tensor {hub} is missing.")
    tensor = np.asarray(tensors.pop(hub), np.float32)
    for path, f, part in targets:
      value, buffer = f(tensor), values[path]
      want = buffer.shape if part is None else (*buffer.shape[:-1], part.width)
      if value.shape != want:
        want = f(np.empty(want)).shape
        raise ValueError(f"tensor {hub} has shape {tensor.shape}; this target needs {want}.")
      if part is None:
        buffer[...] = value
      else:
        part.put(buffer, value)
  if tensors:
    raise ValueError(f"tensors {sorted(tensors)[:6]} are not part of the layout.")
  cast = {p: jax.device_put(values[p].astype(jnp.dtype(name))) for p, _ in flat}
  return nnx.merge(graphdef, nnx.from_flat_state([(p, v.replace(cast[p])) for p, v in flat]))


def _target_copies(target) -> dict:
  """The target's final-norm scale and head, which hub heads keep copies of."""
  head = target.embed.embedding[...].T if target.cfg.tie_embeddings else target.lm_head[...]
  norm = np.asarray(target.final_norm.scale[...], np.float32)
  return {("feature_norm", "scale"): norm, ("lm_head", "kernel"): np.asarray(head, np.float32)}


def _check_llama(t) -> None:
  from specjax.hf.export import _BEYOND_LLAMA
  from specjax.models.config import ModelConfig

  odd = [f for f in _BEYOND_LLAMA if getattr(t, f) != getattr(ModelConfig, f)]
  if odd or (t.norm, t.mlp, t.positions) != ("rmsnorm", "swiglu", "rope"):
    raise ValueError(f"hub heads are Llama layers; the target differs in {odd}.")


def _check(config: dict, want: dict) -> None:
  for key, (value, default) in want.items():
    got = config.get(key, default)
    if got != value:
      raise ValueError(f"config.json {key} is {got!r}; the target needs {value!r}.")


def _eagle_names(cfg: HeadConfig) -> dict:
  """EAGLE-1 hub names -> targets: fc, and the Llama layer 0 as `block`."""
  names = {"fc.weight": [(("fc", "kernel"), weights._transpose, None)]}
  names["fc.bias"] = [(("fc", "bias"), weights._same, None)]
  for hub, targets in weights._llama_names(cfg.block_config).items():
    if hub.startswith("model.layers.0.") and (cfg.input_norm or "input_layernorm" not in hub):
      names[hub[len("model.") :]] = [(("block", *p[2:]), f, part) for p, f, part in targets]
  return names


def _eagle1(config: dict, tensors: dict, target, name: str) -> nnx.Module:
  t = target.cfg
  _check_llama(t)
  kv = (t.n_kv_heads, config.get("num_attention_heads"))
  want = dict(hidden_size=t.d_model, vocab_size=t.vocab_size, num_attention_heads=t.n_heads)
  want = {k: (v, None) for k, v in want.items()} | dict(num_key_value_heads=kv)
  want |= dict(num_hidden_layers=(1, None), rms_norm_eps=(t.norm_eps, 1e-6))
  want |= dict(rope_theta=(t.rope_theta, 1e4), rope_scaling=(None, None))
  _check(config, want | dict(hidden_act=("silu", "silu"), add_para_norm=(False, False)))
  if t.d_model // t.n_heads != t.resolved_head_dim:
    raise ValueError(f"the target's head_dim {t.resolved_head_dim} is not hidden_size / heads.")
  embed = tensors.pop("embed_tokens.weight", None)
  own = np.asarray(target.embed.embedding[...], np.float32)
  if embed is not None and not (embed.shape == own.shape and np.allclose(embed, own, 1e-2, 1e-3)):
    raise ValueError("tensor embed_tokens.weight is not the target's embedding (shared here).")
  hub = dict(normed_features=True, embed_first=True, input_norm=False)
  cfg = HeadConfig("eagle", t, d_ff=int(config.get("intermediate_size", t.d_ff)), **hub)
  return _build(cfg, name, _eagle_names(cfg), tensors, _target_copies(target))


def _medusa_names(cfg: HeadConfig, vllm: bool, shared: str | None = None) -> dict:
  """Medusa's (`{i}.{j}.linear`, `{i}.{L}`) or vLLM's (`blocks.{i}.layers.{j}`,
  `lm_heads.{i}`; `shared`: one lm_head) names -> targets."""
  names, n, tr = {}, cfg.medusa_layers, weights._transpose
  for i in range(cfg.num_heads):
    for j in range(n):
      path = ("heads", i) + ((j,) if n > 1 else ())
      hub = f"blocks.{i}.layers.{j}." if vllm else f"{i}.{j}.linear."
      names[hub + "weight"] = [(path + ("kernel",), tr, None)]
      names[hub + "bias"] = [(path + ("bias",), weights._same, None)]
    hub = shared or (f"lm_heads.{i}.weight" if vllm else f"{i}.{n}.weight")
    names.setdefault(hub, []).append((("lm_heads", i, "kernel"), tr, None))
  return names


def _medusa(config: dict, tensors: dict, target, name: str) -> nnx.Module:
  t, vllm = target.cfg, "medusa_num_heads" not in config
  tensors = {k.removeprefix("medusa_heads."): v for k, v in tensors.items()}
  if vllm:
    v = (t.vocab_size, t.vocab_size)
    _check(config, dict(hidden_size=(t.d_model,) * 2, vocab_size=v, truncated_vocab_size=v))
    tensors.pop("token_map", None)
  layers = int(config.get("num_hidden_layers" if vllm else "medusa_num_layers", 1))
  pattern = r"blocks\.(\d+)\." if vllm else r"(\d+)\.0\.linear"
  k = 1 + max((int(m.group(1)) for n in tensors if (m := re.match(pattern, n))), default=-1)
  if not 1 <= k <= 16:  # the file's heads: published configs sometimes say fewer
    raise ValueError(f"found {k} Medusa heads in the file; specjax reads 1 to 16.")
  cfg = HeadConfig("medusa", t, num_heads=k, medusa_layers=layers, normed_features=True)
  shared = None
  if config.get("original_lm_head"):  # vLLM: one lm_head for all heads
    shared = "lm_heads.0.weight" if "lm_heads.0.weight" in tensors else "lm_head.weight"
  copies = _target_copies(target)
  copies.pop(("lm_head", "kernel"))
  return _build(cfg, name, _medusa_names(cfg, vllm, shared), tensors, copies)


def save_head(head, path: str, layout: str = "hub") -> None:
  """Writes `head` (a head module, or a drafter holding one: what `load_head` and
  `load_drafter` return) to directory `path`: config.json + model.safetensors in its
  hub layout (EAGLE-3; a hub EAGLE-1 head as the EAGLE repository's, a hub Medusa head
  as vLLM's; ValueError for a head no hub layout computes exactly), or
  head_config.json + model.safetensors with `layout="specjax"`."""
  from safetensors.numpy import save_file

  given, head = head, head_kinds.module_of(head)
  cfg = head.cfg
  params = {tuple(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(head))}
  dtype = str(jnp.dtype(cfg.target.param_dtype))
  if layout == "specjax":
    from specjax.pretrained import head_tensors

    config, file, tensors = cfg.to_dict(), HEAD_CONFIG_FILE, head_tensors(head)
  elif layout != "hub":
    raise ValueError(f"layout must be 'hub' or 'specjax', got {layout!r}.")
  elif cfg.kind == "eagle3":
    config, file, tensors = eagle3.hub_config(head), "config.json", eagle3.hub_tensors(head)
  elif cfg.kind == "eagle" and cfg.normed_features and cfg.embed_first and not cfg.input_norm:
    from types import SimpleNamespace

    from specjax.hf.export import hf_config

    c, file, names = cfg.block_config, "config.json", _eagle_names(cfg)
    config = hf_config(SimpleNamespace(cfg=c), dtype)
    config |= {"num_hidden_layers": 1, "bias": True, "qkv_bias": c.qkv_bias}
  elif cfg.kind == "medusa" and cfg.normed_features:
    t, file, names = cfg.target, "config.json", _medusa_names(cfg, vllm=True)
    config = dict(architectures=["MedusaModel"], model_type="medusa", hidden_size=t.d_model)
    config |= dict(vocab_size=t.vocab_size, truncated_vocab_size=t.vocab_size, torch_dtype=dtype)
    config |= dict(
      num_heads=cfg.num_heads, num_hidden_layers=cfg.medusa_layers, medusa_fc_bias=True
    )
  else:
    raise ValueError(  # specjax's EAGLE-1 and Medusa heads read the pre-norm features
      f"no hub layout computes this {cfg.kind} head exactly; use layout='specjax'."
    )
  if file == "config.json" and cfg.kind != "eagle3":  # the inverse of reading `names`
    tensors = {}
    for hub, [(p, f, part), *_] in names.items():
      if p not in params and hub.endswith(".bias"):
        continue  # a bias the head's module does not carry (the reader reads zeros)
      value = params[p] if part is None else part.take(params[p])
      tensors[hub] = value.T if f is weights._transpose else value
    written = {t[0] for targets in names.values() for t in targets}
    _check_nothing_dropped(cfg.kind, params, written, getattr(given, "target", None))
  os.makedirs(path, exist_ok=True)
  tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
  save_file(tensors, os.path.join(path, HEAD_WEIGHTS_FILE), metadata={"format": "pt"})
  with open(os.path.join(path, file), "w") as f:
    json.dump(config, f, indent=2)


def _check_nothing_dropped(kind: str, params: dict, written: set, target) -> None:
  """ValueError naming a parameter of a hub head that its file would not hold: one
  outside the layout that is not zero, or (given the drafter's `target`) a copy of the
  target's final norm or head that the reader would take from the target but differs."""
  copies = _target_copies(target) if target is not None else {}
  for path, value in params.items():
    name = ".".join(map(str, path))
    if path in (("feature_norm", "scale"), ("lm_head", "kernel")):
      want = copies.get(path)  # read back from the target, not from the file
      if want is not None and not np.array_equal(value, want.astype(value.dtype)):
        raise ValueError(
          f"{name}: the {kind} hub layout takes it from the target, and this head's "
          "differs from its target's; write it with layout='specjax'."
        )
    elif path not in written and np.any(value):
      raise ValueError(
        f"{name}: the {kind} hub layout has no tensor for it and it is not zero; "
        "write the head with layout='specjax'."
      )
