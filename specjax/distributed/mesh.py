"""Device meshes and the logical-axis rules that place arrays on them.

A rules table maps logical axis names (`embed`, `heads`, ..., `batch`,
`cache_seq`) to mesh axes (None: replicated): by default tensor parallelism over
`model`, data parallelism over `data`. Axis type `AxisType.Auto`: XLA propagates
the inputs' shardings, so the same programs run on one device or a mesh
(docs/scale_out.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

DATA, MODEL = "data", "model"

LOGICAL_RULES: Mapping[str, str | None] = {
  "batch": DATA,
  "embed": None,
  "heads": MODEL,
  "kv_heads": MODEL,
  "mlp": MODEL,
  "vocab": MODEL,
  "cache_heads": MODEL,
  "cache_seq": None,
  "head_dim": None,
  "layers": None,  # scanned layers' stacked axis: every device holds every layer
}


def resolve_shape(shape: Sequence[int], num_devices: int) -> tuple[int, ...]:
  """Replaces one -1 in `shape` by what is left of `num_devices`; checks the product."""
  shape = tuple(int(s) for s in shape)
  if shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
    raise ValueError(f"mesh shape entries must be >= 1, with at most one -1; got {shape}.")
  known = math.prod(s for s in shape if s != -1)
  if -1 in shape:
    if num_devices % known:
      raise ValueError(f"mesh shape {shape}: {num_devices} devices are not divisible by {known}.")
    shape = tuple(num_devices // known if s == -1 else s for s in shape)
  if math.prod(shape) != num_devices:
    raise ValueError(
      f"mesh shape {shape} needs {math.prod(shape)} devices; {num_devices} are available."
    )
  return shape


def make_mesh(
  shape: Sequence[int] = (-1, 1),
  axis_names: Sequence[str] = (DATA, MODEL),
  devices: Sequence[jax.Device] | int | None = None,
) -> Mesh:
  """A mesh of `shape` (one entry may be -1: "the rest").

  `devices`: the devices to use, or an int n for the first n of `jax.devices()`
  (None: all global devices; the shape must then account for every one).

  Refused when `jax_threefry_partitionable` is off (samples would then depend
  on the sharding).

  """
  if not jax.config.jax_threefry_partitionable:
    raise ValueError(
      "make_mesh needs jax_threefry_partitionable=True (JAX's default) so that sampled "
      "tokens do not depend on the mesh; it is off in this process."
    )
  if devices is None or isinstance(devices, int):
    devices = jax.devices()[:devices] if devices else jax.devices()
  devices = list(devices)
  if len(shape) != len(axis_names):
    raise ValueError(
      f"mesh shape {tuple(shape)} and axis names {tuple(axis_names)} differ in length."
    )
  shape = resolve_shape(shape, len(devices))
  return jax.make_mesh(
    shape, tuple(axis_names), axis_types=(AxisType.Auto,) * len(shape), devices=devices
  )


def logical_to_spec(
  names: Sequence[str | None],
  shape: Sequence[int] | None = None,
  mesh_shape: Mapping[str, int] | None = None,
  rules: Mapping[str, str | None] = LOGICAL_RULES,
) -> PartitionSpec:
  """The mesh `PartitionSpec` of an array whose axes carry logical `names`.

  With `shape` and `mesh_shape`, a dimension that the mesh axis does not divide
  is replicated instead (e.g. 2 kv heads on a model axis of 4 when the head
  dimension is not flattened in), and a mesh axis is used at most once.
  """
  used, spec = set(), []
  for i, name in enumerate(names):
    axis = rules.get(name) if name is not None else None
    if axis is not None and mesh_shape is not None:
      size = mesh_shape.get(axis, 1)
      if axis in used or (shape is not None and shape[i] % size):
        axis = None
    if axis is not None:
      used.add(axis)
    spec.append(axis)
  return PartitionSpec(*spec)


def named_sharding(
  mesh: Mesh,
  names: Sequence[str | None],
  shape: Sequence[int],
  rules: Mapping[str, str | None] = LOGICAL_RULES,
) -> NamedSharding:
  return NamedSharding(mesh, logical_to_spec(names, shape, dict(mesh.shape), rules))


def shard_shape(
  shape: Sequence[int], spec: PartitionSpec, mesh_shape: Mapping[str, int]
) -> tuple[int, ...]:
  """The per-device block of an array of `shape` under `spec` (no devices needed)."""
  out = []
  for i, size in enumerate(shape):
    axes = spec[i] if i < len(spec) else None
    axes = (axes,) if isinstance(axes, str) else (axes or ())
    out.append(size // int(np.prod([mesh_shape[a] for a in axes])) if axes else size)
  return tuple(out)


def constrain(
  x: jax.Array, names: Sequence[str | None], rules: Mapping[str, str | None] = LOGICAL_RULES
) -> jax.Array:
  """Pins `x`'s sharding by logical names under the current mesh (`jax.set_mesh`);
  an identity when no mesh is set, so one code path serves every device count."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  spec = logical_to_spec(names, x.shape, dict(mesh.shape), rules)
  return jax.lax.with_sharding_constraint(x, spec)
