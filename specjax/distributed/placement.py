"""Placing models and batches onto a mesh."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from specjax.distributed.mesh import DATA, LOGICAL_RULES, named_sharding


def param_shardings(model: nnx.Module, mesh: Mesh, rules: Mapping[str, str | None] = LOGICAL_RULES):
  """nnx.State of `NamedSharding`s for `model`'s parameters, from their logical names."""
  state = nnx.state(model, nnx.Param)

  def one(variable):
    shape = variable.get_value().shape
    names = variable.get_metadata().get("out_sharding") or (None,) * len(shape)
    return variable.replace(named_sharding(mesh, names, shape, rules))

  return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_model(
  model: nnx.Module,
  mesh: Mesh,
  rules: Mapping[str, str | None] = LOGICAL_RULES,
  replicate: bool = False,
) -> nnx.Module:
  """A new `model` with every parameter placed by the rules, or replicated
  (`replicate=True`: a small draft then drafts without communication)."""

  graphdef, state = nnx.split(model)
  if replicate:
    shardings = jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), state)
  else:
    shardings = param_shardings(model, mesh, rules)
  placed = jax.device_put(state, shardings)
  return nnx.merge(graphdef, placed)


def shard_batch(array, mesh: Mesh, axis: str = DATA) -> jax.Array:
  """A host array (identical on every process) split over `axis` along its first dim."""
  array = np.asarray(array)
  spec = PartitionSpec(axis, *(None,) * (array.ndim - 1))
  sharding = NamedSharding(mesh, spec)
  return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def shard_process_batch(local, mesh: Mesh, axis: str = DATA) -> jax.Array:
  """A global batch from each process's own rows (multi-host data loading)."""
  local = np.asarray(local)
  spec = PartitionSpec(axis, *(None,) * (local.ndim - 1))
  return jax.make_array_from_process_local_data(NamedSharding(mesh, spec), local)
