"""Bytes each device holds for parameters and KV caches, from the shardings alone:
what `experiments/memory_table.py` runs (`table`).

The bundled target, TinyLlama and Llama-70B shapes on meshes 1, 2x4 and 1x8
(data x model) with the default rules (`specjax.distributed.LOGICAL_RULES`).
Nothing is allocated: `nnx.eval_shape` and the real placement functions on an
abstract mesh.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh

from specjax import pretrained
from specjax.distributed import DATA, MODEL, named_sharding, param_shardings
from specjax.hf import model_config, read_config
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import CACHE_AXES
from specjax.models.transformer import Transformer
from specjax.results import markdown_table

MESHES = ((1, 1), (2, 4), (1, 8))
SHAPES = {
  "1.1B (TinyLlama shape)": ModelConfig(
    vocab_size=32000,
    d_model=2048,
    n_layers=22,
    n_heads=32,
    n_kv_heads=4,
    d_ff=5632,
    max_seq_len=2048,
    dtype="bfloat16",
    param_dtype="bfloat16",
  ),
  "70B (Llama 2 70B shape)": ModelConfig(
    vocab_size=32000,
    d_model=8192,
    n_layers=80,
    n_heads=64,
    n_kv_heads=8,
    d_ff=28672,
    max_seq_len=4096,
    dtype="bfloat16",
    param_dtype="bfloat16",
  ),
}


@functools.cache  # one trace per model shape, not per mesh (ModelConfig is frozen)
def abstract_model(cfg: ModelConfig) -> Transformer:
  """`cfg`'s model as shapes and dtypes only (`nnx.eval_shape`): nothing allocated."""
  return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))


def param_bytes(cfg: ModelConfig, mesh: AbstractMesh) -> int:
  """Bytes of `cfg`'s parameters one device of `mesh` holds.

  Exactly a 1-layer model's bytes plus n_layers - 1 times what a second layer
  adds (every layer has the same shapes; tracing 80 layers took minutes).
  """

  if cfg.n_layers > 2:
    one, two = (param_bytes(cfg.replace(n_layers=n, local_layers=None), mesh) for n in (1, 2))
    return one + (cfg.n_layers - 1) * (two - one)
  model = abstract_model(cfg)
  values = jax.tree.leaves(nnx.state(model, nnx.Param))
  shardings = jax.tree.leaves(param_shardings(model, mesh))
  return sum(
    math.prod(sharding.shard_shape(value.shape)) * value.dtype.itemsize
    for value, sharding in zip(values, shardings, strict=True)
  )


def per_device_bytes(
  cfg: ModelConfig, mesh_shape: tuple[int, int], batch: int, capacity: int
) -> dict[str, float]:
  """GiB of parameters and K/V caches one device holds on a (data, model) mesh."""
  mesh = AbstractMesh(tuple(mesh_shape), (DATA, MODEL))
  params = param_bytes(cfg, mesh)
  cache_shape = (batch, cfg.n_kv_heads, capacity, cfg.resolved_head_dim)
  block = named_sharding(mesh, CACHE_AXES, cache_shape).shard_shape(cache_shape)
  itemsize = jnp.dtype(cfg.compute_dtype).itemsize
  cache = 2 * cfg.n_layers * math.prod(block) * itemsize  # keys and values
  return {
    "params_gib": params / 2**30,
    "cache_gib": cache / 2**30,
    "total_gib": (params + cache) / 2**30,
  }


def table(batch: int) -> list[dict]:
  """One row per (model shape, mesh), each model's cache at its max_seq_len."""
  shapes = {"bundled target": model_config(read_config(pretrained.TARGET_DIR), "float32"), **SHAPES}
  rows = []
  for name, cfg in shapes.items():
    capacity = cfg.max_seq_len
    for mesh in MESHES:
      rows.append(
        {
          "model": name,
          "mesh": f"{mesh[0]}x{mesh[1]}",
          "batch": batch,
          "cache_capacity": capacity,
          "dtype": cfg.param_dtype,
          **per_device_bytes(cfg, mesh, batch, capacity),
        }
      )
  return rows


COLUMNS = (
  ("model", "{model}"),
  ("mesh (data×model)", "{mesh}"),
  ("dtype", "{dtype}"),
  ("params / device", "{params_gib:.3f} GiB"),
  ("KV cache / device (batch, capacity)", "{cache_gib:.3f} GiB ({batch}, {cache_capacity})"),
  ("total / device", "{total_gib:.3f} GiB"),
)


def markdown(rows: list[dict]) -> str:
  """The rows as a markdown table."""
  return markdown_table(rows, COLUMNS)
