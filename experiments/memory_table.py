"""Bytes each device holds for parameters and KV caches, from the shardings alone.

  python -m experiments.memory_table [--batch=8] [--output_json=PATH]

For the bundled target, a 1.1B Llama shape (TinyLlama) and a 70B Llama shape,
on meshes 1, 2x4 and 1x8 (data x model), with the default logical-axis rules
(`specjax.distributed.LOGICAL_RULES`): parameters tensor-parallel over
`model`, caches over `data` (rows) and `model` (kv heads). Nothing is
allocated: shapes come from `nnx.eval_shape`, blocks from the partition specs
(a dimension the mesh axis does not divide is replicated, as `shard_model`
does).
"""

from __future__ import annotations

import json

import jax.numpy as jnp
from absl import app, flags
from flax import nnx

from specjax import pretrained
from specjax.distributed.mesh import logical_to_spec, shard_shape
from specjax.hf import model_config, read_config
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import CACHE_AXES
from specjax.models.transformer import Transformer

MESHES = ((1, 1), (2, 4), (1, 8))
SHAPES = {
    "1.1B (TinyLlama shape)": ModelConfig(
        vocab_size=32000, d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, d_ff=5632,
        max_seq_len=2048, dtype="bfloat16", param_dtype="bfloat16"),
    "70B (Llama 2 70B shape)": ModelConfig(
        vocab_size=32000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672,
        max_seq_len=4096, dtype="bfloat16", param_dtype="bfloat16"),
}


def per_device_bytes(cfg: ModelConfig, mesh_shape: tuple[int, int], batch: int,
                     capacity: int) -> dict[str, float]:
  axes = {"data": mesh_shape[0], "model": mesh_shape[1]}
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  params = 0
  for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    value = v.get_value()
    names = v.get_metadata().get("out_sharding") or (None,) * value.ndim
    block = shard_shape(value.shape, logical_to_spec(names, value.shape, axes), axes)
    params += int(jnp.prod(jnp.array(block))) * value.dtype.itemsize
  cache_shape = (batch, cfg.n_kv_heads, capacity, cfg.resolved_head_dim)
  block = shard_shape(cache_shape, logical_to_spec(CACHE_AXES, cache_shape, axes), axes)
  itemsize = jnp.dtype(cfg.compute_dtype).itemsize
  cache = 2 * cfg.n_layers * int(jnp.prod(jnp.array(block))) * itemsize
  return {"params_gib": params / 2**30, "cache_gib": cache / 2**30,
          "total_gib": (params + cache) / 2**30}


def table(batch: int) -> list[dict]:
  shapes = {"bundled target": model_config(read_config(pretrained.TARGET_DIR), "float32"),
            **SHAPES}
  rows = []
  for name, cfg in shapes.items():
    capacity = cfg.max_seq_len
    for mesh in MESHES:
      rows.append({"model": name, "mesh": f"{mesh[0]}x{mesh[1]}", "batch": batch,
                   "cache_capacity": capacity, "dtype": cfg.param_dtype,
                   **per_device_bytes(cfg, mesh, batch, capacity)})
  return rows


def markdown(rows: list[dict]) -> str:
  lines = ["| model | mesh (data×model) | dtype | params / device | KV cache / device "
           "(batch, capacity) | total / device |", "|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['model']} | {r['mesh']} | {r['dtype']} | {r['params_gib']:.3f} GiB | "
                 f"{r['cache_gib']:.3f} GiB ({r['batch']}, {r['cache_capacity']}) | "
                 f"{r['total_gib']:.3f} GiB |")
  return "\n".join(lines)


def main(argv):
  del argv
  rows = table(flags.FLAGS.batch)
  print(json.dumps(rows, indent=2))
  print(markdown(rows))
  if flags.FLAGS.output_json:
    with open(flags.FLAGS.output_json, "w") as f:
      json.dump(rows, f, indent=2)


if __name__ == "__main__":
  flags.DEFINE_integer("batch", 8, "Rows of the KV cache.")
  flags.DEFINE_string("output_json", None, "Also write the JSON here.")
  app.run(main)
