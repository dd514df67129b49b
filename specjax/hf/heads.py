"""Draft heads by path: specjax's runs and exports, and the hub's layouts in and out
(EAGLE-1/2, EAGLE-3, Medusa, DFlash; files, key names and their sources:
docs/hf_checkpoints.md).

  head = specjax.hf.load_head("yuhuili/EAGLE-Vicuna-7B-v1.3", target)  # cached, offline
  drafter = specjax.hf.load_drafter("yuhuili/EAGLE-Vicuna-7B-v1.3", target)  # its drafter
  specjax.hf.save_head(head, "out")  # e.g. EAGLE-3 as vLLM and SGLang load it (or a drafter)

`load_head` returns the head module, as `specjax.pretrained.load_head` does for a bundled
kind; `load_drafter` returns its drafter, as `specjax.pretrained.load_drafter` does.
`HUB_LAYOUTS` is the one table of each kind's hub layout (its reader and writer),
keyed by `specjax.heads.NAMES`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Collection

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import heads as head_kinds
from specjax.dtypes import dtype_name
from specjax.heads.files import head_tensors, read_head_params
from specjax.hf import dflash, eagle3, weights
from specjax.hf.hub import resolve_checkpoint
from specjax.hf.hub_names import abstract_head, build_head, flat_params, named_tensors
from specjax.models.heads import HEAD_CONFIG_FILE, HEAD_WEIGHTS_FILE, HeadConfig
from specjax.validation import read_json_object

# Weight files per layout, in the order the reference loaders try them.
_LLAMA_FILES = ("model.safetensors", "pytorch_model.bin")  # heads are never sharded
_MEDUSA_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


def load_drafter(path: str, target, dtype=jnp.float32):
  """The drafter (`EagleDrafter`, `MedusaDrafter`, `EarlyExitDrafter`, `DFlashDrafter`)
  of the head at `path` for `target`: `load_head`'s module, drafting for `target`."""
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
      graphdef, abstract = abstract_head(cfg, name)
      return nnx.merge(graphdef, read_head_params(file, abstract, dtype, cfg.block_config))
    from specjax.training import load_trained_head

    graphdef, _ = abstract_head(cfg, name)
    state = nnx.state(load_trained_head(directory)[0])
    return nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(dtype), state))
  config_file = os.path.join(directory, "config.json")
  if not os.path.exists(config_file):
    raise FileNotFoundError(f"{directory} holds neither {HEAD_CONFIG_FILE} nor config.json.")
  config = read_json_object(config_file)
  read, file, keys = {}, None, ()
  for kind in _READ_ORDER:  # the most specific layout first
    layout = HUB_LAYOUTS[kind]
    file = _first(directory, layout.files)
    if file is None:
      continue
    if file not in read:  # each file is read once, whichever layouts look at it
      read[file] = _read(file)
    keys = read[file].keys()
    if layout.recognises(config, os.path.basename(file), keys):
      try:
        return layout.read(config, dict(read[file]), target, dtype)
      except ValueError as e:  # the file and the field or tensor
        raise ValueError(f"{directory} ({os.path.basename(file)}): {e}") from e
  if not read:
    names = sorted({n for layout in HUB_LAYOUTS.values() if layout for n in layout.files})
    raise FileNotFoundError(f"{directory} holds none of {names}.")
  raise ValueError(f"{file}: not a head layout specjax reads; it holds {sorted(keys)[:6]}.")


def _first(directory: str, names) -> str | None:
  paths = (os.path.join(directory, n) for n in names)
  return next((p for p in paths if os.path.exists(p)), None)


def _read(f: str) -> dict[str, np.ndarray]:
  """`{name: array}` of the weight file `f` (safetensors, or a torch pickle)."""
  if f.endswith(".safetensors"):
    return {n: a for _, n, a in weights.read_tensors([f])}
  try:
    import torch
  except ImportError as e:
    raise ImportError(f"reading the torch pickle {f} needs torch.") from e
  state = torch.load(f, map_location="cpu", weights_only=True)
  return {n: (t.float() if t.is_floating_point() else t).numpy() for n, t in state.items()}


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


def _is_eagle1(config: dict, file: str, keys: Collection[str]) -> bool:
  del config, file  # a Llama config: any head layout with an fc that no other claims
  return "fc.weight" in keys


def _eagle1(config: dict, tensors: dict, target, dtype) -> nnx.Module:
  t, name = target.cfg, dtype_name(dtype)
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
  return build_head(cfg, name, _eagle_names(cfg), tensors, _target_copies(target))


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


def _is_medusa(config: dict, file: str, keys: Collection[str]) -> bool:
  if file in _MEDUSA_FILES or "medusa_num_heads" in config:  # the Medusa repository's
    return True
  return "num_heads" in config and any(k.startswith(("blocks.", "medusa_")) for k in keys)


def _medusa(config: dict, tensors: dict, target, dtype) -> nnx.Module:
  t, vllm, name = target.cfg, "medusa_num_heads" not in config, dtype_name(dtype)
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
  return build_head(cfg, name, _medusa_names(cfg, vllm, shared), tensors, copies)


def _write_eagle1(head, target) -> tuple[dict, dict]:
  """A hub EAGLE-1 head as the EAGLE repository's (a Llama config, fc with a bias)."""
  from types import SimpleNamespace

  from specjax.hf.export import hf_config

  cfg = head.cfg
  if not (cfg.normed_features and cfg.embed_first and not cfg.input_norm):
    raise ValueError(_NO_LAYOUT.format(kind=cfg.kind))  # specjax's reads pre-norm features
  c, dtype = cfg.block_config, str(jnp.dtype(cfg.target.param_dtype))
  config = hf_config(SimpleNamespace(cfg=c), dtype)
  config |= {"num_hidden_layers": 1, "bias": True, "qkv_bias": c.qkv_bias}
  return config, _write_names(head, _eagle_names(cfg), target)


def _write_medusa(head, target) -> tuple[dict, dict]:
  """A hub Medusa head as vLLM's (`MedusaModel`)."""
  cfg = head.cfg
  if not cfg.normed_features:
    raise ValueError(_NO_LAYOUT.format(kind=cfg.kind))  # specjax's reads pre-norm features
  t, dtype = cfg.target, str(jnp.dtype(cfg.target.param_dtype))
  config = dict(architectures=["MedusaModel"], model_type="medusa", hidden_size=t.d_model)
  config |= dict(vocab_size=t.vocab_size, truncated_vocab_size=t.vocab_size, torch_dtype=dtype)
  config |= dict(num_heads=cfg.num_heads, num_hidden_layers=cfg.medusa_layers, medusa_fc_bias=True)
  return config, _write_names(head, _medusa_names(cfg, vllm=True), target)


def _write_names(head, names: dict, target) -> dict:
  """The head's tensors by `names`, after `_check_nothing_dropped`."""
  params = flat_params(head)
  tensors, written = named_tensors(params, names)
  _check_nothing_dropped(head.cfg.kind, params, written, target)
  return tensors


@dataclasses.dataclass(frozen=True)
class HubLayout:
  """A head kind's published layout: what `load_head` reads and `save_head` writes.

  Attributes:
    title: the layout, as messages name it.
    files: its weight files, in the order its reference loaders try them (the first
      present is read; config.json is beside it).
    recognises: `(config, file, tensor names) -> bool`: whether a directory's
      config.json, weight file's name and tensors are this layout.
    read: `(config, tensors, target, dtype) -> head module`; ValueError naming the
      field or tensor that does not fit the target.
    write: `(head, target or None) -> (config, tensors)`: the head's config.json and
      tensors; ValueError naming what the layout cannot hold (nothing is dropped).
      `target` is a drafter's (to check copies of it the head keeps), or None.
  """

  title: str
  files: tuple[str, ...]
  recognises: Callable[[dict, str, Collection[str]], bool]
  read: Callable
  write: Callable


_NO_LAYOUT = "no hub layout computes this {kind} head exactly; use layout='specjax'."
# Each kind's hub layout, None where there is none: the one table `load_head` and
# `save_head` dispatch on (its keys are `specjax.heads.NAMES`, checked below).
HUB_LAYOUTS: dict[str, HubLayout | None] = {
  "eagle": HubLayout(
    "EAGLE-1/2 (the EAGLE repository's)", _LLAMA_FILES, _is_eagle1, _eagle1, _write_eagle1
  ),
  "medusa": HubLayout(
    "Medusa (the Medusa repository's; vLLM's MedusaModel)",
    _MEDUSA_FILES + _LLAMA_FILES,
    _is_medusa,
    _medusa,
    _write_medusa,
  ),
  "early_exit": None,
  "eagle3": HubLayout(
    f"{eagle3.ARCHITECTURE} (vLLM, SGLang)",
    _LLAMA_FILES,
    eagle3.recognises,
    eagle3.from_hub,
    eagle3.write,
  ),
  "dflash": HubLayout(
    f"{dflash.ARCHITECTURE} (z-lab/dflash)",
    _LLAMA_FILES,
    dflash.recognises,
    dflash.from_hub,
    dflash.write,
  ),
}
if tuple(HUB_LAYOUTS) != head_kinds.NAMES:  # one entry per kind, in the kinds' order
  raise ImportError(f"HUB_LAYOUTS {tuple(HUB_LAYOUTS)} and specjax.heads.NAMES differ.")
# The order `load_head` tries them: the most specific first; EAGLE-1's is any head file
# with an `fc.weight` (DFlash's has one too).
_READ_ORDER = ("medusa", "eagle3", "dflash", "eagle")
if set(_READ_ORDER) != {k for k, layout in HUB_LAYOUTS.items() if layout}:
  raise ImportError(f"_READ_ORDER {_READ_ORDER} must name every kind with a hub layout.")


def save_head(head, path: str, layout: str = "hub") -> None:
  """Writes `head` (a head module, or a drafter holding one: what `load_head` and
  `load_drafter` return) to directory `path`: config.json + model.safetensors in its
  kind's hub layout (`HUB_LAYOUTS`: EAGLE-3 as vLLM and SGLang load it, a hub EAGLE-1
  head as the EAGLE repository's, a hub Medusa head as vLLM's, a block drafter as
  z-lab/dflash's `DFlashDraftModel`; ValueError, before anything is written, for a
  head no hub layout computes exactly), or head_config.json + model.safetensors with
  `layout="specjax"`."""
  from safetensors.numpy import save_file

  given, head = head, head_kinds.module_of(head)
  cfg = head.cfg
  if layout == "specjax":
    config, file, tensors = cfg.to_dict(), HEAD_CONFIG_FILE, head_tensors(head)
  elif layout != "hub":
    raise ValueError(f"layout must be 'hub' or 'specjax', got {layout!r}.")
  elif HUB_LAYOUTS[cfg.kind] is None:
    raise ValueError(_NO_LAYOUT.format(kind=cfg.kind))
  else:
    file = "config.json"
    config, tensors = HUB_LAYOUTS[cfg.kind].write(head, getattr(given, "target", None))
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
