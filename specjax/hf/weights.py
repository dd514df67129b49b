"""Hugging Face safetensors -> the parameters of a `specjax.Transformer`.

Each Hugging Face tensor name maps to one or more parameter paths with a
transform and, for our fused projections, the `Part` of the parameter it fills:
the maps are `specjax.models.hub_names` (`tensor_map`); this module reads by them.

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
from specjax.models.hub_names import Path, canonical, tensor_map
from specjax.tensor_files import read_tensors as read_tensors  # re-exported: the loaders' reader

# Buffers some checkpoints carry that are not parameters.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")


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
    return canonical(model_type, raw_name) is None

  for path, raw_name, tensor in read_tensors(files, skip):
    name = canonical(model_type, raw_name)
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
