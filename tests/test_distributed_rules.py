"""Mesh shapes, logical-axis rules and the memory arithmetic (no devices needed)."""

import jax
import pytest
from jax.sharding import PartitionSpec

from specjax.distributed import logical_to_spec, make_mesh, resolve_shape, shard_shape
from specjax.models.config import ModelConfig


def test_resolve_shape():
  assert resolve_shape((-1, 4), 8) == (2, 4)
  assert resolve_shape((2, -1), 8) == (2, 4)
  assert resolve_shape((8, 1), 8) == (8, 1)
  with pytest.raises(ValueError, match=r"mesh shape \(3, 1\) needs 3 devices; 8 are available"):
    resolve_shape((3, 1), 8)
  with pytest.raises(ValueError, match="8 devices are not divisible by 3"):
    resolve_shape((-1, 3), 8)
  with pytest.raises(ValueError, match="at most one -1"):
    resolve_shape((-1, -1), 8)


def test_make_mesh_refuses_sharding_dependent_random_bits():
  assert jax.config.jax_threefry_partitionable  # JAX's default, which specjax relies on
  assert make_mesh((1, 1), devices=1).shape == {"data": 1, "model": 1}
  with (
    jax.threefry_partitionable(False),
    pytest.raises(ValueError, match="make_mesh needs jax_threefry_partitionable=True"),
  ):
    make_mesh((1, 1), devices=1)


def test_rules_map_logical_names_and_replicate_what_does_not_divide():
  axes = {"data": 2, "model": 4}
  assert logical_to_spec(("embed", "heads"), (64, 64), axes) == PartitionSpec(None, "model")
  assert logical_to_spec(("vocab", "embed"), (512, 64), axes) == PartitionSpec("model", None)
  # 2 kv heads cannot split 4 ways: replicated, not refused.
  cache = ("batch", "cache_heads", "cache_seq", "head_dim")
  assert logical_to_spec(cache, (8, 2, 16, 16), axes) == PartitionSpec("data", None, None, None)
  assert logical_to_spec(cache, (8, 4, 16, 16), axes) == PartitionSpec("data", "model", None, None)
  # A mesh axis is used once per array.
  assert logical_to_spec(("heads", "mlp"), (8, 8), axes) == PartitionSpec("model", None)
  assert shard_shape((8, 4, 16, 16), PartitionSpec("data", "model"), axes) == (4, 1, 16, 16)


def test_memory_table_shrinks_with_tensor_parallelism():
  from specjax.jobs.memory_table import per_device_bytes

  cfg = ModelConfig(
    vocab_size=512, d_model=64, n_layers=2, n_heads=8, n_kv_heads=8, d_ff=256, max_seq_len=128
  )
  one = per_device_bytes(cfg, (1, 1), batch=8, capacity=128)
  tp = per_device_bytes(cfg, (1, 8), batch=8, capacity=128)
  dp = per_device_bytes(cfg, (8, 1), batch=8, capacity=128)
  params = 4 * (512 * 64 * 2 + 2 * (4 * 64 * 64 + 3 * 64 * 256 + 2 * 64) + 64)
  assert one["params_gib"] * 2**30 == params
  # Everything but the norms splits 8 ways over model; data parallelism replicates params.
  assert tp["params_gib"] * 2**30 == (params - 4 * 64 * 5) / 8 + 4 * 64 * 5
  assert dp["params_gib"] == one["params_gib"]
  assert tp["cache_gib"] == dp["cache_gib"] == one["cache_gib"] / 8
