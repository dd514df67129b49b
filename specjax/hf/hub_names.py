"""Hub tensor names <-> a head's parameters, for the hub layouts (`specjax.hf.heads`).

A layout is a table `names`: hub name -> `[(path, transform, part)]` (`weights.Target`:
the parameter path, the transform from the hub's tensor into specjax's layout, and
the `Part` of a fused parameter it fills, or None). `build_head` reads a head from
named tensors through it, `named_tensors` writes them back (its inverse).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.hf import weights
from specjax.models.heads import HeadConfig, make_head


def abstract_head(cfg: HeadConfig, name: str = "float32"):
  """`(graphdef, abstract state)` of the head of `cfg` in dtype `name`, with no
  parameters made (the readers fill them)."""
  cfg = dataclasses.replace(cfg, target=cfg.target.replace(dtype=name, param_dtype=name))
  return nnx.split(nnx.eval_shape(lambda: make_head(cfg, rngs=nnx.Rngs(0))))


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
    tensors[hub] = value.T if f is weights._transpose else value
  return tensors, {t[0] for targets in names.values() for t in targets}


def flat_params(head) -> dict[tuple, np.ndarray]:
  """The head's parameters by path, as NumPy arrays in their stored dtype."""
  return {tuple(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(head))}
