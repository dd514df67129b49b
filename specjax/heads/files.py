"""A head's files in specjax's own layout (a training run, a bundled head,
`save_head(layout="specjax")`): `CONFIG_FILE` holds its `HeadConfig`, `WEIGHTS_FILE` its
parameters by module path (`block.attn.q_proj.kernel`, `heads.0.bias`), a fused
projection's parts stored apart as checkpoints store them (`specjax.models.fused`).

`write_config` and `read_config` are the one writer and reader of `CONFIG_FILE` (errors:
`HeadConfigError`, naming the file); `head_tensors` and `read_head_params` the weights'.
Every kind is written and read by these; a kind's hub layout is its record's `hub`.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
from flax import nnx

from specjax.dtypes import dtype_name
from specjax.heads.base import HeadConfig, HeadConfigError, abstract_head
from specjax.models.config import ModelConfig
from specjax.models.fused import fused_parts, unfuse
from specjax.tensor_files import read_tensors

CONFIG_FILE = "head_config.json"  # the `HeadConfig` of a run or an export
WEIGHTS_FILE = "model.safetensors"  # its parameters (safetensors)


def write_config(directory: str, cfg: HeadConfig) -> str:
  """Writes `cfg` as `directory/CONFIG_FILE` atomically (a kill leaves the old file,
  never half of it); returns the path."""
  path = os.path.join(directory, CONFIG_FILE)
  os.makedirs(directory or ".", exist_ok=True)
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(cfg.to_dict(), f, indent=2)
  os.replace(tmp, path)
  return path


def read_config(path: str, fix: str = "") -> HeadConfig:
  """The `HeadConfig` in `path` (a `CONFIG_FILE`, or a directory holding one).
  FileNotFoundError when there is none; HeadConfigError naming the file for one that
  is no head config; `fix` (e.g. "reinstall specjax") is added to each message."""
  if os.path.isdir(path):
    path = os.path.join(path, CONFIG_FILE)
  hint = f" ({fix})" if fix else ""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no head config {path}{hint}")
  try:
    with open(path, encoding="utf-8") as f:
      fields = json.load(f)
    return HeadConfig.from_dict(fields)
  except HeadConfigError as e:
    raise HeadConfigError(f"{path} is not a head config: {e}{hint}") from e
  except (OSError, ValueError, TypeError, KeyError) as e:  # ValueError: JSON, UTF-8, target
    raise HeadConfigError(f"{path} is not a head config: {type(e).__name__}: {e}{hint}") from e


def tensor_name(path: tuple) -> str:
  """A parameter's name in `WEIGHTS_FILE`: its module path joined by dots."""
  return ".".join(str(part) for part in path)


def head_tensors(head: nnx.Module) -> dict[str, jax.Array]:
  """A head's parameters by `WEIGHTS_FILE` name, its block's fused projections split
  into their parts (`specjax.models.fused.unfuse`)."""
  flat = {
    tuple(path): variable.get_value()
    for path, variable in nnx.to_flat_state(nnx.state(head, nnx.Param))
  }
  return {tensor_name(path): value for path, value in unfuse(flat, head.cfg.block_config).items()}


def read_head_params(
  path: str,
  abstract: nnx.State,
  dtype,
  block_cfg: ModelConfig,
  fix: str = "",
  shared: tuple[str, ...] = (),
) -> nnx.State:
  """The parameters in `WEIGHTS_FILE` `path`, in `abstract`'s tree, cast to `dtype`:
  each fused parameter of `abstract` assembled from its parts (`block_cfg` the head's
  block config). `shared`: other heads' weight files that hold the tensors `path`
  leaves out (a head trained on another's frozen layers stores only its own; the
  other files are read for those names only). ValueError naming the file and tensor
  for a missing, extra or misshapen tensor, or a file that is no safetensors file;
  `fix` (e.g. "reinstall specjax") is added to each message."""
  hint = f" ({fix})" if fix else ""
  try:
    tensors = {name: value for _, name, value in read_tensors([path])}
    wanted = {tensor_name(tuple(p)) for p, _ in nnx.to_flat_state(abstract)}
    wanted |= {
      tensor_name((*tuple(p)[:-2], part.name, tuple(p)[-1]))
      for p, _ in nnx.to_flat_state(abstract)
      for part in fused_parts(block_cfg).get(tuple(p)[-2] if len(p) >= 2 else None, ())
    }
    for other in shared:
      for _, name, value in read_tensors([other]):
        if name in wanted and name not in tensors:
          tensors[name] = value
  except ValueError as e:
    raise ValueError(f"{e}{hint}") from e
  fused = fused_parts(block_cfg)

  def tensor(name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name not in tensors:
      raise ValueError(f"{path} lacks the tensor {name!r}{hint}.")
    value = tensors.pop(name)
    if value.shape != shape:
      raise ValueError(
        f"{path}: tensor {name!r} has shape {value.shape}, the head needs {shape}{hint}."
      )
    return value

  flat = []
  for param_path, variable in nnx.to_flat_state(abstract):
    param_path = tuple(param_path)
    shape = variable.get_value().shape
    parts = fused.get(param_path[-2]) if len(param_path) >= 2 else None
    if parts is None:
      value = tensor(tensor_name(param_path), shape).astype(dtype)
    else:
      value = np.empty(shape, dtype)
      for part in parts:
        name = tensor_name((*param_path[:-2], part.name, param_path[-1]))
        part.put(value, tensor(name, (*shape[:-1], part.width)))
    flat.append((param_path, variable.replace(jax.device_put(value))))
  if tensors:
    raise ValueError(f"{path} holds tensors this head does not have: {sorted(tensors)}.")
  return nnx.from_flat_state(flat)


def read_head(
  directory: str, cfg: HeadConfig, dtype, fix: str = "", shared: tuple[str, ...] = ()
) -> nnx.Module:
  """The head of `cfg` in `dtype` from `directory/WEIGHTS_FILE` (specjax's layout:
  `read_head_params`, whose errors name the file; `fix` is added to each), the
  tensors it leaves out from the `WEIGHTS_FILE`s of the `shared` directories."""
  graphdef, abstract = abstract_head(cfg, dtype_name(dtype))
  path = os.path.join(directory, WEIGHTS_FILE)
  others = tuple(os.path.join(d, WEIGHTS_FILE) for d in shared)
  params = read_head_params(path, abstract, dtype, cfg.block_config, fix, others)
  return nnx.merge(graphdef, params)
