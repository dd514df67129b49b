"""Abstract models, caches and batches placed on a target's devices.

Everything here is `jax.ShapeDtypeStruct`s with `NamedSharding`s on a mesh of
the target's (abstract) devices: nothing is allocated, and `jax.jit(f).lower(...)`
of them lowers for the target. Parameters take the same logical-axis shardings a
real run gives them (`specjax.distributed.LOGICAL_RULES`, `param_shardings`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from specjax import compiler_options
from specjax.distributed.mesh import DATA, LOGICAL_RULES, named_sharding


def place_module(
  module: nnx.Module,
  mesh: Mesh,
  rules: Mapping[str, str | None] = LOGICAL_RULES,
  replicate: bool = False,
) -> nnx.Module:
  """`module` (abstract, `nnx.eval_shape`, or real) with every variable an abstract
  array on `mesh`: sharded by its logical names under `rules`, or replicated
  (`replicate`: a small drafter, as `shard_model(replicate=True)` places it)."""
  graphdef, state = nnx.split(module)

  def one(variable):
    value = variable.get_value()
    names = None if replicate else variable.get_metadata().get("out_sharding")
    names = names or (None,) * len(value.shape)
    sharding = named_sharding(mesh, names, value.shape, rules)
    return variable.replace(jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding))

  placed = jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return nnx.merge(graphdef, placed)


def mesh_platform(mesh: Mesh) -> str:
  """The platform of `mesh`'s devices: "gpu", "tpu" or "cpu"."""
  name = mesh.devices.flat[0].platform
  return "gpu" if name in compiler_options.GPU_PLATFORMS else name


def abstract_on(build, mesh: Mesh, replicate: bool = False, **kwargs) -> nnx.Module:
  """`build(rngs=nnx.Rngs(0), **kwargs)` (a module's constructor) as shapes only,
  placed on `mesh` (`place_module`); built as for `mesh`'s platform (a config
  that leaves the layer layout to the platform gets that platform's)."""
  with compiler_options.target_platform(mesh_platform(mesh)):
    module = nnx.eval_shape(lambda: build(rngs=nnx.Rngs(0), **kwargs))
  return place_module(module, mesh, replicate=replicate)


def array(
  shape: Sequence[int], dtype, mesh: Mesh, spec: PartitionSpec | None = None
) -> jax.ShapeDtypeStruct:
  """An abstract array on `mesh`: rows split over `data` by default (a batch),
  when `data` divides them; replicated otherwise."""
  if spec is None:
    rows_split = len(shape) > 0 and shape[0] % mesh.shape.get(DATA, 1) == 0
    spec = PartitionSpec(DATA if rows_split else None, *(None,) * (len(shape) - 1))
  return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=NamedSharding(mesh, spec))


def key(mesh: Mesh) -> jax.ShapeDtypeStruct:
  """An abstract `jax.random.key` on `mesh`, replicated."""
  k = jax.eval_shape(lambda: jax.random.key(0))
  return jax.ShapeDtypeStruct(k.shape, k.dtype, sharding=NamedSharding(mesh, PartitionSpec()))


def abstract_tree(tree, mesh: Mesh):
  """Every array leaf of `tree` (real or abstract) as an abstract array on `mesh`,
  replicated: for small inputs built on the host (a constraint table, a tree)."""

  def one(x):
    if isinstance(x, jax.Array | jax.ShapeDtypeStruct) or hasattr(x, "__array__"):
      x = jnp.asarray(x) if not isinstance(x, jax.ShapeDtypeStruct) else x
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, PartitionSpec()))
    return x

  return jax.tree.map(one, tree)
