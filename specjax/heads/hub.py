"""The machinery of the hub's head layouts, shared by every kind with one: what a layout
is (`HubLayout`), hub tensor names <-> a head's parameters, and the checks every layout
makes. A kind's own layout (its names, config.json fields, reader and writer) lives in its
file (`specjax/heads/eagle3.py`, ...); `specjax.hf.load_head` and `save_head` choose
among the registered kinds' layouts.

A layout's names are a table `names`: hub name -> `[(path, transform, part)]`
(`specjax.models.hub_names.Target`: the parameter path, the transform from the hub's
tensor into specjax's layout, and the `Part` of a fused parameter it fills, or None).
`build_head` reads a head from named tensors through it, `named_tensors` writes them
back (its inverse).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Collection

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.heads.base import HeadConfig, abstract_head
from specjax.models import hub_names
from specjax.models.config import ModelConfig
from specjax.models.hub_config import BEYOND_LLAMA
from specjax.tensor_files import read_tensors

# Weight files of a Llama-style head, in the order the reference loaders try them.
LLAMA_FILES = ("model.safetensors", "pytorch_model.bin")  # heads are never sharded
NO_LAYOUT = "no hub layout computes this {kind} head exactly; use layout='specjax'."


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


def build_head(cfg: HeadConfig, name: str, names: dict, tensors: dict, copies: dict) -> nnx.Module:
  """The head of `cfg` in dtype `name` from hub `tensors` by `names` (hub name ->
  [(path, transform, part)]) and `copies` (path -> array): every tensor used, its
  shape checked (errors name it); absent biases are zeros, and so is every parameter
  neither `names` nor `copies` gives. `tensors` is emptied of what it reads."""
  graphdef, abstract = abstract_head(cfg, name)
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


def named_tensors(params: dict, names: dict) -> tuple[dict[str, np.ndarray], set]:
  """The inverse of `build_head`'s reading: `({hub name: tensor}, the paths written)`
  from `params` (path -> array). A bias the head's module does not carry is left
  out (a reader takes it as zeros); a name's first target gives its tensor."""
  tensors = {}
  for hub, [(path, f, part), *_] in names.items():
    if path not in params and hub.endswith(".bias"):
      continue
    value = params[path] if part is None else part.take(params[path])
    tensors[hub] = value.T if f is hub_names.transpose else value
  return tensors, {t[0] for targets in names.values() for t in targets}


def flat_params(head) -> dict[tuple, np.ndarray]:
  """The head's parameters by path, as NumPy arrays in their stored dtype."""
  return {tuple(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(head))}


def first_file(directory: str, names) -> str | None:
  """The first of files `names` that `directory` holds, or None."""
  paths = (os.path.join(directory, n) for n in names)
  return next((p for p in paths if os.path.exists(p)), None)


def read_weights(f: str) -> dict[str, np.ndarray]:
  """`{name: array}` of the weight file `f` (safetensors, or a torch pickle)."""
  if f.endswith(".safetensors"):
    return {n: a for _, n, a in read_tensors([f])}
  try:
    import torch
  except ImportError as e:
    raise ImportError(f"reading the torch pickle {f} needs torch.") from e
  state = torch.load(f, map_location="cpu", weights_only=True)
  return {n: (t.float() if t.is_floating_point() else t).numpy() for n, t in state.items()}


def target_copies(target) -> dict:
  """The target's final-norm scale and head, which hub heads keep copies of."""
  head = target.embed.embedding[...].T if target.cfg.tie_embeddings else target.lm_head[...]
  norm = np.asarray(target.final_norm.scale[...], np.float32)
  return {("feature_norm", "scale"): norm, ("lm_head", "kernel"): np.asarray(head, np.float32)}


def check_llama(t) -> None:
  """ValueError unless target config `t` is a Llama (what hub heads' layers are)."""
  odd = [f for f in BEYOND_LLAMA if getattr(t, f) != getattr(ModelConfig, f)]
  if odd or (t.norm, t.mlp, t.positions) != ("rmsnorm", "swiglu", "rope"):
    raise ValueError(f"hub heads are Llama layers; the target differs in {odd}.")


def check_fields(config: dict, want: dict) -> None:
  """ValueError naming the first config.json key whose value (or default) is not the
  wanted one; `want`: key -> (value, default)."""
  for key, (value, default) in want.items():
    got = config.get(key, default)
    if got != value:
      raise ValueError(f"config.json {key} is {got!r}; the target needs {value!r}.")


def write_names(head, names: dict, target) -> dict:
  """The head's tensors by `names`, after `check_nothing_dropped`."""
  params = flat_params(head)
  tensors, written = named_tensors(params, names)
  check_nothing_dropped(head.cfg.kind, params, written, target)
  return tensors


def check_nothing_dropped(kind: str, params: dict, written: set, target) -> None:
  """ValueError naming a parameter of a hub head that its file would not hold: one
  outside the layout that is not zero, or (given the drafter's `target`) a copy of the
  target's final norm or head that the reader would take from the target but differs."""
  copies = target_copies(target) if target is not None else {}
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
