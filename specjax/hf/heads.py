"""Draft heads by path: specjax's runs and exports, and the hub's layouts in and out
(each kind's `hub` layout in its file under `specjax/heads/`; files, key names and their
sources: docs/hf_checkpoints.md).

  head = specjax.hf.load_head("yuhuili/EAGLE-Vicuna-7B-v1.3", target)  # cached, offline
  drafter = specjax.hf.load_drafter("yuhuili/EAGLE-Vicuna-7B-v1.3", target)  # its drafter
  specjax.hf.save_head(head, "out")  # e.g. EAGLE-3 as vLLM and SGLang load it (or a drafter)

`load_head` returns the head module, as `specjax.pretrained.load_head` does for a bundled
kind; `load_drafter` returns its drafter, as `specjax.pretrained.load_drafter` does.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import heads
from specjax.dtypes import dtype_name
from specjax.heads import files, hub
from specjax.hf.hub import resolve_checkpoint
from specjax.validation import read_json_object


def load_drafter(path: str, target, dtype=jnp.float32):
  """The drafter of the head at `path` for `target` (its kind's drafter):
  `load_head`'s module, drafting for `target`."""
  return heads.drafter(target, load_head(path, target, dtype))


def _layouts() -> list[tuple[str, hub.HubLayout]]:
  """The registered kinds' hub layouts, in the order `load_head` tries them."""
  ordered = sorted((k for k in heads.kinds() if k.hub), key=lambda k: k.read_priority)
  return [(k.name, k.hub) for k in ordered]


def load_head(path: str, target, dtype=jnp.float32) -> nnx.Module:
  """The head at `path` (a directory or a repo id in the local Hugging Face cache,
  never downloaded) in `dtype`, for `target`: ValueError names the field that differs."""
  directory = resolve_checkpoint(path, flag="path")
  name = dtype_name(dtype)
  if os.path.exists(os.path.join(directory, files.CONFIG_FILE)):
    cfg = files.read_config(directory)
    cfg.check_target(target.cfg)
    if os.path.exists(os.path.join(directory, files.WEIGHTS_FILE)):
      return files.read_head(directory, cfg, dtype)
    from specjax.training import load_trained_head

    graphdef, _ = hub.abstract_head(cfg, name)
    state = nnx.state(load_trained_head(directory)[0])
    return nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(dtype), state))
  config_file = os.path.join(directory, "config.json")
  if not os.path.exists(config_file):
    raise FileNotFoundError(f"{directory} holds neither {files.CONFIG_FILE} nor config.json.")
  config = read_json_object(config_file)
  layouts = _layouts()
  read, file, keys = {}, None, ()
  for _, layout in layouts:  # the most specific layout first
    file = hub.first_file(directory, layout.files)
    if file is None:
      continue
    if file not in read:  # each file is read once, whichever layouts look at it
      read[file] = hub.read_weights(file)
    keys = read[file].keys()
    if layout.recognises(config, os.path.basename(file), keys):
      try:
        return layout.read(config, dict(read[file]), target, dtype)
      except ValueError as e:  # the file and the field or tensor
        raise ValueError(f"{directory} ({os.path.basename(file)}): {e}") from e
  if not read:
    names = sorted({n for _, layout in layouts for n in layout.files})
    raise FileNotFoundError(f"{directory} holds none of {names}.")
  raise ValueError(f"{file}: not a head layout specjax reads; it holds {sorted(keys)[:6]}.")


def save_head(head, path: str, layout: str = "hub") -> None:
  """Writes `head` (a head module, or a drafter holding one: what `load_head` and
  `load_drafter` return) to directory `path`: config.json + model.safetensors in its
  kind's hub layout (its record's `hub`: EAGLE-3 as vLLM and SGLang load it, a hub
  EAGLE-1 head as the EAGLE repository's, a hub Medusa head as vLLM's, a block drafter
  as z-lab/dflash's `DFlashDraftModel`, a sequential block drafter as DeepSpec's
  `Qwen3DSparkModel`; ValueError, before anything is written, for a
  head no hub layout computes exactly), or head_config.json + model.safetensors with
  `layout="specjax"`."""
  from safetensors.numpy import save_file

  given, head = head, heads.module_of(head)
  cfg = head.cfg
  if layout == "specjax":
    config, tensors = None, files.head_tensors(head)
  elif layout != "hub":
    raise ValueError(f"layout must be 'hub' or 'specjax', got {layout!r}.")
  elif heads.of(cfg).hub is None:
    raise ValueError(hub.NO_LAYOUT.format(kind=cfg.kind))
  else:
    config, tensors = heads.of(cfg).hub.write(head, getattr(given, "target", None))
  os.makedirs(path, exist_ok=True)
  tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
  save_file(tensors, os.path.join(path, files.WEIGHTS_FILE), metadata={"format": "pt"})
  if config is None:
    files.write_config(path, cfg)
  else:
    with open(os.path.join(path, "config.json"), "w") as f:
      json.dump(config, f, indent=2)
