"""A head's files in specjax's own layout (a bundled head, `save_head(layout="specjax")`):
`CONFIG_FILE` holds its `HeadConfig`, `WEIGHTS_FILE` its parameters by module path
(`block.attn.q_proj.kernel`, `heads.0.bias`), a fused projection's parts stored apart
as checkpoints store them (`specjax.models.fused`). Every kind is written and read by
these two functions; the hub's layouts are `specjax.hf.heads`'s (`HUB_LAYOUTS`).
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from specjax.models.config import ModelConfig
from specjax.models.fused import fused_parts, unfuse
from specjax.models.heads import HEAD_CONFIG_FILE, HEAD_WEIGHTS_FILE
from specjax.tensor_files import read_tensors

CONFIG_FILE = HEAD_CONFIG_FILE  # the `HeadConfig` of a run or an export
WEIGHTS_FILE = HEAD_WEIGHTS_FILE  # its parameters (safetensors)


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
  path: str, abstract: nnx.State, dtype, block_cfg: ModelConfig, fix: str = ""
) -> nnx.State:
  """The parameters in `WEIGHTS_FILE` `path`, in `abstract`'s tree, cast to `dtype`:
  each fused parameter of `abstract` assembled from its parts (`block_cfg` the head's
  block config). ValueError naming the file and tensor for a missing, extra or
  misshapen tensor, or a file that is no safetensors file; `fix` (e.g. "reinstall
  specjax") is added to each message."""
  hint = f" ({fix})" if fix else ""
  try:
    tensors = {name: value for _, name, value in read_tensors([path])}
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
