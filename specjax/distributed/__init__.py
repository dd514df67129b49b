"""Scale-out: meshes, logical-axis rules, placement, multi-host start-up."""

from specjax.distributed.mesh import (
  DATA,
  LOGICAL_RULES,
  MODEL,
  constrain,
  logical_to_spec,
  make_mesh,
  named_sharding,
  resolve_shape,
  shard_shape,
)
from specjax.distributed.placement import (
  param_shardings,
  shard_batch,
  shard_model,
  shard_process_batch,
)

__all__ = [
  "DATA",
  "LOGICAL_RULES",
  "MODEL",
  "constrain",
  "logical_to_spec",
  "make_mesh",
  "named_sharding",
  "param_shardings",
  "resolve_shape",
  "shard_batch",
  "shard_model",
  "shard_process_batch",
  "shard_shape",
]
